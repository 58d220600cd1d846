"""Fused MoE routing kernel (Triton): scores, bias, group selection, top-k and weight
normalization in one launch, identical in result to `moe.router.route_torch`.

One program handles BLOCK_T tokens; the whole expert row (E padded to a power of two) sits
in registers. Top-k is K rounds of "max, then the lowest index holding it", which gives the
reference's tie rule (lowest expert index first) for free. Group scores are built one group
at a time into a small [BLOCK_T, BLOCK_G] tile, and groups are picked the same way as
experts. Hash layers gather their K ids from `tid2eid` and read the scores at those ids.

Only imported when used (CUDA, or CPU tensors under TRITON_INTERPRET=1). Ids are int64,
weights fp32; differences from the torch path are last-ulp rounding of exp/log/sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe.router import RouteResult

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
        # which keeps full relative precision for small y
        y = tl.exp(tl.minimum(logit, 20.0))
        u = 1.0 + y
        log1p_y = tl.where(u == 1.0, y, tl.log(u) * (y / (u - 1.0)))
        score = tl.sqrt(tl.where(logit > 20.0, logit, log1p_y))
    score = tl.where(col_ok[None, :], score, 0.0)

    ids_tile = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int64)
    w_tile = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    if HAS_MASK:
        valid = tl.load(mask_ptr + rows, mask=row_ok, other=0) != 0
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
        if N_GROUP > 1:
            GROUP_SIZE: tl.constexpr = E // N_GROUP
            gcols = tl.arange(0, BLOCK_G)
            group_of_col = cols // GROUP_SIZE
            group_score = tl.full([BLOCK_T, BLOCK_G], float("-inf"), tl.float32)
            for g in tl.static_range(N_GROUP):
                in_g = col_ok[None, :] & (group_of_col == g)[None, :]
                v = tl.where(in_g, select, float("-inf"))
                top1 = tl.max(v, axis=1)
                if HAS_BIAS and GROUP_SIZE > 1:
                    # sum of the top-2 values; a repeated maximum counts twice
                    num_top1 = tl.sum(tl.where(in_g & (v == top1[:, None]), 1, 0), axis=1)
                    below = tl.max(tl.where(v < top1[:, None], v, float("-inf")), axis=1)
                    gs = top1 + tl.where(num_top1 >= 2, top1, below)
                else:
                    gs = top1
                group_score = tl.where(gcols[None, :] == g, gs[:, None], group_score)
            group_free = (gcols < N_GROUP)[None, :] & (rows[:, None] >= 0)
            group_kept = (gcols[None, :] < 0) & (rows[:, None] >= 0)  # all False, [BT, BG]
            for _ in tl.static_range(TOPK_GROUP):
                best = tl.max(tl.where(group_free, group_score, float("-inf")), axis=1)
                gi = tl.min(tl.where(group_free & (group_score == best[:, None]), gcols[None, :], BLOCK_G), axis=1)
                hit = gcols[None, :] == gi[:, None]
                group_kept = group_kept | hit
                group_free = group_free & ~hit
            col_kept = (cols[None, :] < 0) & (rows[:, None] >= 0)  # all False, [BT, BE]
            for g in tl.static_range(N_GROUP):
                kept_g = tl.max(tl.where(gcols[None, :] == g, group_kept.to(tl.int32), 0), axis=1)
                col_kept = col_kept | ((group_of_col == g)[None, :] & (kept_g[:, None] > 0))
            avail = avail & col_kept
        for k in tl.static_range(K):
            best = tl.max(tl.where(avail, select, float("-inf")), axis=1)
            eid = tl.min(tl.where(avail & (select == best[:, None]), cols[None, :], BLOCK_E), axis=1)
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


def _launch_config(num_tokens: int, block_e: int, block_t: int | None, num_warps: int | None) -> tuple[int, int]:
    if block_t is None:
        block_t = min(triton.next_power_of_2(max(num_tokens, 1)), max(1, 2048 // block_e))
    if num_warps is None:
        num_warps = 1 if block_t * block_e <= 512 else (2 if block_t * block_e <= 1024 else 4)
    return block_t, num_warps


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
    `moe.router.route`). logits: [T, E] fp32/bf16 (scores are fp32). No autograd."""
    num_tokens, num_experts = logits.shape
    device = logits.device
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    topk_ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=device)
    topk_weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    if num_tokens == 0:
        return RouteResult(topk_ids=topk_ids, topk_weights=topk_weights)
    hashed = tid2eid is not None
    grouped = not hashed and n_group is not None and n_group > 1
    block_e = triton.next_power_of_2(num_experts)
    bt, warps = _launch_config(num_tokens, block_e, block_t, num_warps)
    dummy = topk_weights  # any pointer for the arguments a specialization does not read
    table = tid2eid.contiguous() if hashed else None
    grid = (triton.cdiv(num_tokens, bt),)
    _route_kernel[grid](
        logits,
        bias.float().contiguous() if (bias is not None and not hashed) else dummy,
        input_ids.contiguous() if hashed else dummy,
        table if hashed else dummy,
        token_mask.contiguous().view(torch.uint8) if token_mask is not None else dummy,
        topk_ids, topk_weights,
        num_tokens, logits.stride(0), table.stride(0) if hashed else 0, float(scaling),
        E=num_experts, K=top_k, BLOCK_T=bt, BLOCK_E=block_e, BLOCK_K=max(2, triton.next_power_of_2(top_k)),
        SCORING=_SCORING_CODE[scoring], HAS_BIAS=bias is not None and not hashed,
        N_GROUP=n_group if grouped else 1, TOPK_GROUP=topk_group if grouped else 1,
        BLOCK_G=max(2, triton.next_power_of_2(n_group if grouped else 1)),
        RENORM=renormalize, HASH=hashed, HAS_MASK=token_mask is not None,
        num_warps=warps,
    )
    return RouteResult(topk_ids=topk_ids, topk_weights=topk_weights)
