"""Triton kernels of mHC (model/mhc.py holds the torch reference and the public functions).

Three kernels, all per token and memory-bound:
- `_mix_kernel` reads [BLOCK_T, BLOCK_H] tiles of each residual stream (or makes them: with
  FUSE_POST it computes the previous sublayer's post mixing and stores the new residual) and
  accumulates the projection x @ fn^T ([T, (2+M)M], a GEMM with N = 24, one dot per stream)
  and sum(x^2) over its slice of H. The H axis is split over the grid (split-K) so small T
  still fills the GPU; the splits land in fp32 partial buffers [S, T, NPAD] and [S, T].
  Without projection (FUSE_POST only) it is the plain post kernel.
- `_coeff_kernel` sums the splits, scales by rsqrt(mean(x^2) + rms_eps) and computes pre,
  post and the Sinkhorn-normalized comb per token in registers ([BLOCK_T, M, M]).
- `_streams_sum_kernel` writes sum_i w_i x_i ([T, H]) for the layer input and the head.

Loop bounds are constexpr (H_PER_SPLIT, S): the interpreter cannot iterate over a runtime
bound with numpy 2, and powers of two keep the number of compiled variants small. The loop
over streams is a real loop, not unrolled: unrolled, the compiler hoists every stream's
loads and the projection kernel spills (ptxas for sm_90: 255 registers + stack; now ~120-170).

The projection uses `tl.dot(..., input_precision="tf32x3")`: fp32-accurate (the reference
is an fp32 matmul) at tensor-core speed. M must be a power of two (tl.arange); residual
tensors may have any strides (the first-layer broadcast is a stride-0 view).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DOT_PRECISION = "tf32x3"


@triton.jit
def _mix_kernel(res_ptr, s_rt, s_rm, s_rh,
                out_ptr, s_ot, s_oh, post_ptr, comb_ptr, new_ptr,
                fn_ptr, part_ptr, sq_ptr,
                T, H, N, H_PER_SPLIT: tl.constexpr,
                M: tl.constexpr, NPAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                FUSE_POST: tl.constexpr, PROJECT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    offs_t = offs_t.to(tl.int64)  # T * M * H may pass 2^31
    if PROJECT:
        offs_n = tl.arange(0, NPAD)
        acc = tl.zeros((BLOCK_T, NPAD), dtype=tl.float32)
        sq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    # H_PER_SPLIT is a multiple of BLOCK_H: blocks never straddle two splits.
    for step in range(0, H_PER_SPLIT, BLOCK_H):
        offs_h = pid_s * H_PER_SPLIT + step + tl.arange(0, BLOCK_H)
        h_mask = offs_h < H
        mask2 = t_mask[:, None] & h_mask[None, :]
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
                acc += tl.dot(x, w, input_precision=DOT_PRECISION)
    if PROJECT:
        tl.store(part_ptr + (pid_s * T + offs_t[:, None]) * NPAD + offs_n[None, :], acc, mask=t_mask[:, None])
        tl.store(sq_ptr + pid_s * T + offs_t, sq, mask=t_mask)


@triton.jit
def _coeff_kernel(part_ptr, sq_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr,
                  T, inv_k, eps, rms_eps, S: tl.constexpr,
                  M: tl.constexpr, NPAD: tl.constexpr, ITERS: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_S: tl.constexpr):
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_m = tl.arange(0, M)
    offs_mm = tl.arange(0, M * M)  # i * M + j
    offs_s = tl.arange(0, BLOCK_S)
    t_mask = offs_t < T
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
        acc_pre += tl.sum(tl.load(row + offs_m[None, None, :], mask=mask3, other=0.0), axis=1)
        acc_post += tl.sum(tl.load(row + M + offs_m[None, None, :], mask=mask3, other=0.0), axis=1)
        acc_comb += tl.sum(tl.load(row + 2 * M + offs_mm[None, None, :], mask=mask3, other=0.0), axis=1)
        sq += tl.sum(tl.load(sq_ptr + s_idx[None, :] * T + offs_t[:, None], mask=mask2 & s_ok[None, :], other=0.0),
                     axis=1)
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
    tl.store(pre_ptr + t2 * M + offs_m[None, :], pre, mask=mask2)
    tl.store(post_ptr + t2 * M + offs_m[None, :], post, mask=mask2)
    tl.store(comb_ptr + offs_t[:, None, None] * (M * M) + ij[None, :, :], c, mask=t_mask[:, None, None])


@triton.jit
def _streams_sum_kernel(res_ptr, s_rt, s_rm, s_rh, w_ptr, out_ptr, T, H,
                        M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    t_mask = offs_t < T
    offs_t = offs_t.to(tl.int64)
    mask2 = t_mask[:, None] & (offs_h[None, :] < H)
    y = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for i in tl.static_range(M):
        w_i = tl.load(w_ptr + offs_t * M + i, mask=t_mask, other=0.0)  # [BLOCK_T] fp32
        x_i = tl.load(res_ptr + offs_t[:, None] * s_rt + i * s_rm + offs_h[None, :] * s_rh, mask=mask2, other=0.0)
        y += w_i[:, None] * x_i.to(tl.float32)
    tl.store(out_ptr + offs_t[:, None] * H + offs_h[None, :], y.to(out_ptr.dtype.element_ty), mask=mask2)


# ---- launchers --------------------------------------------------------------------------------

def _check_streams(m: int) -> None:
    if m & (m - 1):
        raise ValueError(f"the Triton mHC kernels need a power-of-two number of streams, got M={m}; "
                         f"use backend='torch'")


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter


def _mix_config(t: int, m: int, h: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_H, H_PER_SPLIT): enough programs to fill the GPU, few splits at large T.

    BLOCK_T = 64 lets the dot use Hopper's warpgroup MMA (M >= 64); with BLOCK_H = 32 it stays
    under ~170 registers without spills (checked with ptxas for sm_90); decode sizes use 16.
    """
    block_t, block_h = (16, 64) if t <= 16 else (64, 32)
    num_t = triton.cdiv(t, block_t)
    max_splits = triton.cdiv(h, block_h)
    splits = min(max_splits, 64, triton.next_power_of_2(triton.cdiv(2 * _num_sms(device), num_t)))
    h_per_split = block_h * triton.cdiv(max_splits, splits)
    return block_t, block_h, h_per_split


