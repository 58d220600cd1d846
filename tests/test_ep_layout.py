"""EP local permutation: layout plans, the torch data movers, the all-to-all send plan, and
the Triton kernels (under TRITON_INTERPRET=1 here, at full size on a GPU), each against loops."""

from __future__ import annotations

import importlib
import math
import sys

import pytest
import torch

from parallel.ep.backends import AllToAllRoute, Census, _pack_rows, _unpack_rows, routing_info
from parallel.ep.layout import gather_reduce_torch, gather_rows_torch, plan_layout


def _random_local_ids(n: int, k: int, num_local: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, num_local, (n, k), generator=g)
    if n > 1:
        ids[1] = -1
    return ids


def _loop_layout(ids: torch.Tensor, num_local: int, align: int, capacity: int | None):
    """Per expert, the (row, k) pairs in received order; then the layout rows by loops."""
    per_expert = [[] for _ in range(num_local)]
    for r in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[r, k])
            if e >= 0:
                per_expert[e].append((r, k))
    if capacity is not None:
        per_expert = [p[:capacity] for p in per_expert]
        starts = [e * capacity for e in range(num_local)]
        total = num_local * capacity
    else:
        starts, total = [], 0
        for p in per_expert:
            starts.append(total)
            total += math.ceil(len(p) / align) * align
    row_src = [-1] * total
    row_slot = [-1] * total
    pair_pos = [[-1] * ids.shape[1] for _ in range(ids.shape[0])]
    for e, p in enumerate(per_expert):
        for i, (r, k) in enumerate(p):
            row_src[starts[e] + i], row_slot[starts[e] + i] = r, k
            pair_pos[r][k] = starts[e] + i
    return per_expert, starts, row_src, row_slot, pair_pos


@pytest.mark.parametrize("n,k,num_local,layout,align,capacity,drop", [
    (13, 3, 4, "contiguous", 1, None, None),
    (13, 3, 4, "contiguous", 8, None, None),
    (0, 2, 3, "contiguous", 4, None, None),
    (9, 4, 1, "contiguous", 3, None, None),
    (21, 2, 5, "slab", 1, 16, None),
    (21, 4, 5, "slab", 1, 3, "drop"),
])
def test_plan_layout_matches_loops(n, k, num_local, layout, align, capacity, drop):
    ids = _random_local_ids(n, k, num_local, seed=n * 7 + k)
    plan = plan_layout(ids, num_local, layout=layout, align=align, capacity=capacity, drop_policy=drop)
    per_expert, starts, row_src, row_slot, pair_pos = _loop_layout(ids, num_local, align, capacity)
    assert plan.counts.tolist() == [len(p) for p in per_expert]
    assert plan.offsets.tolist() == starts + [len(row_src)]
    assert plan.row_src.tolist() == row_src
    assert plan.row_slot.tolist() == row_slot
    assert plan.pair_pos.tolist() == pair_pos
    assert plan.expert_ids.tolist() == [(-1 if s < 0 else int(ids[s, row_slot[j]])) for j, s in enumerate(row_src)]
    if drop:
        full = _loop_layout(ids, num_local, 1, None)[0]
        assert plan.num_dropped is None  # not counted without host counts
        counted = plan_layout(ids, num_local, layout=layout, capacity=capacity, drop_policy=drop,
                              counts_host=[len(p) for p in full])
        assert counted.num_dropped == sum(max(0, len(p) - capacity) for p in full)



@pytest.mark.parametrize("layout,align,capacity,drop", [
    ("contiguous", 4, None, None), ("slab", 1, 3, "drop"), ("slab", 1, 16, None)])
def test_plan_layout_takes_int32_local_ids(layout, align, capacity, drop):
    """int32 local ids (what arrives over the wire) plan like int64 ones; they used to fail
    inside a scatter with a dtype mismatch that named neither the ids nor their dtype."""
    ids = _random_local_ids(11, 3, 4, seed=5)
    plan = plan_layout(ids.to(torch.int32), 4, layout=layout, align=align, capacity=capacity, drop_policy=drop)
    per_expert, starts, row_src, row_slot, pair_pos = _loop_layout(ids, 4, align, capacity)
    assert plan.counts.tolist() == [len(p) for p in per_expert]
    assert plan.row_src.tolist() == row_src and plan.row_slot.tolist() == row_slot
    assert plan.pair_pos.tolist() == pair_pos
    assert plan.expert_ids.tolist() == [(-1 if s < 0 else int(ids[s, row_slot[j]])) for j, s in enumerate(row_src)]

