"""Paged decode attention with LSE over one rank's shard of a paged KV cache (the DCP local part).

`paged_decode_attention(q, cache, block_table, seq_lens, layout=...)` attends Tq (1, or a few
for speculative decoding, <= 8) query tokens per sequence over the tokens of that sequence held
in this rank's `PagedKVCache` and returns `AttnState(out, lse)` for the DCP merge
(docs/numerics.md §7, §8.2). Two implementations (op "cp.decode" of `parallel.impl`):
- "triton": the split-KV (flash-decoding) kernel of `triton_decode.py`: the KV is read once per
  kv head for all its query heads, long sequences are cut into splits so that a few of them
  still fill the GPU; CUDA tensors (or the interpreter when asked for by name);
- "torch": exact fp32 math over gathered pages (`dcp.gather_local_kv`), the reference.

Causality with Tq > 1: query t of a sequence of global length L (the new tokens included) sits
at position `L - Tq + t` and sees the cached tokens at positions <= its own; local token j of
rank r sits at `(j // I) * (I * N) + r * I + j % I`. With Tq = 1 every cached token is visible.

Checks. Shapes, dtypes and devices always; values (block ids inside the cache, global lengths
>= 0, within the table's capacity and `max_seq_len`) only for CPU tensors or with
`validate=True`, since reading CUDA values synchronizes with the host and breaks CUDA-graph
capture. All raise ValueError before any launch. The kernel reads k and v with a unit-stride
head dim; other caches run the torch path ("auto") or are refused by name ("triton").
Unvalidated (CUDA), the Triton kernel checks the same values itself: a sequence with a used block
id outside the cache, a length past the table's capacity or a negative length gets NaN out and
lse, and nothing outside the table or the cache is read. Only what this rank reads is checked:
a block id is read by the ranks holding a token of its virtual block (rank 0 holds one of every
used virtual block), a length past the table's capacity shows on the ranks holding a token past
it (rank 0 among them); `dcp_decode_attention`'s merges carry that NaN to every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from .. import impl
from .dcp import DCPLayout, PagedKVCache, gather_local_kv
from .local_attn import masked_attention_math, resolve_scale
from .state import AttnState

if TYPE_CHECKING:
    from .triton_decode import LengthPlan

DecodeBackend = Literal["auto", "torch", "triton"]

MAX_QUERY_TOKENS = 8


def _kernel_fits(f: impl.Facts) -> impl.Unusable | None:
    if f.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return impl.Unusable(f"the kernel reads fp32/fp16/bf16 queries, got {f.dtype}")
    if f.cache_dtype is not None and f.cache_dtype not in (torch.float8_e4m3fn, f.dtype):
        # (its MMAs take both operands in one dtype; an fp8 cache is converted to the queries')
        return impl.Unusable(f"the kernel reads a {f.cache_dtype} cache with {f.cache_dtype} queries (or an fp8 "
                             f"cache with any), got {f.dtype} queries")
    if f.head_dim < 16 or f.v_head_dim < 16:
        return impl.Unusable(f"the kernel needs head dims >= 16, got {f.head_dim}/{f.v_head_dim}")
    if f.kv_strides is not None and any(st[-1] != 1 for st in f.kv_strides):
        # (the kernel addresses k and v elements as base + dim: their head dims must be unit-stride)
        return impl.Unusable(f"the kernel reads k/v with a unit-stride head dim, got strides {f.kv_strides}")
    return None


DECODE = impl.Op("cp.decode", [
    impl.Impl("triton", impl.triton_kernel(impl.forward_only, _kernel_fits)),
    impl.Impl("torch"),
])
"""The split-KV Triton kernel, then exact torch math over gathered pages (runs anywhere)."""

BACKENDS = DECODE.names


def check_paged_inputs(q: Tensor, cache: PagedKVCache, block_table: Tensor, seq_lens: Tensor,
                       layout: DCPLayout, *, validate: bool | None = None, max_seq_len: int | None = None) -> None:
    """Validate a paged decode call (q [S, Tq, Hq, D]); values when on CPU or validate=True."""
    if q.dim() != 4:
        raise ValueError(f"q {tuple(q.shape)} must be [S, heads, head_dim] or [S, q_len, heads, head_dim]")
    s, tq, hq, d = q.shape
    if d != cache.k.shape[-1]:
        raise ValueError(f"q head_dim ({d}) != the cache's key head_dim ({cache.k.shape[-1]})")
    if not 1 <= tq <= MAX_QUERY_TOKENS:
        raise ValueError(f"q_len ({tq}) must be in [1, {MAX_QUERY_TOKENS}]")
    if hq % cache.kv_heads != 0:
        valid = [h for h in range(1, hq + 1) if hq % h == 0]
        raise ValueError(f"query heads ({hq}) must be a multiple of the cache's kv heads ({cache.kv_heads}); "
                         f"kv head counts that divide: {valid}")
    if q.device != cache.k.device:
        raise ValueError(f"q on {q.device} but the cache is on {cache.k.device}")
    if cache.k.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn):
        raise ValueError(f"cache dtype {cache.k.dtype} not supported; valid: float32, float16, bfloat16, "
                         f"float8_e4m3fn (with k_scale/v_scale)")
    if cache.is_fp8:
        for name, sc in (("k_scale", cache.k_scale), ("v_scale", cache.v_scale)):
            if sc is None or tuple(sc.shape) != tuple(cache.k.shape[:3]) or sc.dtype != torch.float32:
                got = None if sc is None else (tuple(sc.shape), sc.dtype)
                raise ValueError(f"fp8 cache needs {name} float32 {tuple(cache.k.shape[:3])}, got {got}")
    if block_table.dim() != 2 or block_table.shape[0] != s or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_table {tuple(block_table.shape)} {block_table.dtype} must be int32/int64 "
                         f"[S = {s}, max_blocks]")
    if tuple(seq_lens.shape) != (s,) or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens {tuple(seq_lens.shape)} {seq_lens.dtype} must be int32/int64 [S = {s}]")
    if max_seq_len is not None and int(max_seq_len) < 0:
        raise ValueError(f"max_seq_len ({max_seq_len}) must be >= 0")
    if validate is None:
        validate = block_table.device.type == "cpu" and seq_lens.device.type == "cpu"
    if not validate or s == 0:
        return
    if tq > 1 and bool((seq_lens.cpu() < tq).any()):
        raise ValueError(f"seq_lens {seq_lens.cpu().tolist()[:8]} must be >= q_len ({tq}): they include the "
                         f"new tokens")
    # the GLOBAL lengths first: this rank's share of a negative length can be 0 (rank 0 of 2 for
    # -1), and its share of a length past the table's capacity within it (ranks other than 0)
    glens = seq_lens.cpu().long()
    if bool((glens < 0).any()):
        i = int((glens < 0).nonzero()[0, 0])
        raise ValueError(f"seq_lens must be >= 0; seq_lens[{i}] = {int(glens[i])}")
    lens = layout.local_lengths(glens)
    table = block_table.cpu().long()
    capacity = table.shape[1] * cache.block_size
    if bool((lens > capacity).any()):
        bad = lens[lens > capacity].tolist()
        i = int((lens > capacity).nonzero()[0, 0])
        raise ValueError(f"local lengths {bad[:8]} outside [0, {capacity}] (block_table capacity "
                         f"{table.shape[1]} blocks x {cache.block_size} tokens; seq_lens[{i}] = {int(glens[i])})")
    global_capacity = table.shape[1] * layout.virtual_block
    if bool((glens > global_capacity).any()):
        i = int((glens > global_capacity).nonzero()[0, 0])
        raise ValueError(f"seq_lens[{i}] = {int(glens[i])} exceeds the block table's capacity: {table.shape[1]} "
                         f"blocks x {layout.virtual_block} tokens (block_size {layout.block_size} x {layout.size} "
                         f"ranks) = {global_capacity}")
    if max_seq_len is not None and bool((glens > int(max_seq_len)).any()):
        i = int((glens > int(max_seq_len)).nonzero()[0, 0])
        raise ValueError(f"seq_lens[{i}] = {int(glens[i])} exceeds max_seq_len ({max_seq_len}), the bound the "
                         f"split-KV grid is sized by")
    used = torch.arange(table.shape[1]).unsqueeze(0) < (lens.unsqueeze(1) + cache.block_size - 1) // cache.block_size
    ids = table[used]
    nb = cache.k.shape[0]
    if ids.numel() and (bool((ids < 0).any()) or bool((ids >= nb).any())):
        bad = ids[(ids < 0) | (ids >= nb)].unique().tolist()
        raise ValueError(f"block_table holds block ids {bad[:8]} outside the cache's [0, {nb})")


_RESOLVED = impl.Memo()


def resolve_backend(q: Tensor, cache: PagedKVCache, backend: DecodeBackend = "auto") -> str:
    """The implementation ("triton" | "torch") `paged_decode_attention` runs for q and this cache
    (kept per facts, interpreter switch and registered implementations: `impl.Memo`; a refusal is
    raised again every time)."""
    facts = {"dtype": q.dtype, "cache_dtype": cache.k.dtype, "head_dim": q.shape[-1], "v_head_dim": cache.v.shape[-1],
             "kv_strides": (cache.k.stride(), cache.v.stride())}
    needs_grad = impl.grad_needed(q)
    key = (backend, q.device, needs_grad, *facts.values(), impl.interpreting(), tuple(map(id, DECODE.impls)))
    return _RESOLVED.get(key, lambda: DECODE.resolve(backend, device=q.device, needs_grad=needs_grad, **facts))


def paged_decode_reference(q: Tensor, cache: PagedKVCache, block_table: Tensor, local_lens: Tensor,
                           seq_lens: Tensor, scale: float, layout: DCPLayout) -> AttnState:
    """Exact fp32 torch math over gathered pages: q [S, Tq, Hq, D] -> out [S, Tq, Hq, Dv], lse [S, Tq, Hq]."""
    tq = q.shape[1]
    k, v, valid = gather_local_kv(cache, block_table, local_lens)           # [S, L, Hkv, D], [S, L]
    allowed = valid[:, None, None, :]                                       # [S, 1, 1, L]
    if tq > 1:
        g_pos = layout.global_positions(torch.arange(k.shape[1], device=q.device))      # [L]
        q_pos = seq_lens.long().unsqueeze(1) - tq + torch.arange(tq, device=q.device)   # [S, Tq]
        allowed = allowed & (g_pos[None, None, None, :] <= q_pos[:, None, :, None])      # [S, 1, Tq, L]
    out, lse = masked_attention_math(q.float().transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale,
                                     allowed.unsqueeze(1))                  # mask [S, 1, 1, Tq | 1, L]
    return AttnState(out.transpose(1, 2), lse.transpose(1, 2))


def paged_decode_attention(q: Tensor, cache: PagedKVCache, block_table: Tensor, seq_lens: Tensor, *,
                           layout: DCPLayout | None = None, scale: float | None = None,
                           backend: DecodeBackend = "auto", max_seq_len: int | None = None,
                           validate: bool | None = None, merge: bool = True,
                           out_dtype: torch.dtype = torch.float32, plan: "LengthPlan | None" = None) -> AttnState:
    """Attention of the newest Tq tokens of each sequence over this rank's cached tokens.

    q: [S, Hq, D] (one token per sequence) or [S, Tq, Hq, D] (Tq <= 8); cache: this rank's
    shard (k [nb, B, Hkv, D], v [nb, B, Hkv, Dv], fp8 with scales; v may be the view k[..., :Dv]
    of an MLA latent cache); block_table: [S, max_blocks] int; seq_lens: [S] int GLOBAL lengths
    including the Tq new tokens (already inserted). layout: the DCP layout of the cache (default:
    one rank, `cache.block_size`). scale: default 1/sqrt(D). max_seq_len: an upper bound on the
    global lengths known to the caller (a Python int, no sync), used to size the split-KV grid;
    default the table's capacity. validate: read values (block ids, lengths) even on CUDA
    (synchronizes); default only for CPU tensors.
    Returns AttnState(out [S, (Tq,) Hq, Dv] fp32 (or out_dtype), lse [S, (Tq,) Hq] fp32), lse -inf (out 0)
    where a query sees no token here. merge=False: the split-KV kernel's P partial states as it
    leaves them, out [P, S, (Tq,) Hq, Dv] (float), lse [P, S, (Tq,) Hq], for a caller that merges
    them with other partials anyway (`merge.rescale_parts_to_merged`: DCP's ag_rs combine); P = 1
    for the torch path or a single split. out_dtype: the dtype of the merged out, fp32 or a 16-bit
    one (a caller that casts to it: the kernel's split merge, or a single split, writes it once, where
    a cast after the call would read and write the whole out again); not with merge=False.
    plan: a length plan of `plan_paged_decode` for this call's shapes, table and layout (made once
    a decode step, given to every layer's call): the kernel's splits cut from the lengths instead of
    the table's capacity, for batches of very different lengths; the call's out is the same (the
    torch path only checks it). With it max_seq_len bounds nothing (the plan covers every token), and
    merge=False returns the plan's merged splits as one partial (P = 1).
    """
    if out_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"out_dtype must be torch.float32, torch.float16 or torch.bfloat16, got {out_dtype}")
    if not merge and out_dtype != torch.float32:
        raise ValueError(f"out_dtype ({out_dtype}) applies to the merged out; merge=False returns the kernel's "
                         f"partials as they are")
    layout = DCPLayout(size=1, rank=0, block_size=cache.block_size) if layout is None else layout
    if layout.block_size != cache.block_size:
        raise ValueError(f"layout block_size ({layout.block_size}) != the cache's ({cache.block_size})")
    single = q.dim() == 3
    q4 = q.unsqueeze(1) if single else q
    if seq_lens.dim() != 1:
        raise ValueError(f"seq_lens {tuple(seq_lens.shape)} must be [S]")
    check_paged_inputs(q4, cache, block_table, seq_lens, layout, validate=validate, max_seq_len=max_seq_len)
    scale = resolve_scale(scale, q.shape[-1])           # ValueError unless finite (NaN: every row NaN)
    chosen = resolve_backend(q, cache, backend)
    table = block_table.to(q.device)
    if plan is not None:
        check_plan(plan, q4, cache, table, layout)
    if chosen == "triton":
        from .triton_decode import paged_decode_triton

        capacity = table.shape[1] * cache.block_size
        if max_seq_len is not None:
            capacity = min(capacity, int(layout.local_lengths(int(max_seq_len))))
        # (no torch op besides the kernels: the kernel takes the global lengths as they are and
        # computes this rank's share itself; each extra tiny kernel costs ~2 µs of a decode step)
        state = paged_decode_triton(q4.contiguous() if q4.stride(-1) != 1 else q4, cache.k, cache.v,
                                    cache.k_scale, cache.v_scale, table, seq_lens.to(q.device).contiguous(),
                                    scale, dcp_size=layout.size, dcp_rank=layout.rank,
                                    interleave=layout.interleave, capacity=capacity, merge=merge,
                                    out_dtype=out_dtype, plan=plan)
    else:
        seq = seq_lens.to(q.device)
        state = paged_decode_reference(q4, cache, table, layout.local_lengths(seq.long()), seq, scale, layout)
        if not merge:
            state = AttnState(state.out.unsqueeze(0), state.lse.unsqueeze(0))
        elif out_dtype != torch.float32:
            state = AttnState(state.out.to(out_dtype), state.lse)
    if single:      # (the token axis, after the splits' where they are kept)
        return AttnState(state.out.squeeze(-3), state.lse.squeeze(-2))
    return state


def plan_paged_decode(q: Tensor, cache: PagedKVCache, block_table: Tensor, seq_lens: Tensor, *,
                      layout: DCPLayout | None = None, backend: DecodeBackend = "auto",
                      validate: bool | None = None) -> "LengthPlan":
    """A split-KV plan from the sequences' lengths for `paged_decode_attention(..., plan=)`: every
    sequence's local tokens cut into splits of one length, about as many splits over the batch as
    the kernel's programs fill the GPU with (`triton_decode.LengthPlan`). Without it the kernel
    cuts every sequence into the same number of splits of the table's capacity, so a few long
    sequences among short ones run on a few programs while the rest of the GPU waits; FlashMLA and
    FlashInfer plan from the lengths the same way. One kernel launch, on the device (CUDA-graph
    capturable); make it once a decode step (the lengths change) and give it to every layer's call,
    which must have q's shapes, the cache's page and dtype, this table's width and this layout.
    Arguments as `paged_decode_attention`'s (same checks). On the torch path (CPU) the same tables
    come from torch ops (`plan_reference`), since the call there only checks the plan."""
    layout = DCPLayout(size=1, rank=0, block_size=cache.block_size) if layout is None else layout
    q4 = q.unsqueeze(1) if q.dim() == 3 else q
    check_paged_inputs(q4, cache, block_table, seq_lens, layout, validate=validate)
    from . import triton_decode

    table = block_table.to(q.device)
    rows, key = triton_decode.plan_settings(q4, cache.k, cache.v, cache.k_scale, cache.v_scale, table,
                                            dcp_size=layout.size, dcp_rank=layout.rank, interleave=layout.interleave)
    if resolve_backend(q, cache, backend) == "triton":
        return triton_decode.plan_by_lengths(seq_lens.to(q.device).contiguous(), rows, key)
    return plan_reference(seq_lens.to(q.device), rows, key)


def plan_reference(seq_lens: Tensor, rows: int, key: tuple) -> "LengthPlan":
    """`triton_decode.plan_by_lengths` in torch ops (the specification of its tables): rows r = token
    r % Tq of sequence r // Tq (Tq = the key's expand), its local length n_r (0 where the global one
    is negative or the local share past the table), chunk = (the key's fit) the shortest multiple of
    unit, at least min_chunk, with which sum max(ceil(n_r / chunk), 1) <= items_target (else one item
    a row: the longest row's length up to a multiple of unit), or (else) ceil(sum n_r / items_target)
    up to a multiple of unit, at least min_chunk; row r's items are splits 0 .. max(ceil(n_r / chunk),
    1) - 1 at out rows [segments[r], segments[r + 1]) in row order, the rest split ceil(capacity /
    chunk) of row 0 (empty) at their own out rows; the launch slots (the key's order) in out-row
    order, or every full chunk first in row order, then the rows' last partial items (an empty row's
    one) by class floor(length x PLAN_CLASSES / chunk), highest first, in row order within one.
    With the key's runs > 0 the plan is a token-run plan instead (`gluon_mla_runs.runs_plan`, the
    specification of `triton_decode._runs_plan_kernel`), items = runs + rows segment slots."""
    from .gluon_mla_runs import runs_plan
    from .triton_decode import PLAN_CLASSES, LengthPlan

    kv = dict(key)
    tq, (size, rank, interleave) = kv["expand"], kv["dcp"]
    g = seq_lens.long().repeat_interleave(tq)
    if tq > 1:
        t = torch.arange(rows, device=g.device) % tq
        g = torch.where(g < 0, g, (g - (tq - 1) + t).clamp(min=0))
    cap = kv["table_blocks"] * kv["page"]
    local = DCPLayout(size=size, rank=rank, block_size=kv["page"], interleave=interleave).local_lengths(g.clamp(min=0))
    bad = (g < 0) | (local > cap)
    n = torch.where(bad, torch.zeros_like(local), local)
    if kv.get("runs"):
        table, segments = runs_plan(n, bad, kv["runs"], kv["unit"], kv["runs_overhead"], bool(kv.get("runs_choose")))
        return LengthPlan(table, segments, kv["runs"] + rows, rows, key)
    items_target, unit = kv["items_target"], kv["unit"]
    if kv["fit"]:
        lo = kv["min_chunk"] // unit
        hi = max(-(-int(n.max()) // unit) if rows else 0, lo)
        ks = torch.arange(lo, hi + 1, device=g.device)
        counts = ((n[None, :] + ks[:, None] * unit - 1) // (ks[:, None] * unit)).clamp(min=1).sum(1)   # [K]
        fit = (counts <= items_target).nonzero()
        chunk = int(ks[fit[0, 0]] if fit.numel() else hi) * unit
    else:
        chunk = max(-(-(-(-int(n.sum()) // items_target)) // unit) * unit, kv["min_chunk"])
    count = ((n + chunk - 1) // chunk).clamp(min=1)
    segments = torch.zeros(rows + 1, dtype=torch.long, device=g.device)
    segments[1:] = count.cumsum(0)
    items = items_target + rows
    table = torch.zeros(items, 3, dtype=torch.long, device=g.device)
    used = int(segments[-1])
    table[:used, 0] = torch.arange(rows, device=g.device).repeat_interleave(count)
    table[:used, 1] = torch.arange(used, device=g.device) - segments[:-1].repeat_interleave(count)
    table[used:, 1] = -(-cap // chunk)
    table[:, 2] = torch.arange(items, device=g.device)
    if kv["order"]:     # (a stable sort: full chunks (class PLAN_CLASSES) first, then by class)
        length = (n.repeat_interleave(count) - table[:used, 1] * chunk).clamp(max=chunk)
        cls = torch.where(length == chunk, PLAN_CLASSES, length * PLAN_CLASSES // chunk)
        table[:used] = table[:used][torch.sort(-cls, stable=True).indices]
    head = torch.tensor([chunk, 0], dtype=torch.long, device=g.device)
    return LengthPlan(torch.cat([head, table.flatten()]).to(torch.int32), segments.to(torch.int32), items, rows, key)


def check_plan(plan: "LengthPlan", q: Tensor, cache: PagedKVCache, table: Tensor, layout: DCPLayout) -> None:
    """A plan given to a call (q [S, Tq, Hq, D]) must be a `LengthPlan` made for its shapes, table width,
    cache page and layout, on q's device: ValueError naming both sides otherwise, before any launch."""
    from .triton_decode import LengthPlan, plan_settings

    if not isinstance(plan, LengthPlan):
        raise ValueError(f"plan must be a LengthPlan of plan_paged_decode, got {type(plan).__name__}")
    rows, key = plan_settings(q, cache.k, cache.v, cache.k_scale, cache.v_scale, table, dcp_size=layout.size,
                              dcp_rank=layout.rank, interleave=layout.interleave)
    plan.check(rows, key)
    if plan.items_table.device != q.device:
        raise ValueError(f"the plan's tables are on {plan.items_table.device}, q on {q.device}")
