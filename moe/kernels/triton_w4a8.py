"""W4A8 grouped expert GEMM in Triton for Hopper: FP8 activations x exact FP8 weights.

For many tokens per expert (prefill) the GEMM is bound by tensor-core rate, and FP8 doubles
it over bf16. MXFP4 weights become FP8 without loss (docs/numerics.md): inside a row (or a 1x128
group) every block exponent is folded against the largest, e_ref = e_max - 6, and an E2M1
value times 2^(e_block - e_ref) is exact in E4M3 while e_max - e_block <= 14
(PreparedWeight.fp8_fold, planned at load time). The expansion runs once per call as its own
bandwidth-bound pass (triton_expand.expand_fp4): in a compute-bound GEMM every weight tile
is reused by M / BLOCK_M token tiles, and expanding it inside the main loop would repeat the
conversion that many times on the same ALUs that feed the tensor cores.

`_fp8_gemm_kernel` computes acc[tokens, n] over K with scales of two kinds on each side:
per row (activations: per token; weights: per output row) - applied once in the epilogue -
or per 128 along K (fp8_group activations, fp8_block / 1x128-folded weights) - applied to
each 128-deep partial product ("promotion", as DeepGEMM does). The epilogue can apply SwiGLU
over gate and up tiles (W13 in split order) and quantize the result to fp8_group for L2.

`_fp8_gemm_persistent_kernel` is the row-scaled case as a persistent kernel (one program per SM,
its tile and K loops flattened so the next tile's loads overlap this tile's epilogue). It is the
default for the 128x256 prefill tiles (`pick_fp8_config`, numbers there and in bench/gemm-notes.md
round 9). `FP8Config.tma_store` / `tma_load` are measured options, slower on the H200 and off.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
import triton
import triton.language as tl

from megapar.moe.kernels.prepare import PreparedWeight
from megapar.moe.kernels.triton_common import expert_tile, fp8_group_quant, layout_args, swiglu_tile
from megapar.moe.kernels.triton_expand import expand_fp4
from megapar.parallel import impl


# ---- activation quantization: parallel.quant's fp8_token / fp8_group Triton kernels ------------------

_ACT_FORMATS = {False: "fp8_token", True: "fp8_group"}


@contextmanager
def _quant_warps(kernel: str, num_warps: int | None) -> Iterator[None]:
    """Run one quantize with CONFIG[kernel]'s warps replaced by num_warps (None: as configured)."""
    from megapar.parallel.quant import triton_quant

    if num_warps is None:
        yield
        return
    saved = triton_quant.CONFIG[kernel]
    triton_quant.CONFIG[kernel] = (saved[0], int(num_warps))
    try:
        yield
    finally:
        triton_quant.CONFIG[kernel] = saved


def quantize_act(x: torch.Tensor, group: bool = False, num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] float -> (e4m3 [M, K], fp32 scale [M, 1] (per token) or [M, ceil(K/128)]), contiguous.

    The activations the fp8 GEMM reads, quantized by parallel.quant's Triton kernels (the one
    implementation of fp8_token / fp8_group, bit-identical to its torch reference, NaN and inf
    included: a NaN in a row (group) makes its scale NaN and its bytes 0x7F).
    num_warps overrides the warps of parallel.quant's CONFIG["fp8_token"] / ["fp8_group"] for this
    call (the gemm probe's act-quant sweep; a tuning file's act_quant_warps goes into CONFIG itself); fp8_token only
    takes it for rows of 4096 < K <= 8192 (its launch picks the warps elsewhere). Prefer tuning
    CONFIG itself (`python -m megapar.launch.bench.quant --probe`); the argument is kept for the
    gemm probe's act-quant sweep."""
    from megapar.parallel.quant import triton_quant

    if x.dim() != 2:
        raise ValueError(f"quantize_act needs x of shape [M, K], got {tuple(x.shape)}")
    fmt = _ACT_FORMATS[bool(group)]
    with _quant_warps(fmt, num_warps):
        q = triton_quant.quantize(x, fmt)
    return q.data, q.scale


# ---- the fp8 grouped GEMM ---------------------------------------------------------------------------

