"""The MoE layer users import: `MoELayer(config, ep_group)` maps hidden states [T, H] to the
MoE output [T, H] at any expert-parallel size.

    out = combine(experts(dispatch(x, route(gate(x))))) + shared_experts(x)

Token modes (`tokens=`):
- "sequence_parallel": each EP rank brings its own tokens; they travel to the experts'
  ranks through `parallel.ep` dispatch/combine and come back weighted (fp32 sum).
- "replicated": every EP rank holds the same tokens (e.g. TP-replicated activations). Nothing
  is dispatched: each rank runs its own experts on the tokens routed to them (a local
  dispatch), and the partial outputs are all-reduced over the EP group (autograd: identity
  into the region with an all-reduced gradient, all-reduce out of it with an identity one).
At EP = 1 there is no communication at all in either mode.

Overlap (`overlap_chunks=n > 1`): the tokens are split into n chunks; chunk i+1 is dispatched
(async) before chunk i's experts run, and chunk i's combine (or all-reduce) is in flight while
chunk i+1 computes. Per token the arithmetic is that of the plain path (same experts, same
weights, fp32 combine over k), so outputs agree to rounding of the GEMM blocking. Every rank
of the group must use the same n (chunks may be empty). Default: 1 at EP = 1, else 2.
Micro-batch overlap (`parallel.ubatch`) is the other mechanism: the plain path yields to the
other micro-batch around dispatch and combine (no-ops outside a `UBatchRunner`).

Expert load: every forward counts the tokens per logical expert with one scatter-add
(`layer.expert_counts`, [E] int64, this rank's tokens); with `eplb=` the ids are mapped to
physical slots through `Eplb.route`, which records the per-slot counts for rebalancing.

Backends: "python" (this module: router -> parallel.ep -> moe.kernels); "mega_moe" is the
seam for DeepGEMM's fused Blackwell kernel (checked and refused with the reason for now).

Loading: `load_deepseek(state)` takes DeepSeek names relative to the MoE module
(`gate.weight`, `gate.e_score_correction_bias`, `gate.tid2eid`, `experts.{e}.w1/w2/w3.weight`
[+ scales], `shared_experts.w1/w2/w3.weight`) and keeps only this rank's experts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal, Mapping

import torch
import torch.distributed as dist
from torch import nn

from moe.experts import EXPERT_FORMATS, GATE_UP_LAYOUTS, Experts, SharedExpert
from moe.router import SCORING_FUNCS, Router, Scoring
from parallel import comm
from parallel.groups import Group
from parallel.ubatch import ubatch_yield

TOKEN_MODES: tuple[str, ...] = ("replicated", "sequence_parallel")
LAYER_BACKENDS: tuple[str, ...] = ("python", "mega_moe")


def _check_mega_moe() -> None:
    """The seam for DeepGEMM's fused MegaMoE (`deep_gemm.fp8_fp4_mega_moe`: dispatch, FP8 x FP4
    expert GEMMs and combine in one kernel; Blackwell only). Not wired yet: says why."""
    try:
        import deep_gemm
    except ImportError:
        raise ValueError("backend='mega_moe' needs DeepGEMM (pip install deepinfer-gemm) on a Blackwell "
                         "(sm_100) GPU; use backend='python'") from None
    if not hasattr(deep_gemm, "fp8_fp4_mega_moe"):
        raise ValueError("this deep_gemm has no fp8_fp4_mega_moe; use backend='python'")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 10:
        raise ValueError("backend='mega_moe' runs on Blackwell (sm_100) GPUs only; use backend='python'")
    raise ValueError("backend='mega_moe' is not wired into MoELayer yet (no Blackwell machine to test it); "
                     "use backend='python'")


@dataclass(kw_only=True, frozen=True)
class MoEConfig:
    """Shape and behaviour of one MoE layer (SPEC §1-3)."""

    hidden: int
    """model hidden size H"""
    inter: int
    """intermediate size I of one routed expert"""
    num_experts: int
    """routed (logical) experts E"""
    top_k: int
    """experts per token K"""
    scoring: Scoring = "sigmoid"
    """router score function: softmax, sigmoid (V3), sqrt_softplus (V4)"""
    use_bias: bool = True
    """router has e_score_correction_bias (selection only)"""
    n_group: int | None = None
    """expert groups for grouped top-k (V3: 8); None = no group limit"""
    topk_group: int | None = None
    """groups kept per token (V3: 4)"""
    renormalize: bool = True
    """divide the K weights by their sum"""
    routed_scaling: float = 1.0
    """routed_scaling_factor applied to the weights"""
    swiglu_limit: float | None = None
    """clamp L of the routed experts' SwiGLU (V4: 10); None = no clamp"""
    swiglu_alpha: float = 1.0
    """SwiGLU alpha (DeepSeek 1, gpt-oss 1.702)"""
    swiglu_beta: float = 0.0
    """SwiGLU beta (DeepSeek 0, gpt-oss 1)"""
    gate_up: Literal["split", "interleaved"] = "split"
    """row layout of the fused W13"""
    num_shared: int = 1
    """shared experts (one MLP of width num_shared * shared_inter); 0 = none"""
    shared_inter: int | None = None
    """intermediate size of one shared expert (default: inter)"""
    shared_swiglu_limit: float | None = None
    """clamp of the shared expert's SwiGLU"""
    expert_format: str = "bf16"
    """routed expert weights: bf16, fp32, fp8_block, mxfp4, nvfp4"""
    hash_layer: bool = False
    """route by tid2eid[input_ids] (V4's first num_hash_layers layers)"""
    num_hash_layers: int = 0
    """model-level: how many leading MoE layers are hash layers (see for_layer)"""
    vocab: int | None = None
    """vocabulary size (the hash table's rows); needed by hash layers"""
    dtype: torch.dtype = torch.bfloat16
    """activation dtype (and shared expert weights)"""
    router_dtype: torch.dtype = torch.float32
    """gate weight dtype (logits are fp32 regardless)"""

    def __post_init__(self) -> None:
        for name in ("hidden", "inter", "num_experts", "top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} ({getattr(self, name)}) must be >= 1")
        if self.scoring not in SCORING_FUNCS:
            raise ValueError(f"unknown scoring {self.scoring!r}; valid: {', '.join(SCORING_FUNCS)}")
        if self.expert_format not in EXPERT_FORMATS:
            raise ValueError(f"unknown expert format {self.expert_format!r}; valid: {', '.join(EXPERT_FORMATS)}")
        if self.gate_up not in GATE_UP_LAYOUTS:
            raise ValueError(f"unknown gate_up layout {self.gate_up!r}; valid: {', '.join(GATE_UP_LAYOUTS)}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")
        if (self.hash_layer or self.num_hash_layers) and not self.vocab:
            raise ValueError("hash layers need vocab (rows of the tid2eid table)")

    def for_layer(self, index: int) -> MoEConfig:
        """This config for MoE layer `index` (a hash layer when index < num_hash_layers)."""
        return replace(self, hash_layer=index < self.num_hash_layers)

    @classmethod
    def deepseek_v3(cls, **overrides: Any) -> MoEConfig:
        """DeepSeek-V3: H 7168, I 2048, 256 experts top-8, sigmoid + bias, 8 groups keep 4, scale 2.5."""
        return cls(**{**dict(hidden=7168, inter=2048, num_experts=256, top_k=8, scoring="sigmoid", n_group=8,
                             topk_group=4, routed_scaling=2.5, num_shared=1), **overrides})

    @classmethod
    def deepseek_v4_flash(cls, **overrides: Any) -> MoEConfig:
        """DeepSeek-V4-Flash: H 4096, I 2048, 256 experts top-6, sqrt(softplus) + bias, no group
        limit, clamped SwiGLU (L = 10). num_hash_layers/vocab come from the checkpoint config."""
        return cls(**{**dict(hidden=4096, inter=2048, num_experts=256, top_k=6, scoring="sqrt_softplus",
                             swiglu_limit=10.0, num_shared=1), **overrides})

    @classmethod
    def deepseek_v4_pro(cls, **overrides: Any) -> MoEConfig:
        """DeepSeek-V4-Pro: H 7168, I 3072, 384 experts top-6, sqrt(softplus) + bias, scale 2.5,
        clamped SwiGLU (L = 10)."""
        return cls(**{**dict(hidden=7168, inter=3072, num_experts=384, top_k=6, scoring="sqrt_softplus",
                             routed_scaling=2.5, swiglu_limit=10.0, num_shared=1), **overrides})


