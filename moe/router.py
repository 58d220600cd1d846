"""MoE routing: gate logits -> (expert ids, weights) per token, DeepSeek V2/V3/V4 style.

`route()` is the function form (docs/numerics.md); `Router` is the module holding the gate weight
(fp32 logits), the `e_score_correction_bias` buffer and, for V4 hash layers, the
`tid2eid` table. The one idea: the *biased* score picks the experts, the *unbiased*
score weights them.

    scores  = softmax(l) | sigmoid(l) | sqrt(softplus(l))           [T, E] fp32
    select  = scores + bias                                          (bias only for selection)
    groups  : keep the `topk_group` best of `n_group` contiguous groups
              (group score = sum of its top-2 biased scores; max of scores without bias)
    ids     = top-k of select over surviving experts (ties: lowest expert index)
    weights = scores[ids]; / sum (if renormalize and sum > 0); * scaling
    hash    : ids = tid2eid[input_ids], no top-k and no bias; weights as above
    padding : tokens with token_mask False get id -1 and weight 0

The torch path below is the specification and runs anywhere with autograd; on CUDA the
fused Triton kernel (`moe/kernels/routing.py`) does the whole thing in one launch and is
used when no gradient is needed (`backend="auto"`). Expert ids are int64.
"""

from __future__ import annotations

import functools
import logging
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from megapar.moe.kernels.route_result import RouteResult
from megapar.parallel import impl

log = logging.getLogger(__name__)

Scoring = Literal["softmax", "sigmoid", "sqrt_softplus"]
SCORING_FUNCS: tuple[str, ...] = ("softmax", "sigmoid", "sqrt_softplus")


def _auto_forward_only(f: impl.Facts) -> impl.Unusable | None:
    """"auto" keeps autograd on the torch path; the fused kernel named explicitly runs anyway."""
    return None if f.asked else impl.forward_only(f)


ROUTE = impl.Op("moe.route", [
    impl.Impl("triton", impl.triton_kernel(impl.cuda_unless_asked, _auto_forward_only)),
    impl.Impl("torch"),
])
ROUTE_BACKENDS: tuple[str, ...] = ROUTE.names


def route(
    logits: torch.Tensor,
    *,
    top_k: int,
    scoring: Scoring = "softmax",
    bias: torch.Tensor | None = None,
    n_group: int | None = None,
    topk_group: int | None = None,
    renormalize: bool = True,
    scaling: float = 1.0,
    input_ids: torch.Tensor | None = None,
    tid2eid: torch.Tensor | None = None,
    token_mask: torch.Tensor | None = None,
    backend: str = "auto",
    check_ids: bool | None = None,
) -> RouteResult:
    """Route tokens to experts (docs/numerics.md).

    logits:     [T, E] float (computed in fp32; other dtypes are upcast)
    bias:       [E] float32 `e_score_correction_bias`, selection only; ignored by hash layers
    n_group, topk_group: grouped top-k (V3); None or 1 = no group limit
    input_ids:  [T] int, token ids of a hash layer (required when `tid2eid` is given)
    tid2eid:    [vocab, K] int, hash-layer table token id -> expert ids
    token_mask: [T] bool, False = padding token (id -1, weight 0); None = all real
    backend:    "auto" (fused Triton on CUDA when no gradient is needed), "torch", "triton"
    check_ids:  range-check a hash layer's input_ids against the table. It reads values, so on
                CUDA it is a device->host sync: None (default) checks CPU tensors only; True
                always; False never. Out-of-range ids are undefined behaviour when unchecked.

    Only shapes, dtypes and options are checked per call (no tensor values, no host sync), so
    the fused path costs one kernel launch plus two `torch.empty`.
    """
    _check_route_args(logits, top_k, scoring, bias, n_group, topk_group, input_ids, tid2eid, token_mask, backend)
    if tid2eid is not None and (not input_ids.is_cuda if check_ids is None else check_ids):
        _check_hash_ids(input_ids, tid2eid, token_mask)
        check_hash_table(tid2eid, logits.shape[1])
    if n_group is not None and n_group <= 1:
        n_group = topk_group = None
    if backend != "torch" and ROUTE.resolve(backend, device=logits.device,
                                            needs_grad=impl.grad_needed(logits)) == "triton":
        return _route_triton()(logits, top_k=top_k, scoring=scoring, bias=bias, n_group=n_group,
                               topk_group=topk_group, renormalize=renormalize, scaling=scaling,
                               input_ids=input_ids, tid2eid=tid2eid, token_mask=token_mask)
    return route_torch(logits, top_k=top_k, scoring=scoring, bias=bias, n_group=n_group,
                       topk_group=topk_group, renormalize=renormalize, scaling=scaling,
                       input_ids=input_ids, tid2eid=tid2eid, token_mask=token_mask)


