"""mHC: DeepSeek-V4's M parallel residual streams, mixed before and after every sublayer.

The residual is `[T, M, H]` (M streams, M = 4). Before a sublayer, `mhc_pre` projects the
flattened residual of each token (`[M*H]`, RMS-scaled) onto `(2+M)*M` numbers, which give
the input weights `pre [M]`, the output weights `post [M]` and a mixing matrix `comb [M, M]`
made nearly doubly stochastic by Sinkhorn-Knopp; the sublayer sees `sum_i pre_i x_i`.
After it, `mhc_post` writes `new_j = sum_i comb[i, j] x_i + post_j * f(x)` (docs/numerics.md).
Everything is per token, so a token shard (sequence parallelism) needs nothing special.
Checked against HF transformers' DeepseekV4HyperConnection / HyperHead / DecoderLayer / Model
(tests/test_mhc_hf.py): the same formulas; the one difference is that HF's decoder layer rounds
post and comb to the residual's dtype and mixes in it, where DeepSeek's hc_post and this module
mix in fp32 and round once (on bf16: correctly rounded here, a few ulps off in HF).

Paths, sharing signatures (`backend="auto"|"torch"|"triton"`):
- torch (fp32 math, results in the residual's dtype): the specification; differentiable.
- Triton (model/triton_mhc.py, CUDA, inference): the projection (split-K over H), the
  coefficients with all Sinkhorn iterations and the weighted stream sum in one launch up to
  512 tokens (the last split of each token block finishes it), the weighted sum as a second
  launch above (`triton_mhc.SINGLE_LAUNCH_MAX_TOKENS`, from measurements). `mhc_post_pre` fuses
  one sublayer's post with the next one's pre in one launch as long as pre is one launch (the
  new residual is projected while still in registers, saving one read of `[T, M, H]` and a
  launch); above that it runs post then pre.

`auto` takes Triton for CUDA tensors without autograd when triton imports and M is a power of
two (the kernels' stream index), else torch (op "model.mhc" of `parallel.impl`);
`backend="triton"` also runs CPU tensors under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from typing import Callable, Literal, NamedTuple

import torch
from torch import nn

from megapar.parallel import impl

__all__ = [
    "MHCPre",
    "MHC",
    "MHCHead",
    "mhc_pre",
    "mhc_post",
    "mhc_post_pre",
    "mhc_broadcast",
    "mhc_pre_broadcast",
    "mhc_head",
    "sinkhorn",
    "mhc_checkpoint_params",
]

Backend = Literal["auto", "torch", "triton"]


class MHCPre(NamedTuple):
    """What `mhc_pre` returns (unpacks as `layer_input, post, comb`)."""

    layer_input: torch.Tensor
    """[T, H], residual dtype: sum_i pre_i * residual_i, the sublayer's input (before its norm)."""
    post: torch.Tensor
    """[T, M] fp32: weight of the sublayer output in each new stream, in (0, 2)."""
    comb: torch.Tensor
    """[T, M, M] fp32: comb[t, i, j] is the weight of old stream i in new stream j."""


# ---- shapes -----------------------------------------------------------------------------------

def _num_streams(residual: torch.Tensor) -> tuple[int, int, int]:
    if residual.dim() != 3:
        raise ValueError(f"residual must be [T, M, H], got shape {tuple(residual.shape)}")
    if residual.shape[1] < 1 or residual.shape[2] < 1:  # no stream or no hidden: NaN coefficients
        raise ValueError(f"residual [T, M, H] needs M >= 1 streams and H >= 1; got shape {tuple(residual.shape)}")
    if not residual.is_floating_point():  # the fp32 sums were truncated back to the integer dtype
        raise ValueError(f"residual must be floating point, got {residual.dtype}")
    return residual.shape[0], residual.shape[1], residual.shape[2]