def test_plan_layout_overflow_and_bad_arguments_raise():
    ids = torch.zeros(5, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"capacity \(4\) is too small.*capacity >= 5"):
        plan_layout(ids, 2, layout="slab", capacity=4)
    with pytest.raises(ValueError, match="applies to layout='slab' only"):
        plan_layout(ids, 2, capacity=4)
    with pytest.raises(ValueError, match="align"):
        plan_layout(ids, 2, align=0)
    with pytest.raises(ValueError, match="valid: None"):
        plan_layout(ids, 2, layout="slab", capacity=4, drop_policy="random")


def test_torch_data_movers_match_loops():
    g = torch.Generator().manual_seed(0)
    src = torch.randn(6, 11, generator=g)
    src[0] = float("inf")  # padding rows must not read row 0
    idx = torch.tensor([5, -1, 2, 2, -1, 3])
    scale = torch.rand(6, generator=g)
    out = gather_rows_torch(src, idx, scale)
    for m, i in enumerate(idx.tolist()):
        assert torch.equal(out[m], src[i] * scale[m] if i >= 0 else torch.zeros(11))
    pos = torch.tensor([[5, 3, -1], [-1, -1, -1], [4, 4, 1]])
    w = torch.rand(3, 3, generator=g)
    red = gather_reduce_torch(src, pos, w)
    for m in range(3):
        want = torch.zeros(11)
        for j in range(3):
            if pos[m, j] >= 0:
                want += w[m, j] * src[pos[m, j]]
        assert torch.allclose(red[m], want)
    assert gather_reduce_torch(src[:0], torch.full((2, 2), -1), None).abs().sum() == 0
    assert gather_rows_torch(src[:0], torch.full((2,), -1)).shape == (2, 11)