def _project(residual: torch.Tensor, fn: torch.Tensor, *, post_inputs: tuple | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Partials ([S, T, NPAD], [S, T]) of x @ fn^T and sum(x^2); with post_inputs = (out, post,
    comb) x is the post-mixed residual, also returned."""
    t, m, h = residual.shape
    n = fn.shape[0]
    npad = max(16, triton.next_power_of_2(n))
    block_t, block_h, h_per_split = _mix_config(t, m, h, residual.device)
    splits = triton.cdiv(h, h_per_split)
    fn = fn.float().contiguous()
    part = torch.empty(splits, t, npad, dtype=torch.float32, device=residual.device)
    sq = torch.empty(splits, t, dtype=torch.float32, device=residual.device)
    new = None
    if post_inputs is not None:
        out, post, comb = post_inputs
        post, comb = post.float().contiguous(), comb.float().contiguous()
        new = torch.empty(t, m, h, dtype=residual.dtype, device=residual.device)
        out_args = (out, out.stride(0), out.stride(1), post, comb, new)
    else:
        out_args = (residual, 0, 0, residual, residual, residual)  # unused
    grid = (triton.cdiv(t, block_t), splits)
    _mix_kernel[grid](residual, *residual.stride(), *out_args, fn, part, sq, t, h, n, h_per_split,
                      M=m, NPAD=npad, BLOCK_T=block_t, BLOCK_H=block_h, FUSE_POST=post_inputs is not None,
                      PROJECT=True, DOT_PRECISION=_DOT_PRECISION, num_warps=4, num_stages=2)
    return part, sq, new


def _coefficients(part: torch.Tensor, sq: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, m: int, h: int,
                  iters: int, eps: float, rms_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    splits, t, npad = part.shape
    pre = torch.empty(t, m, dtype=torch.float32, device=part.device)
    post = torch.empty_like(pre)
    comb = torch.empty(t, m, m, dtype=torch.float32, device=part.device)
    block_t = min(32, triton.next_power_of_2(t))
    block_s = min(16, triton.next_power_of_2(splits))
    _coeff_kernel[(triton.cdiv(t, block_t),)](part, sq, base.float().contiguous(), scale.float().contiguous(),
                                              pre, post, comb, t, 1.0 / (m * h), eps, rms_eps, splits,
                                              M=m, NPAD=npad, ITERS=iters, BLOCK_T=block_t, BLOCK_S=block_s)
    return pre, post, comb


def _streams_sum(residual: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    t, m, h = residual.shape
    out = torch.empty(t, h, dtype=residual.dtype, device=residual.device)
    block_t = 1 if t < 64 else 4
    block_h = max(64, min(1024, 4096 // (m * block_t)))
    grid = (triton.cdiv(t, block_t), triton.cdiv(h, block_h))
    _streams_sum_kernel[grid](residual, *residual.stride(), weights.float().contiguous(), out, t, h,
                              M=m, BLOCK_T=block_t, BLOCK_H=block_h)
    return out


def pre(residual: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, eps: float,
        rms_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(layer_input [T, H], post [T, M], comb [T, M, M]); see model.mhc.mhc_pre."""
    t, m, h = residual.shape
    _check_streams(m)
    part, sq, _ = _project(residual, fn)
    pre_w, post, comb = _coefficients(part, sq, base, scale, m, h, iters, eps, rms_eps)
    return _streams_sum(residual, pre_w), post, comb


def post(out: torch.Tensor, residual: torch.Tensor, post_w: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New residual [T, M, H]; see model.mhc.mhc_post."""
    t, m, h = residual.shape
    _check_streams(m)
    new = torch.empty(t, m, h, dtype=residual.dtype, device=residual.device)
    block_t = 1 if t < 64 else 4
    block_h = max(64, min(1024, 4096 // (m * block_t)))
    grid = (triton.cdiv(t, block_t), triton.cdiv(h, block_h))
    _mix_kernel[grid](residual, *residual.stride(), out, out.stride(0), out.stride(1),
                      post_w.float().contiguous(), comb.float().contiguous(), new,
                      residual, residual, residual, t, h, 0, block_h,  # fn/partials unused
                      M=m, NPAD=16, BLOCK_T=block_t, BLOCK_H=block_h, FUSE_POST=True, PROJECT=False,
                      DOT_PRECISION=_DOT_PRECISION)
    return new


def post_pre(out: torch.Tensor, residual: torch.Tensor, post_w: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor,
             base: torch.Tensor, scale: torch.Tensor, iters: int, eps: float, rms_eps: float
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(new residual, next layer_input, next post, next comb); see model.mhc.mhc_post_pre."""
    t, m, h = residual.shape
    _check_streams(m)
    part, sq, new = _project(residual, fn, post_inputs=(out, post_w, comb))
    pre_w, post2, comb2 = _coefficients(part, sq, base, scale, m, h, iters, eps, rms_eps)
    return new, _streams_sum(new, pre_w), post2, comb2


def head(residual: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float,
         rms_eps: float) -> torch.Tensor:
    """[T, H]; see model.mhc.mhc_head. The [T, M] coefficient math is a few tiny torch ops."""
    t, m, h = residual.shape
    _check_streams(m)
    part, sq, _ = _project(residual, fn)
    rstd = torch.rsqrt(sq.sum(0) / (m * h) + rms_eps)
    mix = part.sum(0)[:, :m] * rstd[:, None]
    pre_w = torch.sigmoid(mix * scale.float()[0] + base.float()) + eps
    return _streams_sum(residual, pre_w)