def _check_params(fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, m: int, h: int,
                  *, rows: int, num_scales: int) -> None:
    want = {"fn": (rows, m * h), "base": (rows,), "scale": (num_scales,)}
    for name, t in (("fn", fn), ("base", base), ("scale", scale)):
        if tuple(t.shape) != want[name]:
            raise ValueError(f"{name} must have shape {want[name]} for M={m}, H={h}; got {tuple(t.shape)}")


def _check_sinkhorn(iters: int) -> None:
    # an int (numpy's too): a float count was a TypeError in range() / a Triton compile error
    if isinstance(iters, bool) or not hasattr(iters, "__index__") or iters < 1:
        raise ValueError(f"sinkhorn_iters must be an integer >= 1, got {iters!r}")


def _check_eps(**values: float) -> None:
    """eps (added to pre, to the softmax and to every Sinkhorn division) and rms_eps (under the
    RMS's rsqrt) must be finite numbers >= 0 (0 as ModelConfig allows). All ran without an error:
    eps = -0.05 gave comb entries near -15 (softmax + eps below 0, Sinkhorn sums near 0), a negative
    rms_eps NaN on a token of small RMS (rsqrt of a negative), eps = inf or NaN NaN coefficients,
    rms_eps = inf a zero projection (coefficients from base alone)."""
    for name, value in values.items():
        if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
                or value < 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


# ---- torch reference --------------------------------------------------------------------------

def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Sinkhorn-Knopp as in DeepSeek-V4: normalize columns, then (iters - 1) times rows and
    columns. comb: [..., M, M] positive fp32 (softmax + eps); each division adds eps."""
    _check_eps(eps=eps)
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


def _coefficients(mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, m: int, iters: int,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mix: [T, (2+M)M] fp32, already RMS-scaled -> pre [T, M], post [T, M], comb [T, M, M]."""
    base = base.float()
    scale = scale.float()
    pre = torch.sigmoid(mix[:, :m] * scale[0] + base[:m]) + eps
    post = 2 * torch.sigmoid(mix[:, m:2 * m] * scale[1] + base[m:2 * m])
    logits = mix[:, 2 * m:].reshape(-1, m, m) * scale[2] + base[2 * m:].reshape(m, m)
    comb = sinkhorn(torch.softmax(logits, dim=-1) + eps, iters, eps)
    return pre, post, comb


def _fp32(device: torch.device) -> contextlib.AbstractContextManager:
    """autocast off on `device` where it is on: the torch path is fp32 math (the specification,
    and what the Triton kernels compute whatever autocast says); under autocast its matmul / bmm /
    einsum ran in bf16 (mix logits ~1e-2 off, an fp32 residual mixed in bf16)."""
    if torch.amp.is_autocast_available(device.type) and torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _rms_mix(xf: torch.Tensor, fn: torch.Tensor, rms_eps: float) -> torch.Tensor:
    """xf: [T, K] fp32 -> (xf @ fn^T) * rsqrt(mean(xf^2) + rms_eps), [T, rows] fp32."""
    with _fp32(xf.device):
        rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + rms_eps)
        return (xf @ fn.float().t()) * rstd