@triton.jit
def _fp8_gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, out_ptr, out_scale_ptr, counts_ptr, offsets_ptr,
    N, num_experts, tiles_per_expert, capacity, up_rows, num_pid_n,
    stride_am, stride_asm, stride_be, stride_bn, stride_bse, stride_bsn, stride_om, stride_osm,
    limit, alpha, beta,
    K: tl.constexpr, E_POW2: tl.constexpr, SLAB: tl.constexpr, HAS_OFFSETS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    A_GROUP: tl.constexpr, B_GROUP: tl.constexpr,
    SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr, QUANT_OUT: tl.constexpr, DIAG: tl.constexpr = 0,
    TMA_STORE: tl.constexpr = False,
):
    # DIAG (probe only, wrong results): 1 = no epilogue store (the tile is computed, then stored only
    # under a runtime condition that never holds, so the compiler keeps the main loop)
    pid = tl.program_id(0)
    pid_n = pid % num_pid_n          # n fastest: one token tile's programs run together (x reuse in L2)
    pid_t = pid // num_pid_n
    e, row0, rows, store_rows = expert_tile(pid_t, counts_ptr, offsets_ptr, num_experts, tiles_per_expert,
                                            capacity, E_POW2, BLOCK_M, SLAB, HAS_OFFSETS)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    e64 = e.to(tl.int64)
    a_rows = (row0 + offs_m).to(tl.int64)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + e64 * stride_be + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]
    as_rows = as_ptr + a_rows * stride_asm
    bs_rows = bs_ptr + e64 * stride_bse + offs_n.to(tl.int64) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if rows > 0:   # (not a dynamic loop bound: the interpreter cannot range over a reduction)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + offs_k) < K
            a = tl.load(a_ptrs + k0, mask=m_mask[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs + k0, mask=k_ok[:, None] & n_mask[None, :], other=0.0)
            if SWIGLU:
                b_u = tl.load(b_ptrs + up_rows * stride_bn + k0, mask=k_ok[:, None] & n_mask[None, :], other=0.0)
            if A_GROUP or B_GROUP:
                if A_GROUP:
                    sa = tl.load(as_rows + k0 // 128, mask=m_mask, other=0.0)
                else:
                    sa = tl.load(as_rows, mask=m_mask, other=0.0)
                if B_GROUP:
                    sb = tl.load(bs_rows + k0 // 128, mask=n_mask, other=0.0)
                else:
                    sb = tl.load(bs_rows, mask=n_mask, other=0.0)
                acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
                if SWIGLU:
                    if B_GROUP:
                        sb_u = tl.load(bs_rows + up_rows * stride_bsn + k0 // 128, mask=n_mask, other=0.0)
                    else:
                        sb_u = tl.load(bs_rows + up_rows * stride_bsn, mask=n_mask, other=0.0)
                    acc_u += tl.dot(a, b_u) * (sa[:, None] * sb_u[None, :])
            else:
                acc = tl.dot(a, b, acc)
                if SWIGLU:
                    acc_u = tl.dot(a, b_u, acc_u)
    if not (A_GROUP or B_GROUP):
        # a tile slot past the last expert's tiles has e == num_experts: read no scale there
        has_e = e < num_experts
        sa = tl.load(as_rows, mask=m_mask, other=0.0)
        sb = tl.load(bs_rows, mask=n_mask & has_e, other=0.0)
        acc = acc * (sa[:, None] * sb[None, :])
        if SWIGLU:
            sb_u = tl.load(bs_rows + up_rows * stride_bsn, mask=n_mask & has_e, other=0.0)
            acc_u = acc_u * (sa[:, None] * sb_u[None, :])
    if SLAB:   # (contiguous tiles store only the expert's rows)
        # rows past the count hold 0 times the scales: 0 * NaN (a NaN weight scale) would put NaN
        # into the slab rows past the count, which are zero by contract
        acc = tl.where(m_mask[:, None], acc, 0.0)
        acc_u = tl.where(m_mask[:, None], acc_u, 0.0)
    if SWIGLU:
        acc = swiglu_tile(acc, acc_u, limit, alpha, beta, HAS_LIMIT)
    row_ok = offs_m < store_rows
    if DIAG == 1:
        row_ok = row_ok & (store_rows > (1 << 30))
    mask = row_ok[:, None] & n_mask[None, :]
    ptrs = out_ptr + a_rows[:, None] * stride_om + offs_n[None, :]
    if QUANT_OUT:
        q, scale = fp8_group_quant(acc, 1)
        tl.store(ptrs, q, mask=mask)
        tl.store(out_scale_ptr + a_rows * stride_osm + pid_n, scale, mask=row_ok)
    elif TMA_STORE and DIAG == 0:
        if store_rows > 0:   # (a descriptor needs rows; a slot past the last expert stores none)
        # one bulk tensor store of the tile (registers -> shared -> TMA), clipped at the tile's
        # last writable row by the descriptor's own row count (the next expert's rows follow)
            desc = tl.make_tensor_descriptor(out_ptr, [row0 + store_rows, N], [stride_om, 1], [BLOCK_M, BLOCK_N])
            desc.store([row0, pid_n * BLOCK_N], acc.to(out_ptr.dtype.element_ty))
    else:
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_row_tile(tile, a_ptr, as_ptr, b_ptr, bs_ptr, out_ptr, counts_ptr, offsets_ptr, N, num_experts,
                  tiles_per_expert, capacity, num_pid_n, stride_am, stride_asm, stride_be, stride_bn, stride_bse,
                  stride_bsn, stride_om, K: tl.constexpr, E_POW2: tl.constexpr, SLAB: tl.constexpr,
                  HAS_OFFSETS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  a_desc, b_desc, TMA_LOAD: tl.constexpr):
    """One (token tile, n tile) of the row-scaled FP8 GEMM, computed and stored. TMA_LOAD: the
    operand tiles by TMA from host descriptors over a [M, K] and b [E * N, K]; rows past the
    expert's (the next expert's, or zeros past the end) enter the product only in rows and
    columns that are zeroed and never stored."""
    pid_n = tile % num_pid_n
    pid_t = tile // num_pid_n
    e, row0, rows, store_rows = expert_tile(pid_t, counts_ptr, offsets_ptr, num_experts, tiles_per_expert,
                                            capacity, E_POW2, BLOCK_M, SLAB, HAS_OFFSETS)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    e64 = e.to(tl.int64)
    a_rows = (row0 + offs_m).to(tl.int64)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + e64 * stride_be + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if TMA_LOAD:
            a = a_desc.load([row0, k0])
            b = b_desc.load([e * N + pid_n * BLOCK_N, k0])
            acc = tl.dot(a, b.T, acc)
        else:
            k_ok = (k0 + offs_k) < K
            a = tl.load(a_ptrs + k0, mask=m_mask[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs + k0, mask=k_ok[:, None] & n_mask[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
    has_e = e < num_experts
    sa = tl.load(as_ptr + a_rows * stride_asm, mask=m_mask, other=0.0)
    sb = tl.load(bs_ptr + e64 * stride_bse + offs_n.to(tl.int64) * stride_bsn, mask=n_mask & has_e, other=0.0)
    acc = acc * (sa[:, None] * sb[None, :])
    # slab rows past the count (zero by contract): 0 times a NaN weight scale; with TMA loads, rows
    # and columns of other experts' operands (NaN * 0 stays NaN)
    if TMA_LOAD or SLAB:
        acc = tl.where(m_mask[:, None] & n_mask[None, :], acc, 0.0)
    mask = (offs_m < store_rows)[:, None] & n_mask[None, :]
    tl.store(out_ptr + a_rows[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_gemm_persistent_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, out_ptr, counts_ptr, offsets_ptr,
    N, num_experts, tiles_per_expert, capacity, num_pid_n, slots,
    stride_am, stride_asm, stride_be, stride_bn, stride_bse, stride_bsn, stride_om,
    K: tl.constexpr, E_POW2: tl.constexpr, SLAB: tl.constexpr, HAS_OFFSETS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    FLATTEN: tl.constexpr, INTERPRETED: tl.constexpr, a_desc, b_desc, TMA_LOAD: tl.constexpr,
):
    """The row-scaled FP8 GEMM of `_fp8_gemm_kernel` as a persistent kernel: NUM_PROGRAMS programs
    walk the (token tile, n tile) pairs with a stride, one loop over tiles and K steps (FLATTEN:
    the compiler pipelines across tile boundaries, so the next tile's loads are in flight during
    this tile's epilogue). Contiguous layouts walk only the tiles that hold rows."""
    if SLAB:
        total = slots * num_pid_n
    else:
        idx = tl.arange(0, E_POW2)
        cnt = tl.load(counts_ptr + idx, mask=idx < num_experts, other=0).to(tl.int32)
        total = tl.sum((cnt + BLOCK_M - 1) // BLOCK_M, 0) * num_pid_n
    if INTERPRETED:   # (the interpreter takes no runtime loop bounds in a `for`)
        tile = tl.program_id(0)
        while tile < total:
            _fp8_row_tile(tile, a_ptr, as_ptr, b_ptr, bs_ptr, out_ptr, counts_ptr, offsets_ptr, N, num_experts,
                          tiles_per_expert, capacity, num_pid_n, stride_am, stride_asm, stride_be, stride_bn,
                          stride_bse, stride_bsn, stride_om, K, E_POW2, SLAB, HAS_OFFSETS, BLOCK_M, BLOCK_N, BLOCK_K,
                          a_desc, b_desc, TMA_LOAD)
            tile += NUM_PROGRAMS
    else:
        for tile in tl.range(tl.program_id(0), total, NUM_PROGRAMS, flatten=FLATTEN):
            _fp8_row_tile(tile, a_ptr, as_ptr, b_ptr, bs_ptr, out_ptr, counts_ptr, offsets_ptr, N, num_experts,
                          tiles_per_expert, capacity, num_pid_n, stride_am, stride_asm, stride_be, stride_bn,
                          stride_bse, stride_bsn, stride_om, K, E_POW2, SLAB, HAS_OFFSETS, BLOCK_M, BLOCK_N, BLOCK_K,
                          a_desc, b_desc, TMA_LOAD)


@dataclass(frozen=True)
class FP8Config:
    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 4
    tma_store: bool = False     # the epilogue as one TMA store per tile (bf16 / fp32 output only)
    # > 0: that many programs of `_fp8_gemm_persistent_kernel` (row scales, no SwiGLU / fp8 output;
    # else the one-tile kernel), -1: one per SM; its tile and K loops flattened or not, operands by
    # TMA or not
    persistent: int = 0
    flatten: bool = True
    tma_load: bool = False


def pick_fp8_config(rows_per_expert: float, promote: bool, swiglu: bool = False) -> FP8Config:
    """Tile shape by tokens per expert, from the H200 probe (bench/gemm-notes.md): V3 L1 at 2048
    tok/expert 128x256 3073 µs < 256x128 3182 < 128x128 3458; at 128 tok/expert 128x128 282 µs <
    64x128 340. Two accumulators (SwiGLU) or per-128 rescaling: 128x128 (registers).
    The 128x256 tiles run persistent (one program per SM, tile and K loops flattened): V3 L2
    (K 2048) at 2048 tok/expert 1682 -> 1555 µs (DeepGEMM 1553), at 512 433 -> 428 (DeepGEMM 374)
    (prefill2 probe, H200, 2026-12-03: `python -m megapar.launch.bench.gemm --probe --sections
    prefill2`); TMA operand loads and a TMA-store epilogue were slower there."""
    if rows_per_expert <= 32:
        return FP8Config(block_m=64, block_n=128, num_warps=4, num_stages=4)
    if rows_per_expert <= 256 or promote or swiglu:
        return FP8Config(block_m=128, block_n=128, num_warps=8, num_stages=4 if not promote else 3)
    return FP8Config(block_m=128, block_n=256, num_warps=8, num_stages=3, persistent=-1)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 2     # (the interpreter: a few programs, each walking several tiles)
    return torch.cuda.get_device_properties(device).multi_processor_count


def fp8_grouped_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, rows, *,
                     out_dtype: torch.dtype, swiglu: tuple[float | None, float, float] | None = None,
                     quant_out: bool = False, config: FP8Config | None = None, diag: int = 0
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """a: e4m3 [M, K] (slab rows flattened), a_scale fp32 [M, 1] or [M, ceil(K/128)];
    b: e4m3 [E, N, K], b_scale fp32 [E, N] / [E, N, 1] (per row) or [E, N, ceil(K/128)] (per 1x128
    group along K; the last group is partial when K is not a multiple of 128).
    Returns [M, N] (or [M, N/2] with swiglu) in out_dtype, or (e4m3, fp32 [M, N/256]) with quant_out.
    diag: the probe's subtraction variant (1: no epilogue store; the output is left unwritten)."""
    if a.dim() != 2 or b.dim() != 3 or b.shape[-1] != a.shape[-1]:
        raise ValueError(f"fp8 grouped GEMM needs a [M, K] and b [E, N, K], got a {tuple(a.shape)}, b {tuple(b.shape)}")
    M, K = a.shape
    E, N, _ = b.shape
    G = -(-K // 128)
    if a_scale.dtype != torch.float32 or tuple(a_scale.shape) not in ((M, 1), (M, G)):
        raise ValueError(f"a_scale must be fp32 [M={M}, 1] (per token) or [M, ceil(K/128)={G}], got "
                         f"{a_scale.dtype}{tuple(a_scale.shape)}")
    if b_scale.dtype != torch.float32 or tuple(b_scale.shape) not in ((E, N), (E, N, 1), (E, N, G)):
        raise ValueError(f"b_scale must be fp32 [E={E}, N={N}] (per row) or [E, N, ceil(K/128)={G}], got "
                         f"{b_scale.dtype}{tuple(b_scale.shape)}")
    a_group = a_scale.shape[-1] > 1
    b_scale = b_scale.reshape(E, N, -1)
    b_group = b_scale.shape[-1] > 1
    hint = rows.rows_hint
    cfg = config or pick_fp8_config(hint, a_group or b_group, swiglu is not None)
    n_out = N // 2 if swiglu is not None else N
    if quant_out:
        if swiglu is None or n_out % 128:
            raise ValueError(f"fp8 group output needs swiglu and I % 128 == 0, got I={n_out}")
        cfg = FP8Config(**{**cfg.__dict__, "block_n": 128})
    slots, tpe, cap, counts, offs, has_offs = layout_args(rows, a, cfg.block_m)
    if quant_out:
        out = torch.empty(M, n_out, dtype=torch.float8_e4m3fn, device=a.device)
        out_scale = torch.empty(M, n_out // 128, dtype=torch.float32, device=a.device)
    else:
        out = torch.empty(M, n_out, dtype=out_dtype, device=a.device)
        out_scale = out
    num_pid_n = triton.cdiv(n_out, cfg.block_n)
    if slots == 0 or n_out == 0:
        return (out, out_scale) if quant_out else out
    if cfg.persistent and not (a_group or b_group or swiglu is not None or quant_out or diag):
        n_prog = cfg.persistent if cfg.persistent > 0 else _sm_count(a.device)
        # (descriptors over a [M, K] and b viewed as [E * N, K]: both need rows and a dense layout)
        tma_load = cfg.tma_load and M > 0 and K % 16 == 0 and _tma_store_ok(a) and b.is_contiguous() \
            and b.data_ptr() % 16 == 0
        a_desc = b_desc = a   # (unused without TMA_LOAD)
        if tma_load:
            from triton.tools.tensor_descriptor import TensorDescriptor
            a_desc = TensorDescriptor(a, [M, K], [a.stride(0), 1], [cfg.block_m, 128])
            b2 = b.view(E * N, K)
            b_desc = TensorDescriptor(b2, [E * N, K], [b2.stride(0), 1], [cfg.block_n, 128])
        _fp8_gemm_persistent_kernel[(n_prog,)](
            a, a_scale, b, b_scale, out, counts, offs, n_out, E, tpe, cap, num_pid_n, slots,
            a.stride(0), a_scale.stride(0), b.stride(0), b.stride(1), b_scale.stride(0), b_scale.stride(1),
            out.stride(0), K=K, E_POW2=triton.next_power_of_2(max(E, 2)), SLAB=rows.layout == "slab",
            HAS_OFFSETS=has_offs, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=128, NUM_PROGRAMS=n_prog,
            FLATTEN=cfg.flatten, INTERPRETED=impl.interpreting(), a_desc=a_desc, b_desc=b_desc, TMA_LOAD=tma_load,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return out
    limit, alpha, beta = swiglu if swiglu is not None else (None, 1.0, 0.0)
    tma_store = cfg.tma_store and not quant_out and _tma_store_ok(out)
    if tma_store:
        impl.ensure_triton_scratch()
    _fp8_gemm_kernel[(slots * num_pid_n,)](
        a, a_scale, b, b_scale, out, out_scale, counts, offs,
        n_out, E, tpe, cap, n_out, num_pid_n,
        a.stride(0), a_scale.stride(0), b.stride(0), b.stride(1), b_scale.stride(0), b_scale.stride(1),
        out.stride(0), out_scale.stride(0),
        float(limit) if limit is not None else 0.0, float(alpha), float(beta),
        K=K, E_POW2=triton.next_power_of_2(max(E, 2)), SLAB=rows.layout == "slab", HAS_OFFSETS=has_offs,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=128, A_GROUP=a_group, B_GROUP=b_group,
        SWIGLU=swiglu is not None, HAS_LIMIT=limit is not None, QUANT_OUT=quant_out, DIAG=diag,
        TMA_STORE=tma_store,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return (out, out_scale) if quant_out else out


def _tma_store_ok(out: torch.Tensor) -> bool:
    """A TMA descriptor over out [M, N]: 16-byte aligned base and row stride, unit inner stride."""
    e = out.element_size()
    return out.stride(-1) == 1 and out.data_ptr() % 16 == 0 and (out.stride(0) * e) % 16 == 0


def fp8_weight(w: PreparedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [E, N, K], fp32 scale [E, N] or [E, N, K/128]) for the W4A8 GEMM: an fp8 weight as
    it is; an mxfp4 weight's resident copy (`PreparedWeight.keep_fp8`), else expanded now
    (rowwise fold when exact, else 1x128)."""
    fold = w.fp8_fold
    if fold == "fp8":
        return w.data, w.scale
    if "fp8_resident" in w.cache:
        return w.cache["fp8_resident"]
    if fold is not None:
        return expand_fp4(w, fold=fold)
    if w.fmt != "mxfp4":
        raise ValueError(f"triton_w4a8 needs mxfp4 or fp8_block weights (exact FP8), got {w.fmt!r}")
    raise ValueError("this mxfp4 weight has blocks more than 14 exponents below their group's largest, so "
                     "it has no exact FP8 form; use backend='triton_w4a16'")


def w4a8_grouped_gemm(x: torch.Tensor, w: PreparedWeight, rows, *, out_dtype: torch.dtype,
                      config: FP8Config | None = None) -> torch.Tensor:
    """grouped_gemm's triton_w4a8 path: x quantized per token, weight to exact FP8, fp8 GEMM."""
    K = w.k
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    a, a_scale = quantize_act(x2, group=False)
    b, b_scale = fp8_weight(w)
    y = fp8_grouped_gemm(a, a_scale, b, b_scale, rows, out_dtype=out_dtype, config=config)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def torch_scaled_grouped_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                            counts: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Rowwise fp8 grouped GEMM through torch._scaled_grouped_mm (contiguous rows; per-token and
    per-row scales only): the anchor of the W4A8 target, also usable when the fold is rowwise."""
    offs = torch.cumsum(counts, 0).to(torch.int32)
    return torch._scaled_grouped_mm(a, b.transpose(-2, -1), a_scale.reshape(-1), b_scale.reshape(b.shape[0], -1),
                                    offs=offs, out_dtype=out_dtype)
