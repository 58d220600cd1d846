"""Fused MoE routing kernel (Triton): scores, bias, group selection, top-k and weight
normalization in one launch, identical in result to `moe.router.route_torch`.

One program handles BLOCK_T tokens; the whole expert row (E padded to a power of two) sits
in registers. Top-k is K rounds of "max, then the lowest index holding it", which gives the
reference's tie rule (lowest expert index first) for free. Group scores are built one group
at a time into a small [BLOCK_T, BLOCK_G] tile, and groups are picked the same way as
experts. Hash layers gather their K ids from `tid2eid` and read the scores at those ids.

Only imported when used (CUDA, or CPU tensors under TRITON_INTERPRET=1). Ids are int64,
weights fp32; differences from the torch path are last-ulp rounding of exp/log/sum.

Host side (the part that dominates at decode sizes): per call two `torch.empty`, a few
shape/stride reads, two dict lookups and one launch; no conversions, no syncs, so it can be
captured in a CUDA graph. See "host side" below for the cached configs and the direct launch.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from megapar.moe.kernels.route_result import RouteResult

_SCORING_CODE = {"softmax": 0, "sigmoid": 1, "sqrt_softplus": 2}


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, input_ids_ptr, tid2eid_ptr, mask_ptr, out_ids_ptr, out_w_ptr,
    num_tokens, stride_logits, stride_table, scaling,
    E: tl.constexpr, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr, RENORM: tl.constexpr, HASH: tl.constexpr, HAS_MASK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    cols = tl.arange(0, BLOCK_E)  # [BE]
    kcols = tl.arange(0, BLOCK_K)  # [BK]
    row_ok = rows < num_tokens
    col_ok = cols < E
    rows64 = rows.to(tl.int64)

    # scores [BT, BE] fp32; columns >= E hold 0 (and are never selected)
    logit = tl.load(logits_ptr + rows64[:, None] * stride_logits + cols[None, :],
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    if SCORING == 0:
        logit = tl.where(col_ok[None, :], logit, float("-inf"))
        row_max = tl.max(logit, axis=1)
        ex = tl.exp(logit - row_max[:, None])
        ex = tl.where(col_ok[None, :], ex, 0.0)
        score = ex / tl.sum(ex, axis=1)[:, None]
    elif SCORING == 1:
        score = 1.0 / (1.0 + tl.exp(-logit))
    else:
        # softplus(x) = x above 20 (torch's threshold); log1p(y) via log(u) * y / (u - 1), u = 1 + y,
        # which keeps full relative precision for small y. The clamp is a where, not tl.minimum: that is
        # IEEE minNum when compiled (a NaN operand yields the other one), which made a NaN logit score
        # sqrt(softplus(20)) = 4.47 on the GPU instead of NaN (the interpreter's minimum kept the NaN)
        y = tl.exp(tl.where(logit > 20.0, 20.0, logit))
        u = 1.0 + y
        log1p_y = tl.where(u == 1.0, y, tl.log(u) * (y / (u - 1.0)))
        score = tl.sqrt(tl.where(logit > 20.0, logit, log1p_y))
    score = tl.where(col_ok[None, :], score, 0.0)

    ids_tile = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int64)
    w_tile = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    if HAS_MASK:
        valid = tl.load(mask_ptr + rows, mask=row_ok, other=0) != 0  # bool mask, read as bytes
    else:
        valid = row_ok

    if HASH:
        tok = tl.load(input_ids_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        tok = tl.where(valid, tok, 0)
        ids_tile = tl.load(tid2eid_ptr + tok[:, None] * stride_table + kcols[None, :],
                           mask=row_ok[:, None] & (kcols[None, :] < K), other=0).to(tl.int64)
        for k in tl.static_range(K):
            eid = tl.sum(tl.where(kcols[None, :] == k, ids_tile, 0), axis=1)  # [BT]
            w = tl.sum(tl.where(cols[None, :] == eid[:, None], score, 0.0), axis=1)
            w_tile = tl.where(kcols[None, :] == k, w[:, None], w_tile)
    else:
        select = score
        if HAS_BIAS:
            bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            select = select + bias[None, :]
        avail = col_ok[None, :] & (rows[:, None] >= 0)  # [BT, BE] bool
        # NaN ranks above every number, ties to the lowest index, as in torch's sort and topk
        # (tl.max skips NaN: without this a row of NaN scores matched no column)
        sel_nan = select != select
        if N_GROUP > 1:
            GROUP_SIZE: tl.constexpr = E // N_GROUP
            gcols = tl.arange(0, BLOCK_G)
            group_of_col = cols // GROUP_SIZE
            group_score = tl.full([BLOCK_T, BLOCK_G], float("-inf"), tl.float32)
            for g in tl.static_range(N_GROUP):
                in_g = col_ok[None, :] & (group_of_col == g)[None, :]
                v = tl.where(in_g & ~sel_nan, select, float("-inf"))
                top1 = tl.max(v, axis=1)
                if HAS_BIAS and GROUP_SIZE > 1:
                    # sum of the top-2 values; a repeated maximum counts twice
                    num_top1 = tl.sum(tl.where(in_g & (v == top1[:, None]), 1, 0), axis=1)
                    below = tl.max(tl.where(v < top1[:, None], v, float("-inf")), axis=1)
                    gs = top1 + tl.where(num_top1 >= 2, top1, below)
                else:
                    gs = top1
                # a NaN among the group's values makes its score NaN (as torch's topk/amax do)
                gs = tl.where(tl.max(tl.where(in_g & sel_nan, 1, 0), axis=1) > 0, float("nan"), gs)
                group_score = tl.where(gcols[None, :] == g, gs[:, None], group_score)
            group_free = (gcols < N_GROUP)[None, :] & (rows[:, None] >= 0)
            group_kept = (gcols[None, :] < 0) & (rows[:, None] >= 0)  # all False, [BT, BG]
            group_nan = group_score != group_score
            for _ in tl.static_range(TOPK_GROUP):
                best = tl.max(tl.where(group_free & ~group_nan, group_score, float("-inf")), axis=1)
                gi = tl.min(tl.where(group_free & (group_score == best[:, None]), gcols[None, :], BLOCK_G), axis=1)
                gi_nan = tl.min(tl.where(group_free & group_nan, gcols[None, :], BLOCK_G), axis=1)
                gi = tl.where(gi_nan < BLOCK_G, gi_nan, gi)
                hit = gcols[None, :] == gi[:, None]
                group_kept = group_kept | hit
                group_free = group_free & ~hit
            col_kept = (cols[None, :] < 0) & (rows[:, None] >= 0)  # all False, [BT, BE]
            for g in tl.static_range(N_GROUP):
                kept_g = tl.max(tl.where(gcols[None, :] == g, group_kept.to(tl.int32), 0), axis=1)
                col_kept = col_kept | ((group_of_col == g)[None, :] & (kept_g[:, None] > 0))
            avail = avail & col_kept
        for k in tl.static_range(K):
            best = tl.max(tl.where(avail & ~sel_nan, select, float("-inf")), axis=1)
            eid = tl.min(tl.where(avail & (select == best[:, None]), cols[None, :], BLOCK_E), axis=1)
            eid_nan = tl.min(tl.where(avail & sel_nan, cols[None, :], BLOCK_E), axis=1)
            eid = tl.where(eid_nan < BLOCK_E, eid_nan, eid)
            hit = cols[None, :] == eid[:, None]
            w = tl.sum(tl.where(hit, score, 0.0), axis=1)
            avail = avail & ~hit
            ids_tile = tl.where(kcols[None, :] == k, eid.to(tl.int64)[:, None], ids_tile)
            w_tile = tl.where(kcols[None, :] == k, w[:, None], w_tile)

    if RENORM:
        total = tl.sum(w_tile, axis=1)
        w_tile = w_tile / tl.where(total > 0.0, total, 1.0)[:, None]
    w_tile = w_tile * scaling
    ids_tile = tl.where(valid[:, None], ids_tile, -1)
    w_tile = tl.where(valid[:, None], w_tile, 0.0)
    out_mask = row_ok[:, None] & (kcols[None, :] < K)
    out_offs = rows64[:, None] * K + kcols[None, :]
    tl.store(out_ids_ptr + out_offs, ids_tile, mask=out_mask)
    tl.store(out_w_ptr + out_offs, w_tile, mask=out_mask)


# ---------------------------------------------------------------- host side
#
# The kernel takes a few µs; everything around it is host overhead, which is what a decode
# step sees. So the per-call host work is kept to: two `torch.empty`, a handful of shape/stride
# reads, two dict lookups and one launch. The constexpr configuration is cached per routing
# setup (`_CONFIGS`), and after the first launch of a specialization its compiled kernel is
# launched directly (`_KERNELS`), skipping `JITFunction.run`'s argument binding, option
# parsing and cache-key building. The direct launch is keyed on everything Triton specializes
# a compiled kernel on (see `_spec_key`), so it launches exactly the binary Triton would pick.
# Set MEGAPAR_ROUTE_DIRECT_LAUNCH=0 to always go through `JITFunction.run`.

_MAX_TILE = 2048  # default BLOCK_T * BLOCK_E (elements of the score tile one program holds)
_INT32_MAX = (1 << 31) - 1
_DIRECT_LAUNCH = os.environ.get("MEGAPAR_ROUTE_DIRECT_LAUNCH", "1") != "0"


@dataclass(frozen=True)
class _Config:
    """Launch configuration of one routing setup (cached; built once per key)."""

    block_t: int
    num_warps: int
    constexprs: tuple  # E, K, BLOCK_T, BLOCK_E, BLOCK_K, SCORING, HAS_BIAS, N_GROUP, TOPK_GROUP, BLOCK_G, RENORM, HASH, HAS_MASK
    kwargs: dict  # the same as keyword arguments (+ num_warps), for `_route_kernel[grid](...)`


_CONSTEXPR_NAMES = ("E", "K", "BLOCK_T", "BLOCK_E", "BLOCK_K", "SCORING", "HAS_BIAS", "N_GROUP", "TOPK_GROUP",
                    "BLOCK_G", "RENORM", "HASH", "HAS_MASK")
_CONFIGS: dict[tuple, _Config] = {}
_KERNELS: dict[tuple, tuple] = {}  # (config key, device, _spec_key) -> (launcher, function, packed metadata)


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def _launch_config(num_tokens: int, block_e: int, block_t: int | None, num_warps: int | None) -> tuple[int, int]:
    """(BLOCK_T, num_warps): up to `_MAX_TILE` scores per program, 1-4 warps by tile size."""
    if block_t is None:
        block_t = min(_next_pow2(max(num_tokens, 1)), max(1, _MAX_TILE // block_e))
    if num_warps is None:
        tile = block_t * block_e
        num_warps = 1 if tile <= 512 else (2 if tile <= 1024 else 4)
    return block_t, num_warps


def _make_config(key: tuple) -> _Config:
    num_experts, top_k, scoring, has_bias, n_group, topk_group, renormalize, hashed, has_mask, t_bits, block_t, \
        num_warps = key
    block_e = _next_pow2(num_experts)
    bt, warps = _launch_config(1 << t_bits, block_e, block_t, num_warps)
    values = (num_experts, top_k, bt, block_e, max(2, _next_pow2(top_k)), _SCORING_CODE[scoring], has_bias,
              n_group, topk_group, max(2, _next_pow2(n_group)), renormalize, hashed, has_mask)
    cfg = _Config(block_t=bt, num_warps=warps, constexprs=values,
                  kwargs=dict(zip(_CONSTEXPR_NAMES, values), num_warps=warps))
    _CONFIGS[key] = cfg
    return cfg


def _spec_key(args: tuple) -> tuple:
    """What Triton specializes a compiled kernel on, for the runtime arguments of `_route_kernel`
    (7 tensors, then 3 non-negative ints; the float `scaling` is not specialized): a tensor's
    dtype and whether its address is a multiple of 16; an int's type (i32 or i64), whether it
    equals 1 (then it is compiled in as a constant) and whether it is a multiple of 16."""
    a0, a1, a2, a3, a4, a5, a6, n0, n1, n2 = args[:10]
    return (a0.dtype, a0.data_ptr() & 15 == 0, a1.dtype, a1.data_ptr() & 15 == 0, a2.dtype, a2.data_ptr() & 15 == 0,
            a3.dtype, a3.data_ptr() & 15 == 0, a4.dtype, a4.data_ptr() & 15 == 0, a5.dtype, a5.data_ptr() & 15 == 0,
            a6.dtype, a6.data_ptr() & 15 == 0,
            n0 == 1, n0 & 15 == 0, n0 <= _INT32_MAX, n1 == 1, n1 & 15 == 0, n1 <= _INT32_MAX,
            n2 == 1, n2 & 15 == 0, n2 <= _INT32_MAX)


@functools.lru_cache(maxsize=1)
def _driver_hooks():
    """(current device fn, current stream fn, knobs.runtime) of the active Triton driver, as
    `JITFunction.run` uses them."""
    from triton import knobs
    from triton.runtime import driver

    return driver.active.get_current_device, driver.active.get_current_stream, knobs.runtime


def _launch(cfg_key: tuple, cfg: _Config, grid0: int, args: tuple, direct: bool) -> None:
    """Launch `_route_kernel` on `grid0` programs; `args` = the 11 runtime arguments followed by
    `cfg.constexprs` (the kernel's parameter order). `direct`: reuse the compiled kernel of an
    earlier launch with the same specialization (CUDA only; the interpreter compiles nothing)."""
    if direct:
        get_device, get_stream, runtime = _driver_hooks()
        device = get_device()
        key = (cfg_key, device, _spec_key(args))
        hit = _KERNELS.get(key)
        if hit is not None and runtime.launch_enter_hook is None and runtime.launch_exit_hook is None:
            run, function, packed_metadata = hit
            run(grid0, 1, 1, get_stream(device), function, packed_metadata, None, None, None, *args)
            return
    kernel = _route_kernel[(grid0,)](*args[:11], **cfg.kwargs)
    if direct and kernel is not None and hasattr(kernel, "packed_metadata"):  # compiled (not interpreted)
        if hasattr(kernel, "result"):
            kernel = kernel.result()
        _KERNELS[key] = (kernel.run, kernel.function, kernel.packed_metadata)


def route_triton(
    logits: torch.Tensor,
    *,
    top_k: int,
    scoring: str,
    bias: torch.Tensor | None = None,
    n_group: int | None = None,
    topk_group: int | None = None,
    renormalize: bool = True,
    scaling: float = 1.0,
    input_ids: torch.Tensor | None = None,
    tid2eid: torch.Tensor | None = None,
    token_mask: torch.Tensor | None = None,
    block_t: int | None = None,
    num_warps: int | None = None,
) -> RouteResult:
    """Fused routing; same arguments and result as `moe.router.route_torch` (checked by
    `moe.router.route`). logits: [T, E] fp32/bf16 (scores are fp32); bias: [E] any float dtype
    (upcast to fp32 in the kernel); token_mask: [T] bool. One kernel launch, no host sync,
    no autograd."""
    num_tokens, num_experts = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    device = logits.device
    topk_ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=device)
    topk_weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=device)
    if num_tokens == 0:
        return RouteResult(topk_ids=topk_ids, topk_weights=topk_weights)
    hashed = tid2eid is not None
    has_bias = bias is not None and not hashed
    grouped = not hashed and n_group is not None and n_group > 1
    has_mask = token_mask is not None
    cfg_key = (num_experts, top_k, scoring, has_bias, n_group if grouped else 1, topk_group if grouped else 1,
               bool(renormalize), hashed, has_mask, min((num_tokens - 1).bit_length(), 11), block_t, num_warps)
    cfg = _CONFIGS.get(cfg_key) or _make_config(cfg_key)
    dummy = topk_weights  # any pointer for the arguments a specialization does not read
    if has_bias and bias.stride(0) != 1:
        bias = bias.contiguous()
    if hashed:
        if input_ids.stride(0) != 1:
            input_ids = input_ids.contiguous()
        if tid2eid.stride(1) != 1:
            tid2eid = tid2eid.contiguous()
    if has_mask and token_mask.stride(0) != 1:
        token_mask = token_mask.contiguous()
    args = (logits, bias if has_bias else dummy, input_ids if hashed else dummy, tid2eid if hashed else dummy,
            token_mask if has_mask else dummy, topk_ids, topk_weights,
            num_tokens, logits.stride(0), tid2eid.stride(0) if hashed else 0, float(scaling)) + cfg.constexprs
    _launch(cfg_key, cfg, -(-num_tokens // cfg.block_t), args, _DIRECT_LAUNCH and logits.is_cuda)
    return RouteResult(topk_ids=topk_ids, topk_weights=topk_weights)
