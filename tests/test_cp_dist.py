"""Context parallelism on real gloo process groups (2 and 4 ranks, fp32, tight tolerances; ring
attention also on 3 ranks, fp32 and bf16):
ring and all-gather attention forward/backward (also on packed variable-length batches), DCP
decode with both combine modes, and the attention module, all against the independent
full-attention reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from launch.local import launch_local
from tests.helpers import reference_attention

ATOL = 2e-6
GRAD_ATOL = 2e-5

# (seq_len, hq, hkv, d, dv, causal, variant, batch)
RING_CASES = [
    (16, 4, 2, 8, 8, True, "ring", None),
    (16, 6, 2, 8, 4, True, "ring", 2),         # GQA ratio 3, dv != d, batched
    (24, 3, 1, 8, 8, True, "ring", None),      # MQA
    (16, 4, 4, 8, 6, False, "ring", None),
    (24, 6, 3, 8, 8, True, "allgather", None),
    (16, 4, 1, 8, 8, False, "allgather", 2),
]

# packed batches: (sequence lengths in units of 2P, hq, hkv, d, dv, causal, variant)
VARLEN_CASES = [
    ((1, 3, 2), 4, 2, 8, 8, True, "ring"),       # the first sequence is exactly 2P tokens
    ((2, 1, 3), 6, 2, 8, 4, False, "ring"),
    ((3, 2, 1), 3, 1, 8, 8, True, "allgather"),  # MQA
    ((1, 2, 1), 6, 3, 8, 6, False, "allgather"),
]

# (interleave, block_size, seq_lens, local q heads, kv heads, comm, cache dtype, atol)
DCP_CASES = [
    (1, 4, [1, 2, 3, 17, 40], 2, 2, "ag_rs", torch.float32, ATOL),
    (1, 4, [1, 2, 3, 17, 40], 2, 2, "a2a", torch.float32, ATOL),
    (2, 4, [1, 5, 33], 1, 1, "ag_rs", torch.float32, ATOL),
    (2, 4, [1, 5, 33], 2, 4, "a2a", torch.float32, ATOL),
    (4, 8, [3, 7, 64], 2, 1, "a2a", torch.float32, ATOL),
    (1, 1, [2, 9], 2, 2, "ag_rs", torch.float32, ATOL),
    (2, 4, [6, 31], 2, 2, "a2a", torch.float8_e4m3fn, 8e-2),
]


def _close(got: torch.Tensor, expect: torch.Tensor, atol: float, msg: str) -> None:
    """assert_close for the ranks (torch.testing imports DTensor in every process: seconds)."""
    got, expect = got.detach().double().cpu(), expect.detach().double().cpu()
    assert got.shape == expect.shape, f"{msg}: shape {tuple(got.shape)} != {tuple(expect.shape)}"
    inf = torch.isinf(expect)
    assert torch.equal(torch.isinf(got), inf) and torch.equal(got[inf], expect[inf]), f"{msg}: inf mismatch"
    err = (got - expect)[~inf].abs().max().item() if (~inf).any() else 0.0
    assert err <= atol, f"{msg}: max abs error {err:.3g} > {atol:g}"


def _shard(x: torch.Tensor, rank: int, size: int, dim: int) -> torch.Tensor:
    from parallel.cp import zigzag_shard

    return zigzag_shard(x, rank, size, dim=dim)


def _check_ring(groups, case, group_arg, seed: int, device: torch.device, tol: float,
                scale: float | None = None) -> None:
    from parallel.cp import ring_attention

    seq, hq, hkv, d, dv, causal, variant, batch = case
    rank, size = groups.pcp.rank, groups.pcp.size
    gen = torch.Generator().manual_seed(seed)
    b = batch or 1
    q, k, v = torch.randn(b, seq, hq, d, generator=gen), torch.randn(b, seq, hkv, d, generator=gen), \
        torch.randn(b, seq, hkv, dv, generator=gen)
    dout = torch.randn(b, seq, hq, dv, generator=gen)
    squeeze = (lambda x: x[0]) if batch is None else (lambda x: x)
    local = [squeeze(_shard(x, rank, size, 1)).to(device).requires_grad_() for x in (q, k, v)]
    out, lse = ring_attention(*local, group_arg, causal=causal, scale=scale, variant=variant, return_lse=True)
    out.backward(squeeze(_shard(dout, rank, size, 1)).to(device))
    for i in range(b):
        ref = [x[i].double().requires_grad_() for x in (q, k, v)]
        ref_out, ref_lse = reference_attention(*ref, causal=causal, scale=scale)
        (ref_out * dout[i].double()).sum().backward()
        bi = (lambda x: x) if batch is None else (lambda x: x[i])
        msg = f"rank {rank}/{size} case {case} batch {i}"
        _close(bi(out), _shard(ref_out, rank, size, 0), ATOL * tol, f"{msg} out")
        _close(bi(lse), _shard(ref_lse, rank, size, 0), ATOL * tol, f"{msg} lse")
        for name, ours, theirs in zip("qkv", local, ref):
            _close(bi(ours.grad), _shard(theirs.grad, rank, size, 0), GRAD_ATOL * tol, f"{msg} d{name}")


def _check_ring_varlen(groups, case, group_arg, seed: int, device: torch.device, tol: float) -> None:
    """Packed batch of three sequences: each rank's rows of the output and of the gradients equal
    per-sequence full attention (no attention across sequences)."""
    from parallel.cp import ring_attention, zigzag_shard_varlen

    units, hq, hkv, d, dv, causal, variant = case
    rank, size = groups.pcp.rank, groups.pcp.size
    lengths = [u * 2 * size for u in units]
    cu = torch.tensor([0] + lengths).cumsum(0)
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = torch.randn(total, hq, d, generator=gen), torch.randn(total, hkv, d, generator=gen), \
        torch.randn(total, hkv, dv, generator=gen)
    dout = torch.randn(total, hq, dv, generator=gen)
    shard = lambda x: zigzag_shard_varlen(x, cu, rank, size)
    local = [shard(x).to(device).requires_grad_() for x in (q, k, v)]
    cu_arg = cu.tolist() if seed % 2 else cu.to(device)
    out, lse = ring_attention(*local, group_arg, causal=causal, variant=variant, return_lse=True, cu_seqlens=cu_arg)
    out.backward(shard(dout).to(device))
    ref = [x.double().requires_grad_() for x in (q, k, v)]
    per_seq = [reference_attention(*(x[a:b] for x in ref), causal=causal) for a, b in zip(cu[:-1], cu[1:])]
    ref_out, ref_lse = (torch.cat([p[i] for p in per_seq]) for i in (0, 1))
    (ref_out * dout.double()).sum().backward()
    msg = f"rank {rank}/{size} varlen case {case}"
    _close(out, shard(ref_out), ATOL * tol, f"{msg} out")
    _close(lse, shard(ref_lse), ATOL * tol, f"{msg} lse")
    for name, ours, theirs in zip("qkv", local, ref):
        _close(ours.grad, shard(theirs.grad), GRAD_ATOL * tol, f"{msg} d{name}")


def _fill_cache(cache, attn_insert, ks, vs, table, split_last: bool) -> None:
    for s in range(len(ks)):
        n = ks[s].shape[0]
        cut = max(n - 1, 0) if split_last else n
        for lo, hi in ((0, cut), (cut, n)):
            if hi > lo:
                attn_insert(cache, ks[s][lo:hi], vs[s][lo:hi], torch.arange(lo, hi, device=table.device),
                            table[s].expand(hi - lo, -1))


def _check_dcp(group, case, seed: int, device: torch.device, tol: float, same_heads: bool = False,
               backend: str = "auto", dims: tuple[int, int] = (8, 6), planned: bool = False) -> None:
    """dcp_decode_attention over `group` (any group of ranks sharding one cache); dims: (D, Dv);
    planned: with this rank's length plan (`plan_dcp_decode`)."""
    from parallel.cp import PagedKVCache, dcp_decode_attention, dcp_kv_insert, plan_dcp_decode

    interleave, block, lens, hl, hkv, comm, cache_dtype, atol = case
    rank, size = group.rank, group.size
    gen = torch.Generator().manual_seed(seed)
    d, dv = dims
    q = torch.randn(len(lens), hl * (1 if same_heads else size), d, generator=gen)
    ks = [torch.randn(n, hkv, d, generator=gen) for n in lens]
    vs = [torch.randn(n, hkv, dv, generator=gen) for n in lens]
    per_block = block * size
    width = max(-(-n // per_block) for n in lens)
    ids = torch.randperm(len(lens) * width + 3, generator=gen)
    table = ids[: len(lens) * width].view(len(lens), width).to(torch.int32)
    cache = PagedKVCache.allocate(len(lens) * width + 3, block, hkv, d, head_dim_v=dv, dtype=cache_dtype,
                                  device=device)
    insert = lambda c, k, v, p, t: dcp_kv_insert(c, k.to(device), v.to(device), p, t, group,
                                                 interleave=interleave)
    _fill_cache(cache, insert, ks, vs, table.to(device), split_last=True)
    mine = slice(0, hl) if same_heads else slice(rank * hl, (rank + 1) * hl)
    q_mine, seq = q[:, mine].contiguous().to(device), torch.tensor(lens, device=device)
    plan = (plan_dcp_decode(q_mine, cache, table.to(device), seq, group, interleave=interleave, backend=backend)
            if planned else None)
    if planned and backend == "triton":     # (several items for the long sequences: the precondition)
        assert int(plan.segments[-1]) > len(lens), plan.segments
    out, lse = dcp_decode_attention(q_mine, cache, table.to(device), seq, group, interleave=interleave, comm=comm,
                                    return_lse=True, same_heads=same_heads, backend=backend, plan=plan)
    for s, n in enumerate(lens):
        ref_out, ref_lse = reference_attention(q[s:s + 1], ks[s], vs[s], causal=False)
        msg = f"rank {rank}/{size} case {case} seq {s}"
        _close(out[s], ref_out[0, mine], atol * tol, f"{msg} out")
        _close(lse[s], ref_lse[0, mine], atol * tol, f"{msg} lse")


def _check_module(groups, seed: int, device: torch.device, tol: float) -> None:
    from parallel.cp import ContextParallelAttention, PagedKVCache

    scale = 0.6                                    # not the default 8^-0.5: it must reach prefill and decode
    attn = ContextParallelAttention(groups, scale=scale, interleave=2, dcp_comm="a2a")
    rank, size = groups.pcp.rank, groups.pcp.size
    gen = torch.Generator().manual_seed(seed)
    seq = 4 * size
    q, k, v = torch.randn(seq, 4, 8, generator=gen), torch.randn(seq, 2, 8, generator=gen), \
        torch.randn(seq, 2, 8, generator=gen)
    out = attn(*(attn.shard(x).to(device) for x in (q, k, v)))
    ref_out, _ = reference_attention(q, k, v, causal=True, scale=scale)
    _close(attn.unshard(out), ref_out, ATOL * tol, f"rank {rank} module prefill")
    assert torch.equal(attn.positions(seq), _shard(torch.arange(seq), rank, size, 0))
    # packed batch of three sequences (global offsets, the same on every rank): no attention across them
    lengths = [2 * size, 6 * size, 4 * size]
    cu = [0, lengths[0], lengths[0] + lengths[1], sum(lengths)]
    mine = torch.cat([torch.arange(a + r * (b - a) // (2 * size), a + (r + 1) * (b - a) // (2 * size))
                      for a, b in zip(cu[:-1], cu[1:]) for r in (rank, 2 * size - 1 - rank)])
    qp, kp, vp = torch.randn(cu[-1], 4, 8, generator=gen), torch.randn(cu[-1], 2, 8, generator=gen), \
        torch.randn(cu[-1], 2, 6, generator=gen)
    assert torch.equal(attn.shard(qp, cu_seqlens=cu), qp[mine]), f"rank {rank} module varlen shard"
    assert torch.equal(attn.positions(cu_seqlens=torch.tensor(cu)), mine - torch.tensor(cu[:-1]).repeat_interleave(
        torch.tensor(lengths))[mine]), f"rank {rank} module varlen positions"
    for causal, variant in ((True, "ring"), (False, "allgather")):
        packed = ContextParallelAttention(groups, ring_variant=variant)
        out = packed(*(packed.shard(x, cu_seqlens=cu).to(device) for x in (qp, kp, vp)), causal=causal,
                     cu_seqlens=torch.tensor(cu))
        ref_out = torch.cat([reference_attention(qp[a:b], kp[a:b], vp[a:b], causal=causal)[0]
                             for a, b in zip(cu[:-1], cu[1:])])
        _close(out, ref_out[mine], ATOL * tol, f"rank {rank} module varlen {variant} causal={causal}")
        _close(packed.unshard(out, cu_seqlens=cu), ref_out, ATOL * tol, f"rank {rank} module varlen unshard")
    # decode: with pcp > 1 the module shards the cache over pcp x dcp ranks (vLLM); PCP peers share heads
    cache = PagedKVCache.allocate(8, 2, 2, 8, dtype=torch.float32, device=device)
    table = torch.tensor([[5, 1, 6, 7]], dtype=torch.int32, device=device)
    attn.insert_kv(cache, k.to(device), v.to(device), torch.arange(seq, device=device), table[0])
    qd = torch.randn(1, 4, 8, generator=gen)
    got = attn.decode(qd.to(device), cache, table, torch.tensor([seq], device=device))
    _close(got, reference_attention(qd, k, v, causal=False, scale=scale)[0], ATOL * tol, f"rank {rank} module decode")


def _cp_rank(rank: int, world: int) -> str:
    torch.set_num_threads(1)
    from parallel import ParallelConfig, init_parallel
    from parallel.cp import ring_attention

    groups = init_parallel(ParallelConfig(world_size=world, pcp=world))
    if groups.backend == "nccl":   # fused fp32 kernels on the GPU: looser than exact math
        device, tol = torch.device("cuda", torch.cuda.current_device()), 50.0
    else:
        device, tol = torch.device("cpu"), 1.0
    group_args = [groups.pcp, dist.group.WORLD, None]
    for i, case in enumerate(RING_CASES):
        if case[0] % (2 * world) == 0:   # odd cases: a softmax scale other than the default (forward and backward)
            _check_ring(groups, case, group_args[i % 3], i, device, tol, scale=0.6 if i % 2 else None)
    for i, case in enumerate(VARLEN_CASES):
        _check_ring_varlen(groups, case, group_args[i % 3], 50 + i, device, tol)
    for i, case in enumerate(DCP_CASES):
        _check_dcp(groups.pcp, case, 100 + i, device, tol)   # the function takes any group of ranks
        if case[3] % case[4] == 0:   # every rank holds the same query heads
            _check_dcp(groups.pcp, case, 200 + i, device, tol, same_heads=True)
    _check_module(groups, 7, device, tol)
    try:
        ring_attention(torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8), groups.pcp)
    except ValueError as e:
        assert "must be even" in str(e) and f"2*P = {2 * world}" in str(e), e
    else:
        raise AssertionError("odd local length was accepted")
    x = torch.randn(2 * world, 2, 8)
    try:   # cu_seqlens must describe the full packed batch, not this rank's shard
        ring_attention(x, x, x, groups.pcp, cu_seqlens=[0, 2, 2 * world])
    except ValueError as e:
        assert "full packed batch" in str(e), e
    else:
        raise AssertionError("local cu_seqlens were accepted")
    _check_disagreement(groups, rank, world)
    _check_scale_agreement(groups, rank, world, device, tol)
    return "ok"


def _raises_on_every_rank(fn, needle: str) -> None:
    try:
        fn()
    except ValueError as e:
        assert needle in str(e), e
    else:
        raise AssertionError(f"no error (expected one naming {needle!r})")


def _check_disagreement(groups, rank: int, world: int) -> None:
    """Ranks that disagree, or one rank with bad input: ValueError on every rank, no result."""
    from parallel.cp import ring_attention

    t = 2 * world
    heads = (4, 8) if rank == 0 else (8, 4)  # same element count, different head layout
    x = torch.randn(t, *heads)
    _raises_on_every_rank(lambda: ring_attention(x, x, x, groups.pcp), "q heads: [4, " + ", ".join(["8"] * (world - 1)))
    x = torch.randn(t, 2, 8)
    cu = [0, 2 * world, t * world] if rank == 0 else [0, 4 * world, t * world]  # two valid packings
    for variant in ("ring", "allgather"):
        _raises_on_every_rank(lambda: ring_attention(x, x, x, groups.pcp, cu_seqlens=cu, variant=variant),
                              "cu_seqlens checksum")
    w = x.double() if rank == 0 else x  # same shapes, another dtype: the KV blocks would not line up
    names = "dtype: ['torch.float64', " + ", ".join(["'torch.float32'"] * (world - 1))
    for variant in ("ring", "allgather"):
        _raises_on_every_rank(lambda: ring_attention(w, w, w, groups.pcp, variant=variant), names)
    backend = "cudnn" if rank == 0 else "auto"  # a backend only rank 0 cannot run: no rank may enter the ring
    _raises_on_every_rank(lambda: ring_attention(x, x, x, groups.pcp, backend=backend),
                          "unknown implementation 'cudnn'" if rank == 0 else "rank(s) [0]")
    odd = torch.randn(3, 2, 8)  # rank 0's input is bad: the others must not wait for it
    y = odd if rank == 0 else torch.randn(4, 2, 8)
    _raises_on_every_rank(lambda: ring_attention(y, y, y, groups.pcp), "must be even" if rank == 0 else "rank(s) [0]")
    empty = torch.randn(0, 2, 8)
    _raises_on_every_rank(lambda: ring_attention(empty, empty, empty, groups.pcp), "T = 0")
    flat = torch.randn(t, 2, 0 if rank == 0 else 8)  # 1/sqrt(D) undefined on rank 0 only: not a ZeroDivisionError there
    for variant in ("ring", "allgather"):
        _raises_on_every_rank(lambda: ring_attention(flat, flat, flat, groups.pcp, variant=variant),
                              "head dim D = 0" if rank == 0 else "rank(s) [0]")
    scale = float("nan") if rank == 0 else None  # only rank 0's is bad (it computed NaN, the others went on)
    for variant in ("ring", "allgather"):
        _raises_on_every_rank(lambda: ring_attention(x, x, x, groups.pcp, scale=scale, variant=variant),
                              "scale must be a finite number" if rank == 0 else "rank(s) [0]")
    g = x.clone().requires_grad_(rank == 0)  # the backward is collective: the others would wait in it forever
    for variant in ("ring", "allgather"):
        _raises_on_every_rank(lambda: ring_attention(g, g, g, groups.pcp, variant=variant),
                              "grad (1: q, 2: k or v): [3, " + ", ".join(["0"] * (world - 1)))
    with torch.no_grad():  # no graph anywhere: agreed
        assert ring_attention(g, g, g, groups.pcp).shape == g.shape
    f8 = x.to(torch.float8_e4m3fn)  # every rank agrees, but no path computes in fp8: refused before any KV moves
    for variant in ("ring", "allgather"):
        _raises_on_every_rank(lambda: ring_attention(f8, f8, f8, groups.pcp, variant=variant), "float8_e4m3fn")
    z = torch.randn(t, 2, 8)  # still in step afterwards
    out = ring_attention(z, z, z, groups.pcp, causal=False, variant="allgather")
    assert out.shape == z.shape


def _check_scale_agreement(groups, rank: int, world: int, device: torch.device, tol: float) -> None:
    """The softmax scale is part of the ranks' agreement: different scales (even one float32 rounding
    apart) are a ValueError on every rank naming each rank's value (each rank computed with its own
    and the merge was silently wrong); a trainable scale on one rank fails every rank; the same
    non-default scale given as another type on each rank agrees and matches the reference."""
    import numpy as np

    from parallel.cp import ring_attention

    x = torch.randn(2 * world, 2, 8, device=device)
    others = ", ".join(["0.25"] * (world - 1))
    nearly = torch.tensor(0.6) if rank == 0 else 0.6      # float32 0.6 is 0.6000000238418579, not 0.6
    trainable = torch.nn.Parameter(torch.tensor(0.6)) if rank == 0 else 0.6
    for variant in ("ring", "allgather"):
        call = lambda scale, variant=variant: ring_attention(x, x, x, groups.pcp, scale=scale, variant=variant)
        _raises_on_every_rank(lambda: call(0.5 if rank == 0 else 0.25), f"scale: [0.5, {others}]")
        _raises_on_every_rank(lambda: call(nearly), "scale: [0.6000000238418579, 0.6")
        _raises_on_every_rank(lambda: call(trainable), "requires grad" if rank == 0 else "rank(s) [0]")
    forms = (0.6, np.float64(0.6), torch.tensor(0.6, dtype=torch.float64), torch.tensor(0.6, dtype=torch.float64))
    seq = 4 * world
    gen = torch.Generator().manual_seed(11)
    q, k, v, dout = (torch.randn(seq, 4, 8, generator=gen), torch.randn(seq, 2, 8, generator=gen),
                     torch.randn(seq, 2, 8, generator=gen), torch.randn(seq, 4, 8, generator=gen))
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference_attention(*ref, causal=True, scale=0.6)
    (ref_out * dout.double()).sum().backward()
    for variant in ("ring", "allgather"):
        local = [_shard(t, rank, world, 0).to(device).requires_grad_() for t in (q, k, v)]
        out, lse = ring_attention(*local, groups.pcp, scale=forms[rank], variant=variant, return_lse=True)
        out.backward(_shard(dout, rank, world, 0).to(device))
        msg = f"rank {rank}/{world} scale 0.6 as {type(forms[rank]).__name__} {variant}"
        _close(out, _shard(ref_out, rank, world, 0), ATOL * tol, f"{msg} out")
        _close(lse, _shard(ref_lse, rank, world, 0), ATOL * tol, f"{msg} lse")
        for name, ours, theirs in zip("qkv", local, ref):
            _close(ours.grad, _shard(theirs.grad, rank, world, 0), GRAD_ATOL * tol, f"{msg} d{name}")


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_attention_on_gloo_ranks(world):
    assert launch_local(_cp_rank, world, args=(world,), timeout=120) == ["ok"] * world


@pytest.mark.gpu
@pytest.mark.multigpu
def test_context_parallel_attention_on_nccl_ranks():
    world = min(torch.cuda.device_count(), 4)
    assert launch_local(_cp_rank, world, args=(world,), backend="nccl", timeout=300) == ["ok"] * world


# (interleave, block_size, seq_lens, local q heads, kv heads, comm, cache dtype, atol): long enough for several
# splits of the kernel's 16-key tiles on each rank, an empty sequence among them
SPLIT_DCP_CASES = [
    (1, 16, [150, 40, 0, 97], 2, 2, "ag_rs", torch.float32, ATOL),
    (2, 16, [150, 40, 0, 97], 2, 2, "a2a", torch.float32, ATOL),
    (1, 16, [211, 3, 64], 2, 1, "ag_rs", torch.float8_e4m3fn, 8e-2),
]


def _dcp_split_rank(rank: int, world: int) -> str:
    """DCP decode through the split-KV kernel (the interpreter) with several splits a rank: ag_rs
    takes them unmerged and merges and rescales them in one kernel (`rescale_parts_to_merged`), a2a
    merges them first; both against exact attention over the whole sequence."""
    torch.set_num_threads(1)
    from parallel import ParallelConfig, init_parallel
    from parallel.cp import triton_decode
    from parallel.cp.dcp import DCPLayout, PagedKVCache
    from parallel.cp.paged import paged_decode_attention

    for key in ("min_split", "min_split_fp8", "block_n", "block_n_fp8"):
        triton_decode.CONFIG[key] = 16
    groups = init_parallel(ParallelConfig(world_size=world, pcp=world))
    cache = PagedKVCache.allocate(4, 16, 2, 32, head_dim_v=16, dtype=torch.float32)   # (the splits: a precondition)
    parts = paged_decode_attention(torch.randn(1, 4, 32), cache, torch.tensor([[0, 1, 2, 3]]),
                                   torch.tensor([64 * world]), layout=DCPLayout(world, rank, 16), backend="triton",
                                   merge=False)
    assert parts.out.shape[0] > 1, parts.out.shape
    for i, case in enumerate(SPLIT_DCP_CASES):
        _check_dcp(groups.pcp, case, 300 + i, torch.device("cpu"), 1.0, backend="triton", dims=(32, 16))
        if case[3] % case[4] == 0:
            _check_dcp(groups.pcp, case, 400 + i, torch.device("cpu"), 1.0, same_heads=True, backend="triton",
                       dims=(32, 16))
    from parallel.cp import dcp as dcp_mod

    dcp_mod.MAX_RESCALE_PARTIALS = 1        # more splits than one kernel merges: merged on the rank first
    _check_dcp(groups.pcp, SPLIT_DCP_CASES[0], 500, torch.device("cpu"), 1.0, backend="triton", dims=(32, 16))
    # length plans (few programs: the long sequences in several items), each combine, same_heads too
    for key in [k for k in triton_decode.CONFIG if k.startswith("target_programs")]:
        triton_decode.CONFIG[key] = 12
    for i, case in enumerate(SPLIT_DCP_CASES):
        _check_dcp(groups.pcp, case, 600 + i, torch.device("cpu"), 1.0, backend="triton", dims=(32, 16), planned=True)
    _check_dcp(groups.pcp, SPLIT_DCP_CASES[0], 700, torch.device("cpu"), 1.0, same_heads=True, backend="triton",
               dims=(32, 16), planned=True)
    return "ok"


@pytest.mark.parametrize("world", [2, 4])
def test_dcp_decode_with_kernel_splits_on_gloo_ranks(world, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert launch_local(_dcp_split_rank, world, args=(world,), timeout=240, env={"TRITON_INTERPRET": "1"}) == \
        ["ok"] * world


def test_ring_attention_without_tokens_raises_naming_t():
    from parallel.cp import ring_attention

    empty = torch.randn(0, 2, 8)
    for causal in (True, False):
        with pytest.raises(ValueError, match=r"T = 0"):
            ring_attention(empty, empty, empty, causal=causal)


def _ring_three_rank(rank: int) -> str:
    """Three real ranks (an odd ring: the dK/dV accumulators come home in the other buffer than at
    P = 2 or 4), each case against plain float64 attention over the whole packed batch: GQA
    (Hq 4, Hkv 1), Dv != D, a custom scale, sequences of different lengths with an empty one,
    fp32 and bf16, return_lse; the backward with only k requiring grad and with all three,
    twice (retain_graph); the forward again under torch.no_grad."""
    torch.set_num_threads(1)
    from parallel import ParallelConfig, init_parallel
    from parallel.cp import ring_attention, zigzag_shard_varlen

    world = 3
    groups = init_parallel(ParallelConfig(world_size=world, pcp=world))
    lengths = [2 * world, 0, 6 * world, 4 * world]
    cu = [0, 6, 6, 24, 36]
    gen = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(cu[-1], h, d, generator=gen, dtype=torch.float64)
                     for h, d in ((4, 8), (1, 8), (1, 6), (4, 6)))
    shard = lambda x: zigzag_shard_varlen(x, cu, rank, world)
    for causal in (True, False):
        ref = [x.clone().requires_grad_() for x in (q, k, v)]
        per_seq = [reference_attention(*(x[a:b] for x in ref), causal=causal, scale=0.3)
                   for a, b, n in zip(cu[:-1], cu[1:], lengths) if n]
        ref_out, ref_lse = (torch.cat([p[i] for p in per_seq]) for i in (0, 1))
        (ref_out * dout).sum().backward()
        for variant, dtype, needs in (("ring", torch.float32, (True, True, True)),
                                      ("ring", torch.bfloat16, (False, True, False)),
                                      ("allgather", torch.float32, (False, True, False)),
                                      ("allgather", torch.bfloat16, (True, True, True))):
            atol, grad_atol = (ATOL, GRAD_ATOL) if dtype == torch.float32 else (3e-2, 5e-2)
            msg = f"rank {rank}/{world} {variant} {dtype} causal={causal} requires_grad={needs}"
            local = [shard(x).to(dtype).requires_grad_(n) for x, n in zip((q, k, v), needs)]
            out, lse = ring_attention(*local, groups.pcp, causal=causal, scale=0.3, variant=variant, return_lse=True,
                                      cu_seqlens=cu)
            _close(out, shard(ref_out), atol, f"{msg} out")
            _close(lse, shard(ref_lse), atol, f"{msg} lse")
            out.backward(shard(dout).to(dtype), retain_graph=True)
            first = [None if x.grad is None else x.grad.clone() for x in local]
            out.backward(shard(dout).to(dtype))
            for name, x, n, g, r in zip("qkv", local, needs, first, ref):
                assert (x.grad is not None) == n, f"{msg}: d{name}"
                if n:
                    _close(g, shard(r.grad), grad_atol, f"{msg} d{name}")
                    _close(x.grad, 2 * g, 0.0, f"{msg} d{name} after a second backward")
            with torch.no_grad():
                again = ring_attention(*local, groups.pcp, causal=causal, scale=0.3, variant=variant,
                                       cu_seqlens=torch.tensor(cu))
            assert not again.requires_grad, msg
            _close(again, out, 0.0, f"{msg} under no_grad")
    return "ok"


def test_ring_attention_on_three_gloo_ranks():
    assert launch_local(_ring_three_rank, 3, timeout=120) == ["ok"] * 3