def test_pack_rows_round_trips_mixed_dtypes():
    g = torch.Generator().manual_seed(1)
    pieces = [torch.randn(5, 7, generator=g).to(torch.bfloat16),
              torch.randn(5, 3, generator=g).to(torch.float8_e4m3fn),
              torch.randint(-1, 9, (5, 2), generator=g, dtype=torch.int32),
              torch.rand(5, 2, generator=g)]
    packed, specs = _pack_rows(pieces)
    assert packed.dtype == torch.uint8 and packed.shape[1] % 16 == 0
    for got, want in zip(_unpack_rows(packed.clone(), specs), pieces):
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_all_to_all_send_plan_sends_each_token_once_per_rank():
    """Without communication: send rows (destination-major, then token) and the return slots."""
    world, num_experts, k = 3, 6, 4
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(-1, num_experts, (10, k), generator=g)
    ids[0] = torch.tensor([0, 1, 1, -1])  # two slots on rank 0, one expert twice
    info = routing_info(ids, num_experts, world)
    sends = [[t for t in range(10) if any(0 <= e and e // 2 == d for e in ids[t].tolist())] for d in range(world)]
    rows = [[len(s) for s in sends]] + [[0] * world] * (world - 1)
    census = Census(num_tokens=[10] * world, rows=rows, expert_pairs=[0] * num_experts, errors=[0] * world)
    route = AllToAllRoute(info, census, group=None, rank=0, size=world)
    flat = [t for s in sends for t in s]
    assert route.send_token.tolist() == flat and route.send_splits == [len(s) for s in sends]
    for t in range(10):
        seen = set()
        for j, e in enumerate(ids[t].tolist()):
            d = e // 2 if e >= 0 else None
            want = -1
            if d is not None and d not in seen:
                seen.add(d)
                want = sum(len(s) for s in sends[:d]) + sends[d].index(t)
            assert int(route.slot[t, j]) == want, (t, j)


# ---------------------------------------------------------------------------------------------
# Triton kernels.


@pytest.fixture
def triton_permute(monkeypatch):
    """The kernel module in interpreter mode on CPU (decided when the kernels are decorated)."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        sys.modules.pop("parallel.ep.triton_permute", None)
    module = importlib.import_module("parallel.ep.triton_permute")
    yield module
    if not torch.cuda.is_available():
        sys.modules.pop("parallel.ep.triton_permute", None)


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_triton_gather_rows_matches_reference(triton_permute):
    dev = _device()
    g = torch.Generator().manual_seed(3)
    base = torch.randn(7, 1100, generator=g)
    idx = torch.tensor([6, -1, 0, 3, 3, -1, 1, 2])
    scale = torch.rand(8, generator=g)
    for src in (base, base[:, 5:1070], base.to(torch.float8_e4m3fn).view(torch.uint8)[:, :13]):
        src = src.to(dev)
        got = triton_permute.gather_rows(src, idx.to(dev))
        assert torch.equal(got.cpu(), gather_rows_torch(src.cpu(), idx))
    got = triton_permute.gather_rows(base.to(dev), idx.to(dev), scale.to(dev))
    assert torch.allclose(got.cpu(), gather_rows_torch(base, idx, scale), atol=1e-6)
    assert triton_permute.gather_rows(base[:0].to(dev), torch.full((3,), -1, device=dev)).abs().sum() == 0
    # into the columns of a packed uint8 buffer (the all-to-all send path)
    src = base[:, :10].contiguous().view(torch.uint8).to(dev)  # [7, 40]
    packed = torch.full((8, 64), 7, dtype=torch.uint8, device=dev)
    triton_permute.gather_rows(src, idx.to(dev), out=packed[:, 16:56])
    want = torch.full((8, 64), 7, dtype=torch.uint8)
    want[:, 16:56] = gather_rows_torch(src.cpu(), idx)
    assert torch.equal(packed.cpu(), want)


def test_triton_gather_reduce_matches_reference(triton_permute):
    dev = _device()
    g = torch.Generator().manual_seed(4)
    src = torch.randn(9, 1300, generator=g)
    idx = torch.randint(-1, 9, (6, 5), generator=g)
    w = torch.rand(6, 5, generator=g)
    for weights in (w, None):
        got = triton_permute.gather_reduce(src.to(dev), idx.to(dev), None if weights is None else weights.to(dev))
        assert torch.allclose(got.cpu(), gather_reduce_torch(src, idx, weights), atol=1e-5)
    strided = src[:, 7:1207]
    got = triton_permute.gather_reduce(strided.to(dev), idx.to(dev), w.to(dev), torch.float32)
    assert torch.allclose(got.cpu(), gather_reduce_torch(strided, idx, w), atol=1e-5)


@pytest.mark.gpu
def test_triton_kernels_full_size_bf16_on_gpu(triton_permute):
    """T=4096, H=7168, K=8, E=256 on the GPU: bitwise permute, fp32-accumulated unpermute."""
    from parallel.ep import make_dispatcher

    dev = torch.device("cuda")
    t, h, k, e = 4096, 7168, 8, 256
    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
    ids = torch.rand(t, e, device=dev).topk(k, dim=1).indices
    w = torch.softmax(torch.randn(t, k, device=dev), -1)
    d = make_dispatcher(None, e, h, align=128)
    res = d.dispatch(x, ids, w)
    ref_rows = gather_rows_torch(x, res.handle.plan.row_src)
    assert torch.equal(res.x, ref_rows)
    y = res.x * 0.5
    out = d.combine(y, res.handle)
    ref = gather_reduce_torch(y, res.handle.plan.pair_pos, w.float())
    assert torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert torch.allclose(out.float(), (x.float() * 0.5), atol=3e-2, rtol=3e-2)


def test_movers_choose_triton_only_for_cuda_rows_and_honour_the_switch(monkeypatch):
    from parallel import impl
    from parallel.ep.layout import GATHER_REDUCE, GATHER_ROWS

    cuda = torch.device("cuda")
    for op in (GATHER_ROWS, GATHER_REDUCE):
        assert op.resolve(device=torch.device("cpu"), unit_stride=True) == "torch"
        monkeypatch.setenv("MEGAPAR_EP_TRITON", "0")
        assert op.usable(device=cuda, unit_stride=True)["triton"] == "turned off by MEGAPAR_EP_TRITON=0"
        assert op.resolve(device=cuda, unit_stride=True) == "torch"
        monkeypatch.setenv("MEGAPAR_EP_TRITON", "1")
        assert "unit last stride" in op.usable(device=cuda, unit_stride=False)["triton"]
        assert (op.usable(device=cuda, unit_stride=True)["triton"] is None) == impl.triton_importable()