PRESETS = {"v3": MoEConfig.deepseek_v3, "v4_flash": MoEConfig.deepseek_v4_flash, "v4_pro": MoEConfig.deepseek_v4_pro}


class _CopyToEP(torch.autograd.Function):
    """Replicated tokens entering per-rank expert work: identity; gradient all-reduced."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromEP(torch.autograd.Function):
    """Per-rank partial outputs -> their sum on every rank; gradient passes through."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return grad, None


def _chunk_sizes(num_tokens: int, chunks: int) -> list[int]:
    base, extra = divmod(num_tokens, chunks)
    return [base + (1 if i < extra else 0) for i in range(chunks)]


class MoELayer(nn.Module):
    """Router -> dispatch -> experts -> combine -> + shared expert (see module docstring)."""

    def __init__(
        self,
        config: MoEConfig,
        ep_group: Group | dist.ProcessGroup | None = None,
        *,
        tokens: Literal["replicated", "sequence_parallel"] = "sequence_parallel",
        overlap_chunks: int | None = None,
        dispatcher_backend: str = "auto",
        align: int = 1,
        backend: Literal["python", "mega_moe"] = "python",
        kernel_backend: str = "auto",
        eplb: Any = None,
        layer_index: int = 0,
        device: torch.device | str | None = None,
    ) -> None:
        """ep_group: a parallel Group, a ProcessGroup, or None for EP = 1 (no communication, even
        when torch.distributed is initialized). dispatcher_backend / align: `parallel.ep`
        make_dispatcher options; kernel_backend: `moe.kernels.expert_ffn` backend. eplb: a `parallel.ep.eplb_state.Eplb` shared by the
        model's MoE layers (physical slots, load tracking), with `layer_index` this layer's row."""
        super().__init__()
        if tokens not in TOKEN_MODES:
            raise ValueError(f"unknown tokens mode {tokens!r}; valid: {', '.join(TOKEN_MODES)}")
        if backend not in LAYER_BACKENDS:
            raise ValueError(f"unknown MoE layer backend {backend!r}; valid: {', '.join(LAYER_BACKENDS)}")
        if backend == "mega_moe":
            _check_mega_moe()
        if ep_group is None:
            pg, rank, size = None, 0, 1
        else:
            pg, rank, size = comm.resolve_group(ep_group)
        num_slots_total = eplb.num_physical if eplb is not None else config.num_experts
        if num_slots_total % size:
            valid = [d for d in range(1, num_slots_total + 1) if num_slots_total % d == 0]
            raise ValueError(f"num_experts ({num_slots_total}{' physical' if eplb is not None else ''}) is not "
                             f"divisible by the EP size ({size}); valid EP sizes: {', '.join(map(str, valid))}")
        if overlap_chunks is None:
            overlap_chunks = 1 if size == 1 else 2
        if overlap_chunks < 1:
            raise ValueError(f"overlap_chunks ({overlap_chunks}) must be >= 1")
        self.config, self.tokens, self.overlap_chunks = config, tokens, overlap_chunks
        self.ep_group, self.ep_rank, self.ep_size = pg, rank, size
        self.eplb, self.layer_index = eplb, layer_index
        self.num_slots = num_slots_total // size
        if eplb is not None:
            if eplb.ep_size != size:
                raise ValueError(f"eplb was built for EP size {eplb.ep_size}; this layer's EP group has {size}")
            local = eplb.local_experts(layer_index).tolist()
        else:
            local = list(range(rank * self.num_slots, (rank + 1) * self.num_slots))

        self.gate = Router(config.hidden, config.num_experts, config.top_k, scoring=config.scoring,
                           use_bias=config.use_bias and not config.hash_layer, n_group=config.n_group,
                           topk_group=config.topk_group, renormalize=config.renormalize,
                           scaling=config.routed_scaling, hash_vocab=config.vocab if config.hash_layer else None,
                           dtype=config.router_dtype, device=device)
        self.experts = Experts(config.num_experts, config.hidden, config.inter, fmt=config.expert_format,
                               local_experts=local, swiglu_limit=config.swiglu_limit, alpha=config.swiglu_alpha,
                               beta=config.swiglu_beta, gate_up=config.gate_up, device=device,
                               backend=kernel_backend)
        if config.num_shared > 0:
            self.shared_experts = SharedExpert(config.hidden, config.num_shared * (config.shared_inter or config.inter),
                                               swiglu_limit=config.shared_swiglu_limit, dtype=config.dtype,
                                               device=device)
        else:
            self.shared_experts = None
        if eplb is not None:
            eplb.register_weights(layer_index, self.experts.slot_tensors())

        from parallel.ep import make_dispatcher

        distributed = size > 1 and tokens == "sequence_parallel"
        local_group = Group(name="ep_local", group=None, rank=0, size=1, ranks=(rank,))
        self.dispatcher = make_dispatcher(ep_group if distributed else local_group,
                                          num_slots_total if distributed else self.num_slots, config.hidden,
                                          backend=dispatcher_backend if distributed else "auto", align=align)
        self.register_buffer("expert_counts", torch.zeros(config.num_experts, dtype=torch.int64, device=device),
                             persistent=False)

    # ---- forward ------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None,
                token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, H] (or [..., H]); input_ids: [T] int (hash layers); token_mask: [T] bool (False =
        padding token: routed nowhere, output = shared expert only) -> [T, H] in x's dtype."""
        cfg = self.config
        if x.shape[-1] != cfg.hidden:
            raise ValueError(f"MoE hidden size mismatch: x has {x.shape[-1]}, the layer expects {cfg.hidden}")
        if self.shared_experts is not None and x.dtype != self.shared_experts.w1.weight.dtype:
            raise ValueError(f"x is {x.dtype} but the layer's dense weights are {self.shared_experts.w1.weight.dtype}; "
                             f"pass activations in that dtype (or .to() the layer)")
        if cfg.hash_layer and input_ids is None:
            raise ValueError("this MoE layer is a hash layer (tid2eid routing) and needs input_ids: [T] token ids")
        shape = x.shape
        x = x.reshape(-1, cfg.hidden)
        if input_ids is not None:
            input_ids = input_ids.reshape(-1)
        routing = self.gate(x, input_ids=input_ids, token_mask=token_mask)
        topk_ids, topk_weights = routing.topk_ids, routing.topk_weights
        self.count_experts(topk_ids)
        if self.eplb is not None:
            topk_ids = self.eplb.route(self.layer_index, topk_ids)
        if self.tokens == "replicated" and self.ep_size > 1:
            out = self._routed_replicated(x, topk_ids, topk_weights)
        else:
            out = self._routed_dispatched(x, topk_ids, topk_weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.reshape(shape)

    def count_experts(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Tokens per logical expert of this forward into `expert_counts` ([E] int64; -1 ids skipped).
        One scatter-add on the device: no host sync (unlike bincount on CUDA), graph-capturable."""
        ids = (topk_ids.reshape(-1) + 1).long()  # -1 -> bin 0, dropped below
        counts = torch.zeros(self.config.num_experts + 1, dtype=torch.int64, device=ids.device)
        counts.scatter_add_(0, ids, torch.ones_like(ids))
        self.expert_counts.copy_(counts[1:])
        return self.expert_counts

    def _experts(self, res: Any) -> torch.Tensor:
        offsets = res.offsets if self.dispatcher.align > 1 else None
        return self.experts(res.x, res.counts, offsets)

    def _routed_dispatched(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        d = self.dispatcher
        if self.overlap_chunks == 1:
            res = ubatch_yield(d.dispatch(x, topk_ids, topk_weights, async_op=True).wait)
            y = self._experts(res)
            return ubatch_yield(d.combine(y, res.handle, async_op=True).wait)
        sizes = _chunk_sizes(x.shape[0], self.overlap_chunks)
        xs, ids, ws = x.split(sizes), topk_ids.split(sizes), topk_weights.split(sizes)
        pending = d.dispatch(xs[0], ids[0], ws[0], async_op=True)
        combines = []
        for i in range(len(sizes)):
            res = pending.wait()
            if i + 1 < len(sizes):  # next chunk travels while this one computes
                pending = d.dispatch(xs[i + 1], ids[i + 1], ws[i + 1], async_op=True)
            combines.append(d.combine(self._experts(res), res.handle, async_op=True))
        return torch.cat([c.wait() for c in combines])

    def _local_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Global slot ids [T, K] -> this rank's slot ids, -1 for slots of other ranks."""
        first = self.ep_rank * self.num_slots
        local = topk_ids - first
        return torch.where((local >= 0) & (local < self.num_slots), local, torch.full_like(local, -1))

    def _routed_replicated(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        d, group = self.dispatcher, self.ep_group
        local_ids = self._local_ids(topk_ids)
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or topk_weights.requires_grad
                                                  or any(p.requires_grad for p in self.experts.parameters()))
        if needs_grad:  # every rank ends with the full gradient of x and of the router weights
            xin, win = _CopyToEP.apply(x, group), _CopyToEP.apply(topk_weights, group)
            res = d.dispatch(xin, local_ids, win)
            partial = d.combine(self._experts(res), res.handle)
            return _ReduceFromEP.apply(partial, group)
        outs = []
        for xc, ic, wc in zip(*(t.split(_chunk_sizes(x.shape[0], self.overlap_chunks)) for t in (x, local_ids, topk_weights))):
            res = d.dispatch(xc, ic, wc)
            partial = d.combine(self._experts(res), res.handle).contiguous()
            outs.append(comm.all_reduce(partial, group, async_op=True))  # in flight while the next chunk computes
        return torch.cat([ubatch_yield(h.wait) for h in outs])

    # ---- loading ------------------------------------------------------------------------

    def load_deepseek(self, state: Mapping[str, torch.Tensor], prefix: str = "") -> None:
        """Load DeepSeek-named tensors (`{prefix}gate.weight`, `{prefix}experts.{e}.w1.weight`, ...),
        keeping only this rank's experts. Missing gate/shared tensors raise KeyError."""
        sub = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        gate = {k[len("gate."):]: v for k, v in sub.items() if k.startswith("gate.")}
        if "bias" in gate and "e_score_correction_bias" not in gate:  # some exports name it gate.bias
            gate["e_score_correction_bias"] = gate.pop("bias")
        self._load_module(self.gate, gate, "gate.")
        if self.eplb is not None:  # the slots may have moved since construction
            self.experts.local_experts = self.eplb.local_experts(self.layer_index).tolist()
        self.experts.load_deepseek(sub, prefix="experts.")
        if self.shared_experts is not None:
            shared = {k[len("shared_experts."):]: v for k, v in sub.items() if k.startswith("shared_experts.")}
            self._load_module(self.shared_experts, shared, "shared_experts.")
        if self.eplb is not None:
            self.eplb.register_weights(self.layer_index, self.experts.slot_tensors())

    @staticmethod
    def _load_module(module: nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
        own = module.state_dict()
        missing = [k for k in own if k not in state]
        if missing:
            raise KeyError(f"missing {', '.join(what + k for k in missing)}")
        with torch.no_grad():
            for k, t in own.items():
                src = state[k]
                if tuple(src.shape) != tuple(t.shape):
                    raise ValueError(f"{what}{k} has shape {tuple(src.shape)}; expected {tuple(t.shape)}")
                t.copy_(src.to(t.dtype))

    def extra_repr(self) -> str:
        return (f"ep={self.ep_rank}/{self.ep_size}, tokens={self.tokens}, overlap_chunks={self.overlap_chunks}, "
                f"slots={self.num_slots}")
