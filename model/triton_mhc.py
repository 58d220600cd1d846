"""Triton kernels of mHC (model/mhc.py holds the torch reference and the public functions).

Two kernels, all per token and memory-bound:
- `_mix_kernel` reads [BLOCK_T, BLOCK_H] tiles of each residual stream (or makes them: with
  FUSE_POST it computes the previous sublayer's post mixing and stores the new residual) and
  accumulates the projection x @ fn^T ([T, (2+M)M], a GEMM with N = 24, one dot per stream)
  and sum(x^2) over its slice of H. The H axis is split over the grid (split-K) so small T
  still fills the GPU; the splits land in fp32 partials [S, T, NPAD] and [S, T]. With FINISH,
  the last split of each token block to arrive (an atomic counter per block, reset by that
  program; the CUTLASS "semaphore" pattern: barrier, then release/acquire at GPU scope) sums
  the partials, scales by rsqrt(mean(x^2) + rms_eps) and computes pre, post and the
  Sinkhorn-normalized comb in registers ([BLOCK_T, M, M], all iterations in the kernel); with
  FINISH == 2 it also writes the layer input sum_i pre_i x_i for its tokens. So `pre` is ONE
  launch up to SINGLE_LAUNCH_MAX_TOKENS tokens and the fused `post_pre` up to FUSE_MAX_TOKENS:
  at small T the cost of mHC was host time (each launch is tens of microseconds of Python on
  the H200 host; the old pre was three launches and ~250 us at any T <= 1024).
  Without projection (FUSE_POST only) it is the plain post kernel.
- `_streams_sum_kernel` writes sum_i w_i x_i ([T, H]), fully parallel over (T, H): the layer
  input above SINGLE_LAUNCH_MAX_TOKENS (where one program per token block would be too few
  for the bandwidth) and the head.

Loop bounds are constexpr (H_PER_SPLIT, S, H_LOOP): the interpreter cannot iterate over a
runtime bound with numpy 2, and powers of two keep the number of compiled variants small. The
loop over streams is a real loop, not unrolled: unrolled, the compiler hoists every stream's
loads and the projection kernel spills. Register counts (ptxas sm_90, compiled on a CPU
machine with triton.compile and a GPUTarget; bf16 residual, unit stride): 56-127, no spills.

The projection is fp32-accurate (the reference is an fp32 matmul) at tensor-core speed: for a
bf16 residual x is exact in bf16 and fn is split into three bf16 parts (three bf16 MMAs, fp32
accumulation); otherwise `tl.dot(..., input_precision="tf32x3")`. The interpreter's bf16 dot
is wrong, so there the same three products run as fp32 dots (BF16_DOT=False). M must be a
power of two (tl.arange); residual tensors may have any strides (the first-layer broadcast is
a stride-0 view; a layout whose offsets within a token pass int32 gets a WIDE, int64 variant).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_DOT_PRECISION = "tf32x3"


@triton.jit
def _mix_kernel(res_ptr, s_rt, s_rm, s_rh,
                out_ptr, s_ot, s_oh, post_ptr, comb_ptr, new_ptr,
                fn_ptr, part_ptr, cnt_ptr, base_ptr, scale_ptr, x_ptr, post2_ptr, comb2_ptr,
                T, H, N, inv_k, eps, rms_eps, H_PER_SPLIT: tl.constexpr, S: tl.constexpr, ITERS: tl.constexpr,
                M: tl.constexpr, NPAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                BLOCK_S: tl.constexpr, BLOCK_HO: tl.constexpr, H_LOOP: tl.constexpr, SUB_T: tl.constexpr,
                FUSE_POST: tl.constexpr, PROJECT: tl.constexpr, FINISH: tl.constexpr,
                DOT_PRECISION: tl.constexpr, X_BF16: tl.constexpr,
                BF16_DOT: tl.constexpr, WIDE: tl.constexpr = False):
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    offs_t = offs_t.to(tl.int64)  # T * M * H may pass 2^31
    if WIDE:  # an offset within a token passes 2^31 - 1 (_needs_int64): j * s_rm, h * s_rh, h * s_oh in int64
        s_rm = tl.cast(s_rm, tl.int64)  # (also _finish's s_m)
    if PROJECT:
        offs_n = tl.arange(0, NPAD)
        acc = tl.zeros((BLOCK_T, NPAD), dtype=tl.float32)
        sq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    # H_PER_SPLIT is a multiple of BLOCK_H: blocks never straddle two splits.
    for step in range(0, H_PER_SPLIT, BLOCK_H):
        offs_h = pid_s * H_PER_SPLIT + step + tl.arange(0, BLOCK_H)
        h_mask = offs_h < H
        mask2 = t_mask[:, None] & h_mask[None, :]
        if WIDE:
            offs_h = offs_h.to(tl.int64)
        if FUSE_POST:
            out = tl.load(out_ptr + offs_t[:, None] * s_ot + offs_h[None, :] * s_oh, mask=mask2,
                          other=0.0).to(tl.float32)
        for j in range(M):
            # x: stream j of the residual [BLOCK_T, BLOCK_H] (with FUSE_POST: of the new residual,
            # sum_i comb[t, i, j] * residual_i + post_j * out; the residual tiles are re-read per j
            # from L1/L2, which keeps registers free for the projection).
            if FUSE_POST:
                post_j = tl.load(post_ptr + offs_t * M + j, mask=t_mask, other=0.0)
                x = post_j[:, None] * out
                for i in range(M):
                    c_ij = tl.load(comb_ptr + offs_t * (M * M) + i * M + j, mask=t_mask, other=0.0)
                    r_i = tl.load(res_ptr + offs_t[:, None] * s_rt + i * s_rm + offs_h[None, :] * s_rh, mask=mask2,
                                  other=0.0).to(tl.float32)
                    x += c_ij[:, None] * r_i
                x = x.to(new_ptr.dtype.element_ty)
                tl.store(new_ptr + offs_t[:, None] * (M * H) + j * H + offs_h[None, :], x, mask=mask2)
                x = x.to(tl.float32)  # project what the next pre would read back
            else:
                x = tl.load(res_ptr + offs_t[:, None] * s_rt + j * s_rm + offs_h[None, :] * s_rh, mask=mask2,
                            other=0.0).to(tl.float32)
            if PROJECT:
                sq += tl.sum(x * x, axis=1)
                # fn [N, M*H]: rows n, columns j*H + h -> tile [BLOCK_H, NPAD]
                w = tl.load(fn_ptr + offs_n[None, :] * (M * H) + j * H + offs_h[:, None],
                            mask=h_mask[:, None] & (offs_n[None, :] < N), other=0.0)
                if X_BF16:
                    # x is exact in bf16 (a bf16 residual): fn = hi + mid + lo in bf16 (24 bits, all of
                    # fp32's mantissa), three bf16 MMAs with fp32 accumulation: fp32-accurate at twice
                    # tf32's rate and without tf32x3's split of x. Smallest part first.
                    xb = x.to(tl.bfloat16)
                    w_hi = w.to(tl.bfloat16)
                    r = w - w_hi.to(tl.float32)
                    w_mid = r.to(tl.bfloat16)
                    w_lo = (r - w_mid.to(tl.float32)).to(tl.bfloat16)
                    if BF16_DOT:
                        acc = tl.dot(xb, w_lo, acc)
                        acc = tl.dot(xb, w_mid, acc)
                        acc = tl.dot(xb, w_hi, acc)
                    else:  # the interpreter (its bf16 dot is wrong): the same exact products in fp32
                        xe = xb.to(tl.float32)
                        acc = tl.dot(xe, w_lo.to(tl.float32), acc, input_precision="ieee")
                        acc = tl.dot(xe, w_mid.to(tl.float32), acc, input_precision="ieee")
                        acc = tl.dot(xe, w_hi.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc += tl.dot(x, w, input_precision=DOT_PRECISION)
    if PROJECT:
        # partials: part [S, T, NPAD] then sq [S, T] in one fp32 buffer
        sq_ptr = part_ptr + S * T * NPAD
        tl.store(part_ptr + (pid_s * T + offs_t[:, None]) * NPAD + offs_n[None, :], acc, mask=t_mask[:, None])
        tl.store(sq_ptr + pid_s * T + offs_t, sq, mask=t_mask)
        if FINISH > 0:
            # The last of the S programs of this token block (counted with an atomic) reduces the
            # partials, computes the coefficients and writes the layer input: pre in one launch.
            tl.debug_barrier()  # every thread's partials are stored before the release below
            if S > 1:
                done = tl.atomic_add(cnt_ptr + pid_t, 1, sem="acq_rel")
                if done == S - 1:
                    tl.atomic_xchg(cnt_ptr + pid_t, 0)  # ready for the next launch
                    if FUSE_POST:
                        _finish(new_ptr, M * H, H, 1, part_ptr, sq_ptr, base_ptr, scale_ptr, x_ptr, post2_ptr,
                                comb2_ptr, pid_t, T, H, inv_k, eps, rms_eps, S, ITERS, M, NPAD, BLOCK_T, BLOCK_S,
                                BLOCK_HO, H_LOOP, SUB_T, FINISH, WIDE)
                    else:
                        _finish(res_ptr, s_rt, s_rm, s_rh, part_ptr, sq_ptr, base_ptr, scale_ptr, x_ptr, post2_ptr,
                                comb2_ptr, pid_t, T, H, inv_k, eps, rms_eps, S, ITERS, M, NPAD, BLOCK_T, BLOCK_S,
                                BLOCK_HO, H_LOOP, SUB_T, FINISH, WIDE)
            else:
                if FUSE_POST:
                    _finish(new_ptr, M * H, H, 1, part_ptr, sq_ptr, base_ptr, scale_ptr, x_ptr, post2_ptr,
                            comb2_ptr, pid_t, T, H, inv_k, eps, rms_eps, S, ITERS, M, NPAD, BLOCK_T, BLOCK_S,
                            BLOCK_HO, H_LOOP, SUB_T, FINISH, WIDE)
                else:
                    _finish(res_ptr, s_rt, s_rm, s_rh, part_ptr, sq_ptr, base_ptr, scale_ptr, x_ptr, post2_ptr,
                            comb2_ptr, pid_t, T, H, inv_k, eps, rms_eps, S, ITERS, M, NPAD, BLOCK_T, BLOCK_S,
                            BLOCK_HO, H_LOOP, SUB_T, FINISH, WIDE)


@triton.jit
def _finish(src_ptr, s_t, s_m, s_h, part_ptr, sq_ptr, base_ptr, scale_ptr, x_ptr, post_ptr, comb_ptr,
            pid_t, T, H, inv_k, eps, rms_eps, S: tl.constexpr, ITERS: tl.constexpr, M: tl.constexpr,
            NPAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_HO: tl.constexpr,
            H_LOOP: tl.constexpr, SUB_T: tl.constexpr, FINISH: tl.constexpr, WIDE: tl.constexpr):
    """One token block after its projection: sum the S partials, pre/post/comb (Sinkhorn in
    registers on [BLOCK_T, M, M]); the pre weights go to w [T, M] (after the partials). With
    FINISH == 2 also the layer input = sum_i pre_i src_i over all of H."""
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_m = tl.arange(0, M)
    offs_mm = tl.arange(0, M * M)  # i * M + j
    offs_s = tl.arange(0, BLOCK_S)
    t_mask = offs_t < T
    offs_t = offs_t.to(tl.int64)
    t2 = offs_t[:, None]
    mask2 = t_mask[:, None]
    ij = offs_m[:, None] * M + offs_m[None, :]
    acc_pre = tl.zeros((BLOCK_T, M), dtype=tl.float32)
    acc_post = tl.zeros((BLOCK_T, M), dtype=tl.float32)
    acc_comb = tl.zeros((BLOCK_T, M * M), dtype=tl.float32)
    sq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for s0 in range(0, S, BLOCK_S):  # BLOCK_S splits per step: [BLOCK_T, BLOCK_S, cols] tiles
        s_idx = s0 + offs_s
        s_ok = s_idx < S
        row = part_ptr + (s_idx[None, :, None] * T + offs_t[:, None, None]) * NPAD
        mask3 = t_mask[:, None, None] & s_ok[None, :, None]
        # .cg: the other splits' partials were written by other SMs; read them from L2
        acc_pre += tl.sum(tl.load(row + offs_m[None, None, :], mask=mask3, other=0.0, cache_modifier=".cg"), axis=1)
        acc_post += tl.sum(tl.load(row + M + offs_m[None, None, :], mask=mask3, other=0.0, cache_modifier=".cg"),
                           axis=1)
        acc_comb += tl.sum(tl.load(row + 2 * M + offs_mm[None, None, :], mask=mask3, other=0.0,
                                   cache_modifier=".cg"), axis=1)
        sq += tl.sum(tl.load(sq_ptr + s_idx[None, :] * T + offs_t[:, None], mask=mask2 & s_ok[None, :], other=0.0,
                             cache_modifier=".cg"), axis=1)
    rstd = 1.0 / tl.sqrt(sq * inv_k + rms_eps)
    s_pre = tl.load(scale_ptr)
    s_post = tl.load(scale_ptr + 1)
    s_comb = tl.load(scale_ptr + 2)
    b_pre = tl.load(base_ptr + offs_m)
    b_post = tl.load(base_ptr + M + offs_m)
    b_comb = tl.load(base_ptr + 2 * M + ij)
    pre = tl.sigmoid(acc_pre * rstd[:, None] * s_pre + b_pre[None, :]) + eps
    post = 2.0 * tl.sigmoid(acc_post * rstd[:, None] * s_post + b_post[None, :])
    logits = tl.reshape(acc_comb, (BLOCK_T, M, M)) * rstd[:, None, None] * s_comb + b_comb[None, :, :]
    e = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
    c = e / tl.sum(e, axis=2)[:, :, None] + eps
    c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
    for _ in range(ITERS - 1):
        c = c / (tl.sum(c, axis=2)[:, :, None] + eps)
        c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
    tl.store(post_ptr + t2 * M + offs_m[None, :], post, mask=mask2)
    tl.store(comb_ptr + offs_t[:, None, None] * (M * M) + ij[None, :, :], c, mask=t_mask[:, None, None])
    w_ptr = sq_ptr + S * T  # [T, M] fp32
    tl.store(w_ptr + t2 * M + offs_m[None, :], pre, mask=mask2)
    if FINISH == 2:
        tl.debug_barrier()  # the weights are read back by other threads of this program
        # layer input: [SUB_T, M, BLOCK_HO] tiles of the streams, weighted by pre and summed over M.
        # SUB_T = min(BLOCK_T, next_power_of_2(T)) covers every token of the block that exists.
        offs_u = pid_t * BLOCK_T + tl.arange(0, SUB_T)
        u_mask = offs_u < T
        offs_u = offs_u.to(tl.int64)
        w = tl.load(w_ptr + offs_u[:, None] * M + offs_m[None, :], mask=u_mask[:, None], other=0.0)
        for h0 in range(0, H_LOOP, BLOCK_HO):
            offs_h = h0 + tl.arange(0, BLOCK_HO)
            h_ok = offs_h < H
            if WIDE:  # as in _mix_kernel (s_m comes from it in int64)
                offs_h = offs_h.to(tl.int64)
            xs = tl.load(src_ptr + offs_u[:, None, None] * s_t + offs_m[None, :, None] * s_m
                         + offs_h[None, None, :] * s_h, mask=u_mask[:, None, None] & h_ok[None, None, :],
                         other=0.0, cache_modifier=".cg").to(tl.float32)
            y = tl.sum(xs * w[:, :, None], axis=1)
            tl.store(x_ptr + offs_u[:, None] * H + offs_h[None, :], y.to(x_ptr.dtype.element_ty),
                     mask=u_mask[:, None] & h_ok[None, :])


@triton.jit
def _streams_sum_kernel(res_ptr, s_rt, s_rm, s_rh, w_ptr, out_ptr, T, H,
                        M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, WIDE: tl.constexpr = False):
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    t_mask = offs_t < T
    offs_t = offs_t.to(tl.int64)
    mask2 = t_mask[:, None] & (offs_h[None, :] < H)
    if WIDE:  # as in _mix_kernel: i * s_rm and h * s_rh in int64
        s_rm = tl.cast(s_rm, tl.int64)
        offs_h = offs_h.to(tl.int64)
    y = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for i in tl.static_range(M):
        w_i = tl.load(w_ptr + offs_t * M + i, mask=t_mask, other=0.0)  # [BLOCK_T] fp32
        x_i = tl.load(res_ptr + offs_t[:, None] * s_rt + i * s_rm + offs_h[None, :] * s_rh, mask=mask2, other=0.0)
        y += w_i[:, None] * x_i.to(tl.float32)
    tl.store(out_ptr + offs_t[:, None] * H + offs_h[None, :], y.to(out_ptr.dtype.element_ty), mask=mask2)


# ---- launchers --------------------------------------------------------------------------------

SINGLE_LAUNCH_MAX_TOKENS = 512
"""Up to this many tokens `pre` is one launch: the last split of each 16-token block also writes
the layer input (at small T a launch's host time outweighs the GPU time). Above it the
projection uses 64-token blocks (Hopper MMA; fn is re-read from L2 once per block) and the layer
input is a second, fully parallel kernel. Measured on the H200 (`megapar bench mhc`, eager
calls), two launches against one: T = 1024 177 / 407 us (H = 7168), 172 / 252 (H = 4096);
T = 4096 331 / 1047, 250 / 664 (it was 4096, which those rows contradicted in the runs of
2026-12-01 and -05). Between 128 and 1024 not yet measured: the bench times the other form at
T = 128 too."""

FUSE_MAX_TOKENS = 2048
"""Up to this many tokens `post_pre` is one fused launch; above, post then pre (the fused
projection re-reads the residual tiles once per stream and measured 0.71x of unfused at 4096)."""

_counters: dict = {}
_retired: list = []


# Plain Python: triton.cdiv / triton.next_power_of_2 are constexpr functions whose wrapper costs
# microseconds per call, and the launchers run on every layer.
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


_INT32_MAX = 2**31 - 1


def _needs_int64(*tensors: torch.Tensor) -> bool:
    """True when an offset within one token of one of `tensors` ([T, ...]: the sum of index * stride
    over the dims after T) can pass 2^31 - 1. The kernels then compute the stream and H offsets in
    int64 (WIDE), as they always do the token offsets: in int32, h * s_rh wrapped on a residual
    [T, M, H] whose H is not innermost (likewise j * s_rm with the streams outermost, h * s_oh on a
    transposed out) and the loads read before the tensor. Only then, because 64-bit offsets cost the
    one-launch pre 15 registers (80 -> 95 at 8 warps, sm_90: 2 programs per SM instead of 3)."""
    for t in tensors:
        span = 0
        for n, s in zip(t.shape[1:], t.stride()[1:]):
            span += (n - 1) * abs(s)
        if span > _INT32_MAX:
            return True
    return False


def _check_streams(m: int) -> None:
    if m & (m - 1):
        raise ValueError(f"the Triton mHC kernels need a power-of-two number of streams, got M={m}; "
                         f"use backend='torch'")


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4  # interpreter


def _block_counters(device: torch.device, n: int) -> torch.Tensor:
    """int32 zeros [>= n], one per token block, for the last-split election; each launch leaves
    them at zero. One buffer per (device, stream): launches on one stream never overlap (graphs
    captured on one stream share a buffer, so replay them on one stream, not concurrently)."""
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None)
    buf = _counters.get(key)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _retired.append(buf)  # a captured CUDA graph may still use it: never free it
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _counters[key] = buf
    return buf


def _mix_config(t: int, m: int, h: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_H, H_PER_SPLIT): enough programs to fill the GPU, few splits at large T.

    BLOCK_T = 64 lets the dot use Hopper's warpgroup MMA (M >= 64); up to SINGLE_LAUNCH_MAX_TOKENS
    16-token blocks (mma.sync), so that more programs share the final weighted sum. ptxas for
    sm_90 (bf16 residual, unit stride along H): 64x64 115 registers, 16x64 95 (fused post 127),
    no spills. ~8 programs per SM: each has only one [BLOCK_T, BLOCK_H] tile in flight, and the
    loads are latency-bound below that (at 2 per SM the projection reached ~1/4 of the copy rate).
    """
    block_t, block_h = (16, 64) if t <= SINGLE_LAUNCH_MAX_TOKENS else (64, 64)
    num_t = _cdiv(t, block_t)
    max_splits = _cdiv(h, block_h)
    splits = min(max_splits, 64, _pow2(_cdiv(8 * _num_sms(device), num_t)))
    h_per_split = block_h * _cdiv(max_splits, splits)
    return block_t, block_h, h_per_split


def _launch(residual: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
            eps: float, rms_eps: float, *, finish: int, post_inputs: tuple | None = None):
    """One launch of `_mix_kernel` with projection. finish 0: partials only; 1: + pre/post/comb;
    2: + layer input. Returns (scratch, layer_input | None, post | None, comb | None, new | None);
    scratch holds part [S, T, NPAD], sq [S, T] and pre weights [T, M] (fp32, flat)."""
    t, m, h = residual.shape
    n = fn.shape[0]
    dev = residual.device
    npad = max(16, _pow2(n))
    block_t, block_h, h_per_split = _mix_config(t, m, h, dev)
    splits = _cdiv(h, h_per_split)
    num_t = _cdiv(t, block_t)
    if fn.dtype != torch.float32 or not fn.is_contiguous():
        fn = fn.float().contiguous()
    scratch = torch.empty(splits * t * (npad + 1) + t * m, dtype=torch.float32, device=dev)
    new = post2 = comb2 = x = None
    wide = _needs_int64(residual)
    if post_inputs is not None:
        out, post_w, comb = post_inputs
        wide = wide or _needs_int64(out)
        new = torch.empty(t, m, h, dtype=residual.dtype, device=dev)
        out_args = (out, out.stride(0), out.stride(1), _f32(post_w), _f32(comb), new)
    else:
        out_args = (residual, 0, 0, residual, residual, residual)  # unused
    if finish:
        post2 = torch.empty(t, m, dtype=torch.float32, device=dev)
        comb2 = torch.empty(t, m, m, dtype=torch.float32, device=dev)
        cnt = _block_counters(dev, num_t) if splits > 1 else scratch
        coeff_args = (cnt, _f32(base), _f32(scale))
    else:
        coeff_args = (scratch, scratch, scratch)
    if finish == 2:
        x = torch.empty(t, h, dtype=new.dtype if new is not None else residual.dtype, device=dev)
    sub_t = min(block_t, _pow2(t))
    # The layer input of a token block is written by ONE program: [SUB_T, M, BLOCK_HO] tiles of
    # 16K elements (32 KB of bf16 in flight per step, 8 warps) keep it from being latency-bound.
    num_warps = 8 if finish == 2 else 4
    block_ho = max(16, min(4096, 2048 * num_warps // (sub_t * m)))
    grid = (num_t, splits)
    _mix_kernel[grid](residual, *residual.stride(), *out_args, fn, scratch, *coeff_args,
                      x if x is not None else scratch, post2 if finish else scratch, comb2 if finish else scratch,
                      t, h, n, 1.0 / (m * h), eps, rms_eps, h_per_split, splits, iters,
                      M=m, NPAD=npad, BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_S=min(16, _pow2(splits)),
                      BLOCK_HO=block_ho, H_LOOP=_cdiv(h, block_ho) * block_ho, SUB_T=sub_t,
                      FUSE_POST=post_inputs is not None, PROJECT=True, FINISH=finish,
                      DOT_PRECISION=_DOT_PRECISION, X_BF16=residual.dtype == torch.bfloat16,
                      BF16_DOT=dev.type == "cuda", WIDE=wide, num_warps=num_warps, num_stages=2)
    return scratch, x, post2, comb2, new


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()


def _streams_sum(residual: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    t, m, h = residual.shape
    out = torch.empty(t, h, dtype=residual.dtype, device=residual.device)
    block_t = 1 if t < 64 else 4
    block_h = max(64, min(1024, 4096 // (m * block_t)))
    grid = (_cdiv(t, block_t), _cdiv(h, block_h))
    _streams_sum_kernel[grid](residual, *residual.stride(), _f32(weights), out, t, h,
                              M=m, BLOCK_T=block_t, BLOCK_H=block_h, WIDE=_needs_int64(residual))
    return out


def _weights(scratch: torch.Tensor, t: int, m: int) -> torch.Tensor:
    """The pre weights [T, M] at the end of the scratch buffer."""
    return scratch[scratch.numel() - t * m:].view(t, m)


def pre(residual: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, eps: float,
        rms_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(layer_input [T, H], post [T, M], comb [T, M, M]); see model.mhc.mhc_pre. One launch up to
    SINGLE_LAUNCH_MAX_TOKENS tokens, two above."""
    t, m, h = residual.shape
    _check_streams(m)
    if t <= SINGLE_LAUNCH_MAX_TOKENS:
        _, x, post2, comb2, _ = _launch(residual, fn, base, scale, iters, eps, rms_eps, finish=2)
        return x, post2, comb2
    scratch, _, post2, comb2, _ = _launch(residual, fn, base, scale, iters, eps, rms_eps, finish=1)
    return _streams_sum(residual, _weights(scratch, t, m)), post2, comb2


def post(out: torch.Tensor, residual: torch.Tensor, post_w: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New residual [T, M, H]; see model.mhc.mhc_post."""
    t, m, h = residual.shape
    _check_streams(m)
    new = torch.empty(t, m, h, dtype=residual.dtype, device=residual.device)
    block_t = 1 if t < 64 else 4
    block_h = max(64, min(1024, 4096 // (m * block_t)))
    grid = (_cdiv(t, block_t), _cdiv(h, block_h))
    r = residual  # fn, partials and coefficient outputs unused
    _mix_kernel[grid](residual, *residual.stride(), out, out.stride(0), out.stride(1), _f32(post_w), _f32(comb), new,
                      r, r, r, r, r, r, r, r, t, h, 0, 1.0, 0.0, 0.0, block_h, 1, 1,
                      M=m, NPAD=16, BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_S=1, BLOCK_HO=16, H_LOOP=16, SUB_T=1,
                      FUSE_POST=True, PROJECT=False, FINISH=0, DOT_PRECISION=_DOT_PRECISION, X_BF16=False,
                      BF16_DOT=False, WIDE=_needs_int64(residual, out))
    return new


def post_pre(out: torch.Tensor, residual: torch.Tensor, post_w: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor,
             base: torch.Tensor, scale: torch.Tensor, iters: int, eps: float, rms_eps: float
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(new residual, next layer_input, next post, next comb); see model.mhc.mhc_post_pre.
    One launch up to FUSE_MAX_TOKENS tokens; above, post then pre (faster there)."""
    t, m, h = residual.shape
    _check_streams(m)
    if t > min(FUSE_MAX_TOKENS, SINGLE_LAUNCH_MAX_TOKENS):
        new = post(out, residual, post_w, comb)
        return (new, *pre(new, fn, base, scale, iters, eps, rms_eps))
    _, x, post2, comb2, new = _launch(residual, fn, base, scale, iters, eps, rms_eps, finish=2,
                                      post_inputs=(out, post_w, comb))
    return new, x, post2, comb2


def head(residual: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float,
         rms_eps: float) -> torch.Tensor:
    """[T, H]; see model.mhc.mhc_head. The [T, M] coefficient math is a few tiny torch ops."""
    t, m, h = residual.shape
    _check_streams(m)
    scratch, *_ = _launch(residual, fn, base, scale, 1, eps, rms_eps, finish=0)
    npad = max(16, _pow2(fn.shape[0]))
    splits = (scratch.numel() - t * m) // (t * (npad + 1))
    part = scratch[:splits * t * npad].view(splits, t, npad)
    sq = scratch[splits * t * npad:splits * t * (npad + 1)].view(splits, t)
    rstd = torch.rsqrt(sq.sum(0) / (m * h) + rms_eps)
    mix = part.sum(0)[:, :m] * rstd[:, None]
    pre_w = torch.sigmoid(mix * scale.float()[0] + base.float()) + eps
    return _streams_sum(residual, pre_w)