def route_torch(
    logits: torch.Tensor,
    *,
    top_k: int,
    scoring: str,
    bias: torch.Tensor | None,
    n_group: int | None,
    topk_group: int | None,
    renormalize: bool,
    scaling: float,
    input_ids: torch.Tensor | None,
    tid2eid: torch.Tensor | None,
    token_mask: torch.Tensor | None,
) -> RouteResult:
    """Eager torch routing (the reference; differentiable in the weights). Arguments are
    assumed checked by `route()`."""
    scores = score_logits(logits.float(), scoring)  # [T, E] fp32
    num_tokens, num_experts = scores.shape
    if tid2eid is not None:
        safe_ids = input_ids if token_mask is None else input_ids.masked_fill(~token_mask, 0)
        topk_ids = tid2eid[safe_ids.long()].long()  # [T, K]
    else:
        select = scores.detach() if bias is None else scores.detach() + bias.float()
        if n_group is not None:
            size = num_experts // n_group
            grouped = select.view(num_tokens, n_group, size)
            if bias is not None:
                group_scores = grouped.topk(min(2, size), dim=-1).values.sum(-1)
            else:
                group_scores = grouped.amax(dim=-1)  # [T, G]
            # the kept groups' experts in ascending id order (so the stable sort still ties to the lowest
            # id), and the top-k over them alone: filling the dropped groups with -inf instead let them
            # tie with a kept expert whose selection score is -inf (a bias of -inf) and win on index
            kept = _topk_lowest_index(group_scores, topk_group).sort(dim=-1).values  # [T, topk_group]
            candidates = (kept[:, :, None] * size + torch.arange(size, device=kept.device)).flatten(1)
            topk_ids = candidates.gather(1, _topk_lowest_index(select.gather(1, candidates), top_k))
        else:
            topk_ids = _topk_lowest_index(select, top_k)
    weights = scores.gather(1, topk_ids)  # [T, K] fp32
    if renormalize:
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / torch.where(total > 0, total, torch.ones_like(total))
    if scaling != 1.0:
        weights = weights * scaling
    if token_mask is not None:
        topk_ids = topk_ids.masked_fill(~token_mask[:, None], -1)
        weights = weights.masked_fill(~token_mask[:, None], 0.0)
    return RouteResult(topk_ids=topk_ids, topk_weights=weights)