def _weighted_streams(weights: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """sum_i weights[:, i] * residual[:, i] in fp32: [T, M], [T, M, H] -> [T, H] residual dtype."""
    with _fp32(residual.device):
        return torch.einsum("tm,tmh->th", weights, residual.float()).to(residual.dtype)


def _pre_torch(residual: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
               iters: int, eps: float, rms_eps: float) -> MHCPre:
    t, m, h = residual.shape
    mix = _rms_mix(residual.reshape(t, m * h).float(), fn, rms_eps)
    pre, post, comb = _coefficients(mix, base, scale, m, iters, eps)
    return MHCPre(_weighted_streams(pre, residual), post, comb)


def _post_torch(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    with _fp32(residual.device):
        mixed = torch.bmm(comb.float().transpose(1, 2), residual.float())  # [T, M(j), H] = sum_i comb[i, j] x_i
        return (mixed + post.float().unsqueeze(-1) * out.float().unsqueeze(1)).to(residual.dtype)


# ---- backend choice ---------------------------------------------------------------------------

def _power_of_two_streams(f: impl.Facts) -> impl.Unusable | None:
    """The Triton kernels index the M streams with tl.arange: M a power of two (fact `streams`)."""
    if f.streams is not None and f.streams & (f.streams - 1):
        return impl.Unusable(f"the Triton mHC kernels need a power-of-two number of streams, got M={f.streams}; "
                             f"use backend='torch'")
    return None


MHC_OP = impl.Op("model.mhc", [
    impl.Impl("triton", impl.all_of(impl.needs_triton, impl.needs_gpu_tensor, impl.forward_only,
                                    _power_of_two_streams)),
    impl.Impl("torch"),
])
"""The Triton kernels (CUDA, inference, M a power of two; the interpreter when named), then the torch reference."""


def _check_backend(backend: str) -> None:
    if backend != "auto":
        MHC_OP.get(backend)  # ValueError naming the valid choices


def _use_triton(backend: Backend, streams: int, *tensors: torch.Tensor) -> bool:
    if tensors[0].numel() == 0:  # no tokens: nothing to launch; the torch path handles empty tensors
        _check_backend(backend)
        return False
    return MHC_OP.resolve(backend, device=tensors[0].device, needs_grad=impl.grad_needed(*tensors),
                          streams=streams) == "triton"


# ---- public functions -------------------------------------------------------------------------

def mhc_pre(residual: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
            sinkhorn_iters: int = 20, eps: float = 1e-6, rms_eps: float = 1e-6,
            backend: Backend = "auto") -> MHCPre:
    """Mix the streams into one sublayer input.

    residual: [T, M, H] bf16/fp16/fp32. fn: [(2+M)M, M*H] fp32. base: [(2+M)M] fp32.
    scale: [3] fp32 (pre, post, comb). Returns MHCPre(layer_input [T, H], post [T, M], comb [T, M, M]).
    """
    t, m, h = _num_streams(residual)
    _check_params(fn, base, scale, m, h, rows=(2 + m) * m, num_scales=3)
    _check_sinkhorn(sinkhorn_iters)
    _check_eps(eps=eps, rms_eps=rms_eps)
    if _use_triton(backend, m, residual, fn, base, scale):
        from . import triton_mhc

        return MHCPre(*triton_mhc.pre(residual, fn, base, scale, sinkhorn_iters, eps, rms_eps))
    return _pre_torch(residual, fn, base, scale, sinkhorn_iters, eps, rms_eps)


def _check_post_args(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> None:
    t, m, h = _num_streams(residual)
    if tuple(out.shape) != (t, h) or tuple(post.shape) != (t, m) or tuple(comb.shape) != (t, m, m):
        raise ValueError(f"for residual [T={t}, M={m}, H={h}] need out [{t}, {h}], post [{t}, {m}], "
                         f"comb [{t}, {m}, {m}]; got {tuple(out.shape)}, {tuple(post.shape)}, {tuple(comb.shape)}")


def mhc_post(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, *,
             backend: Backend = "auto") -> torch.Tensor:
    """New residual [T, M, H] (residual dtype): new_j = sum_i comb[i, j] residual_i + post_j * out.

    out: [T, H] the sublayer output. residual: [T, M, H]. post: [T, M] fp32. comb: [T, M, M] fp32.
    """
    _check_post_args(out, residual, post, comb)
    if _use_triton(backend, residual.shape[1], out, residual, post, comb):
        from . import triton_mhc

        return triton_mhc.post(out, residual, post, comb)
    return _post_torch(out, residual, post, comb)


def mhc_post_pre(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                 fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, sinkhorn_iters: int = 20,
                 eps: float = 1e-6, rms_eps: float = 1e-6, backend: Backend = "auto"
                 ) -> tuple[torch.Tensor, MHCPre]:
    """`mhc_post` of one sublayer followed by `mhc_pre` of the next (fn/base/scale are the next
    sublayer's). Returns (new residual [T, M, H], MHCPre of the next sublayer). On Triton, up
    to min(FUSE_MAX_TOKENS, SINGLE_LAUNCH_MAX_TOKENS) tokens (model/triton_mhc.py), one launch
    projects the new residual while it is written (one read of [T, M, H] and a launch fewer);
    above, post then pre."""
    _check_post_args(out, residual, post, comb)  # the fused kernel reads them unchecked
    if _use_triton(backend, residual.shape[1], out, residual, post, comb, fn, base, scale):
        t, m, h = _num_streams(residual)
        _check_params(fn, base, scale, m, h, rows=(2 + m) * m, num_scales=3)
        _check_sinkhorn(sinkhorn_iters)
        _check_eps(eps=eps, rms_eps=rms_eps)
        from . import triton_mhc

        new, layer_input, post2, comb2 = triton_mhc.post_pre(out, residual, post, comb, fn, base, scale,
                                                             sinkhorn_iters, eps, rms_eps)
        return new, MHCPre(layer_input, post2, comb2)
    new = mhc_post(out, residual, post, comb, backend="torch")
    return new, mhc_pre(new, fn, base, scale, sinkhorn_iters=sinkhorn_iters, eps=eps, rms_eps=rms_eps,
                        backend="torch")


def mhc_broadcast(x: torch.Tensor, num_streams: int) -> torch.Tensor:
    """First layer: the embedding x [T, H] as M equal streams [T, M, H] (a stride-0 view)."""
    if x.dim() != 2 or num_streams < 1:
        raise ValueError(f"need x [T, H] and num_streams >= 1; got shape {tuple(x.shape)}, num_streams={num_streams}")
    return x.unsqueeze(1).expand(x.shape[0], num_streams, x.shape[1])


def mhc_pre_broadcast(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
                      sinkhorn_iters: int = 20, eps: float = 1e-6, rms_eps: float = 1e-6,
                      backend: Backend = "auto") -> MHCPre:
    """`mhc_pre(mhc_broadcast(x, M), ...)` without materializing the M copies.

    x: [T, H] (the embedding). M is read from fn [(2+M)M, M*H]. With equal streams,
    mean(xf^2) = mean(x^2), xf @ fn^T = x @ (sum_m fn[:, m*H:(m+1)*H])^T and the layer input
    is (sum_i pre_i) x. On Triton the general kernels read the stride-0 view instead.
    """
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x must be a floating-point [T, H], got shape {tuple(x.shape)}, {x.dtype}")
    t, h = x.shape
    if fn.dim() != 2 or h < 1 or fn.shape[1] < h or fn.shape[1] % h:
        raise ValueError(f"fn must be [(2+M)M, M*H] with H={h} >= 1 and M >= 1; got shape {tuple(fn.shape)}")
    m = fn.shape[1] // h
    if _use_triton(backend, m, x, fn, base, scale):
        return mhc_pre(mhc_broadcast(x, m), fn, base, scale, sinkhorn_iters=sinkhorn_iters, eps=eps,
                       rms_eps=rms_eps, backend="triton")
    _check_params(fn, base, scale, m, h, rows=(2 + m) * m, num_scales=3)
    _check_sinkhorn(sinkhorn_iters)
    _check_eps(eps=eps, rms_eps=rms_eps)
    folded = fn.float().reshape(fn.shape[0], m, h).sum(1)  # [(2+M)M, H]
    mix = _rms_mix(x.float(), folded, rms_eps)
    pre, post, comb = _coefficients(mix, base, scale, m, sinkhorn_iters, eps)
    return MHCPre((pre.sum(-1, keepdim=True) * x.float()).to(x.dtype), post, comb)


def mhc_head(residual: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
             eps: float = 1e-6, rms_eps: float = 1e-6, backend: Backend = "auto") -> torch.Tensor:
    """Collapse the streams after the last layer: h = sum_i pre_i residual_i, [T, H] residual dtype,
    pre = sigmoid(rmsnorm(xf) @ fn^T * scale + base) + eps.

    residual: [T, M, H]. fn: [M, M*H] fp32. base: [M] fp32. scale: [1] fp32.
    """
    t, m, h = _num_streams(residual)
    _check_params(fn, base, scale, m, h, rows=m, num_scales=1)
    _check_eps(eps=eps, rms_eps=rms_eps)
    if _use_triton(backend, m, residual, fn, base, scale):
        from . import triton_mhc

        return triton_mhc.head(residual, fn, base, scale, eps, rms_eps)
    mix = _rms_mix(residual.reshape(t, m * h).float(), fn, rms_eps)
    pre = torch.sigmoid(mix * scale.float()[0] + base.float()) + eps
    return _weighted_streams(pre, residual)


# ---- modules ----------------------------------------------------------------------------------

class MHC(nn.Module):
    """The mHC parameters of one sublayer (attention or MoE) and its pre/post mixing.

    fn: [(2+M)M, M*H] fp32, base: [(2+M)M] fp32, scale: [3] fp32 (checkpoint names in
    DeepSeek-V4: hc_*_fn, hc_*_base, hc_*_scale). The initial values (small fn, zero base,
    unit scale) are arbitrary; real weights come from a checkpoint.
    """

    def __init__(self, hidden_size: int, num_streams: int = 4, *, sinkhorn_iters: int = 20, eps: float = 1e-6,
                 rms_eps: float = 1e-6, backend: Backend = "auto", device: torch.device | str | None = None) -> None:
        super().__init__()
        if hidden_size < 1 or num_streams < 1:
            raise ValueError(f"need hidden_size >= 1 and num_streams >= 1, got {hidden_size}, {num_streams}")
        _check_sinkhorn(sinkhorn_iters)
        _check_eps(eps=eps, rms_eps=rms_eps)
        _check_backend(backend)
        m = num_streams
        self.hidden_size, self.num_streams = hidden_size, m
        self.sinkhorn_iters, self.eps, self.rms_eps, self.backend = sinkhorn_iters, eps, rms_eps, backend
        self.fn = nn.Parameter(torch.empty((2 + m) * m, m * hidden_size, dtype=torch.float32, device=device))
        self.base = nn.Parameter(torch.zeros((2 + m) * m, dtype=torch.float32, device=device))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32, device=device))
        nn.init.normal_(self.fn, std=0.02)

    def _kw(self) -> dict:
        return dict(sinkhorn_iters=self.sinkhorn_iters, eps=self.eps, rms_eps=self.rms_eps, backend=self.backend)

    def pre(self, residual: torch.Tensor) -> MHCPre:
        """residual [T, M, H] -> MHCPre(layer_input [T, H], post [T, M], comb [T, M, M])."""
        return mhc_pre(residual, self.fn, self.base, self.scale, **self._kw())

    def pre_broadcast(self, x: torch.Tensor) -> MHCPre:
        """First sublayer: x [T, H] (the embedding) stands for M equal streams."""
        return mhc_pre_broadcast(x, self.fn, self.base, self.scale, **self._kw())

    def post(self, out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """out [T, H] (sublayer output) -> new residual [T, M, H]."""
        return mhc_post(out, residual, post, comb, backend=self.backend)

    def post_pre(self, out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                 next_mhc: MHC) -> tuple[torch.Tensor, MHCPre]:
        """This sublayer's post fused with `next_mhc`'s pre: (new residual, next MHCPre)."""
        return mhc_post_pre(out, residual, post, comb, next_mhc.fn, next_mhc.base, next_mhc.scale,
                            **next_mhc._kw())

    def forward(self, residual: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """residual [T, M, H] -> new residual after `sublayer` ([T, H] -> [T, H])."""
        layer_input, post, comb = self.pre(residual)
        return self.post(sublayer(layer_input), residual, post, comb)


class MHCHead(nn.Module):
    """Collapses the M streams into one hidden state after the last layer.

    fn: [M, M*H] fp32, base: [M] fp32, scale: [1] fp32.
    """

    def __init__(self, hidden_size: int, num_streams: int = 4, *, eps: float = 1e-6, rms_eps: float = 1e-6,
                 backend: Backend = "auto", device: torch.device | str | None = None) -> None:
        super().__init__()
        if hidden_size < 1 or num_streams < 1:
            raise ValueError(f"need hidden_size >= 1 and num_streams >= 1, got {hidden_size}, {num_streams}")
        _check_eps(eps=eps, rms_eps=rms_eps)
        _check_backend(backend)
        m = num_streams
        self.hidden_size, self.num_streams, self.eps, self.rms_eps, self.backend = hidden_size, m, eps, rms_eps, backend
        self.fn = nn.Parameter(torch.empty(m, m * hidden_size, dtype=torch.float32, device=device))
        self.base = nn.Parameter(torch.zeros(m, dtype=torch.float32, device=device))
        self.scale = nn.Parameter(torch.ones(1, dtype=torch.float32, device=device))
        nn.init.normal_(self.fn, std=0.02)

    def forward(self, residual: torch.Tensor) -> torch.Tensor:
        """residual [T, M, H] -> [T, H] (residual dtype)."""
        return mhc_head(residual, self.fn, self.base, self.scale, eps=self.eps, rms_eps=self.rms_eps,
                        backend=self.backend)


# ---- checkpoint names -------------------------------------------------------------------------

_MHC_NAMES = {
    # (naming, sublayer) -> key of (fn, base, scale); {i} is the decoder layer
    ("deepseek", "attn"): ("layers.{i}.hc_attn_fn", "layers.{i}.hc_attn_base", "layers.{i}.hc_attn_scale"),
    ("deepseek", "ffn"): ("layers.{i}.hc_ffn_fn", "layers.{i}.hc_ffn_base", "layers.{i}.hc_ffn_scale"),
    ("deepseek", "head"): ("hc_head_fn", "hc_head_base", "hc_head_scale"),
    ("hf", "attn"): ("model.layers.{i}.attn_hc.fn", "model.layers.{i}.attn_hc.base", "model.layers.{i}.attn_hc.scale"),
    ("hf", "ffn"): ("model.layers.{i}.ffn_hc.fn", "model.layers.{i}.ffn_hc.base", "model.layers.{i}.ffn_hc.scale"),
    ("hf", "head"): ("model.hc_head.hc_fn", "model.hc_head.hc_base", "model.hc_head.hc_scale"),
}


def mhc_checkpoint_params(state, sublayer: Literal["attn", "ffn", "head"], layer: int = 0, *,
                          naming: Literal["deepseek", "hf"] = "deepseek"
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fn, base, scale) in fp32 of one mHC from a DeepSeek-V4 checkpoint mapping (a dict or a lazy
    `moe.loading.SafetensorsState`): DeepSeek's names `layers.{i}.hc_{attn,ffn}_{fn,base,scale}`
    and `hc_head_{fn,base,scale}`, or HF transformers' `model.layers.{i}.{attn,ffn}_hc.{fn,base,
    scale}` and `model.hc_head.hc_{fn,base,scale}`. They feed `mhc_pre` / `mhc_head` (or
    `MHC.fn`, ...); HF's DeepseekV4HyperConnection uses eps = hc_eps, rms_eps = rms_norm_eps."""
    names = _MHC_NAMES.get((naming, sublayer))
    if names is None:
        raise ValueError(f"unknown mHC {naming!r} / {sublayer!r}; valid namings: deepseek, hf; "
                         f"sublayers: attn, ffn, head")
    fn, base, scale = (state[k.format(i=layer)].float() for k in names)
    return fn, base, scale