def score_logits(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """Scores from fp32 logits: softmax over experts, sigmoid, or sqrt(softplus) (softplus(x) =
    x above 20). Equal logits of a row score exactly equal on every device (`_per_value`)."""
    if scoring == "softmax":
        if logits.device.type != "cpu":      # (one kernel; see `_per_value`)
            return logits.softmax(dim=-1)
        shifted = logits - logits.amax(dim=-1, keepdim=True)
        e = _per_value(torch.exp, shifted)
        return e / e.sum(dim=-1, keepdim=True)
    if scoring == "sigmoid":
        return _per_value(torch.sigmoid, logits)
    if scoring == "sqrt_softplus":
        return _per_value(lambda x: F.softplus(x, beta=1.0, threshold=20.0).sqrt(), logits)
    raise ValueError(f"unknown scoring {scoring!r}; valid: {', '.join(SCORING_FUNCS)}")


def _per_value(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise fn, with one result per distinct value of x. torch's CPU kernels
    run a vectorized function over most of a tensor and a scalar one over its tail, which can
    round the same input differently (sqrt(softplus(0.75)) came out 1.0662415 at expert 7 and
    1.0662416 at expert 13 of a 14-expert fp32 row), so equal logits could score unequally and
    break the rule that ties go to the lowest expert id. On the CPU the values come from fn over
    the distinct inputs, the gradient from fn(x); a CUDA kernel applies one function to every
    element, so there fn(x) stands as it is."""
    out = fn(x)
    if x.device.type != "cpu" or x.numel() == 0:
        return out
    distinct, index = torch.unique(x.detach(), return_inverse=True)
    values = fn(distinct)[index]
    # exactly those values with fn(x)'s gradient; where they agree, fn(x) itself (an infinite
    # score, sqrt(softplus(inf)), stays inf: inf - inf would make it NaN)
    return torch.where(out == values, out, values + (out - out.detach()))


def _topk_lowest_index(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest values along the last dim; ties go to the lowest index.
    (`torch.topk` does not promise an order among equal values; a stable sort does.)"""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def _check_route_args(logits, top_k, scoring, bias, n_group, topk_group, input_ids, tid2eid, token_mask,
                      backend) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a float [T, E] tensor; got shape {tuple(logits.shape)} dtype {logits.dtype}")
    num_tokens, num_experts = logits.shape
    if scoring not in SCORING_FUNCS:
        raise ValueError(f"unknown scoring {scoring!r}; valid: {', '.join(SCORING_FUNCS)}")
    if backend not in ROUTE_BACKENDS:
        raise ValueError(f"unknown routing backend {backend!r}; valid: {', '.join(ROUTE_BACKENDS)}")
    _check_top_k(top_k, num_experts)
    if bias is not None and tuple(bias.shape) != (num_experts,):
        raise ValueError(f"bias must have shape [{num_experts}] (num_experts); got {tuple(bias.shape)}")
    if token_mask is not None and (token_mask.dtype != torch.bool or tuple(token_mask.shape) != (num_tokens,)):
        raise ValueError(f"token_mask must be a bool [{num_tokens}] tensor; got {token_mask.dtype} {tuple(token_mask.shape)}")
    if tid2eid is not None:
        if tid2eid.dim() != 2 or tid2eid.shape[1] != top_k or tid2eid.is_floating_point():
            raise ValueError(f"tid2eid must be an int [vocab, top_k={top_k}] table; got {tid2eid.dtype} {tuple(tid2eid.shape)}")
        if input_ids is None:
            raise ValueError("a hash layer (tid2eid given) needs input_ids: [T] token ids")
        if tuple(input_ids.shape) != (num_tokens,) or input_ids.is_floating_point():
            raise ValueError(f"input_ids must be an int [{num_tokens}] tensor; got {input_ids.dtype} {tuple(input_ids.shape)}")
        return
    _check_groups(n_group, topk_group, top_k, num_experts)


def _check_groups(n_group, topk_group, top_k: int, num_experts: int) -> None:
    """Grouped top-k arguments: both None, or ints with 1 <= topk_group <= n_group (n_group 1: no
    group limit), n_group dividing num_experts and top_k within the kept groups' experts."""
    if (n_group is None) != (topk_group is None):
        raise ValueError(f"n_group ({n_group}) and topk_group ({topk_group}) must be given together")
    if n_group is None:
        return
    if isinstance(n_group, bool) or not isinstance(n_group, int) or n_group < 1:
        raise ValueError(f"n_group ({n_group!r}) must be an int >= 1 (None or 1: no group limit)")
    if isinstance(topk_group, bool) or not isinstance(topk_group, int) or not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group ({topk_group!r}) must be in [1, n_group={n_group}] (an int)")
    if n_group > 1:
        if num_experts % n_group:
            raise ValueError(f"n_group ({n_group}) must divide num_experts ({num_experts})")
        if top_k > topk_group * (num_experts // n_group):
            raise ValueError(f"top_k ({top_k}) exceeds the experts in the kept groups "
                             f"(topk_group {topk_group} x {num_experts // n_group} experts per group)")


def _check_top_k(top_k: object, num_experts: int) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k ({top_k!r}) must be in [1, num_experts={num_experts}] (an int)")


def check_hash_table(tid2eid: torch.Tensor, num_experts: int) -> None:
    """Every expert id of a hash table [vocab, K] must lie in [0, num_experts) (reads values: a
    device->host sync on CUDA, so Router runs it once per loaded or assigned table)."""
    if tid2eid.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(tid2eid))
    if lo < 0 or hi >= num_experts:
        bad = ((tid2eid < 0) | (tid2eid >= num_experts)).nonzero()[0].tolist()
        raise ValueError(f"tid2eid holds expert ids in [{lo}, {hi}], outside [0, num_experts={num_experts}) "
                         f"(first at token id {bad[0]}, slot {bad[1]}: {int(tid2eid[bad[0], bad[1]])})")


def _check_hash_ids(input_ids: torch.Tensor, tid2eid: torch.Tensor, token_mask: torch.Tensor | None) -> None:
    """input_ids of real tokens must index the hash table (a value check: syncs on CUDA)."""
    if input_ids.numel() == 0:
        return
    ids = input_ids if token_mask is None else input_ids.masked_fill(~token_mask, 0)
    lo, hi = (int(v) for v in torch.aminmax(ids))
    if lo < 0 or hi >= tid2eid.shape[0]:
        raise ValueError(f"input_ids range [{lo}, {hi}] is outside the hash table's vocab [0, {tid2eid.shape[0]})")


@functools.lru_cache(maxsize=1)
def _route_triton():
    """`moe.kernels.routing.route_triton`, imported on first use (it imports triton)."""
    from megapar.moe.kernels.routing import route_triton

    return route_triton


class Router(nn.Module):
    """Gate of one MoE layer: `x [T, H] -> RouteResult`.

    Parameters/buffers use DeepSeek checkpoint names: `weight` [E, H] (the gate linear,
    logits computed in fp32), `e_score_correction_bias` [E] fp32 (when `use_bias`), and
    `tid2eid` [vocab, K] int32 for a hash layer (`hash_vocab` given).
    """

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        *,
        scoring: Scoring = "softmax",
        use_bias: bool = False,
        n_group: int | None = None,
        topk_group: int | None = None,
        renormalize: bool = True,
        scaling: float = 1.0,
        hash_vocab: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("hidden", hidden), ("num_experts", num_experts)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Router {name} must be a positive int, got {value!r}")
        if scoring not in SCORING_FUNCS:
            raise ValueError(f"unknown scoring {scoring!r}; valid: {', '.join(SCORING_FUNCS)}")
        _check_top_k(top_k, num_experts)
        if hash_vocab is None:  # (a hash layer has no top-k, so no groups)
            _check_groups(n_group, topk_group, top_k, num_experts)
        self.hidden, self.num_experts, self.top_k = hidden, num_experts, top_k
        self.scoring, self.renormalize, self.scaling = scoring, renormalize, scaling
        self.n_group, self.topk_group = n_group, topk_group
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype, device=device))
        nn.init.normal_(self.weight, std=hidden ** -0.5)
        if use_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32, device=device))
        else:
            self.e_score_correction_bias = None
        if hash_vocab is not None:
            table = torch.randint(0, num_experts, (hash_vocab, top_k), dtype=torch.int32, device=device)
            self.register_buffer("tid2eid", table)
        else:
            self.tid2eid = None

    @property
    def is_hash(self) -> bool:
        return self.tid2eid is not None

    def _check_table(self) -> None:
        """Range-check tid2eid once per content: after construction, load_state_dict, an in-place
        copy (the tensor's version counter moves) or an assignment; not on every forward."""
        table = self.tid2eid
        key = (id(table), table.data_ptr(), table._version)
        if getattr(self, "_checked_table", None) != key:
            check_hash_table(table, self.num_experts)
            self._checked_table = key

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] any float -> [T, E] fp32 gate logits: x and the weight are both taken to fp32
        (as HF's DeepseekV3TopkRouter does), so a bf16 gate weight does not round the logits to bf16."""
        if x.shape[-1] != self.hidden:
            raise ValueError(f"router hidden size mismatch: x has {x.shape[-1]}, gate expects {self.hidden}")
        return F.linear(x.float(), self.weight.float())

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None,
                token_mask: torch.Tensor | None = None, backend: str = "auto") -> RouteResult:
        """x: [T, H]; input_ids: [T] int (hash layers); token_mask: [T] bool (False = padding)."""
        if self.is_hash and input_ids is None:
            raise ValueError("this Router is a hash layer (tid2eid) and needs input_ids: [T] token ids")
        if self.is_hash:
            self._check_table()
        return route(self.logits(x), top_k=self.top_k, scoring=self.scoring, bias=self.e_score_correction_bias,
                     n_group=self.n_group, topk_group=self.topk_group, renormalize=self.renormalize,
                     scaling=self.scaling, input_ids=input_ids if self.is_hash else None, tid2eid=self.tid2eid,
                     token_mask=token_mask, backend=backend)

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, num_experts={self.num_experts}, top_k={self.top_k}, scoring={self.scoring}, "
                f"n_group={self.n_group}, topk_group={self.topk_group}, scaling={self.scaling}, hash={self.is_hash}")
