"""The NVSHMEM EP backend without NVSHMEM: the peer-pointer kernels on ordinary tensors, and
the whole backend on real gloo ranks with a fake `nvshmem.core` (symmetric tensors are shared
files mapped by every rank, so kernels really write into the other processes' memory), all
under TRITON_INTERPRET=1 on CPU. Every result is compared with the `all_to_all` dispatcher on
the same inputs (and the MoE layer with the EP = 1 layer). Values are small multiples of 1/4,
so every fp32 sum is exact whatever the order: the comparisons are equality.

The GPU counterpart (several NVSHMEM processes on one GPU under MPS) is tests/gpu_nvshmem_mpg.py,
started by bench/run_nvshmem_mpg.sh.
"""

from __future__ import annotations

import os
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 (set by conftest on CPU)")

# ---------------------------------------------------------------------------- a fake nvshmem.core

FAKE_CORE = '''
"""Fake nvshmem.core for tests: one shared file per (allocation, rank); peers map each other's."""
import os, uuid
import numpy as np
_state = {}
calls = []

class _UID:
    def __init__(self, data):
        self._data = data

def get_unique_id(empty=False):
    data = np.zeros(16, dtype=np.uint8)
    if not empty:
        data[:] = np.frombuffer(uuid.uuid4().bytes, dtype=np.uint8)
    return _UID(data)

def init(uid=None, rank=None, nranks=None, initializer_method=None, device=None):
    assert initializer_method == "uid" and 0 <= rank < nranks, (initializer_method, rank, nranks)
    if _state:
        raise RuntimeError("nvshmem already initialized")
    _state.update(uid=bytes(uid._data.view(np.uint8)).hex(), rank=rank, nranks=nranks, allocs=0, live={})
    calls.append(("init", rank, nranks, _state["uid"]))

def finalize():
    if not _state:
        raise RuntimeError("finalize without init")
    calls.append(("finalize",))
    _state.clear()
'''

FAKE_TORCH = '''
import os, torch
from nvshmem import core

def _path(i, pe):
    return f"/dev/shm/fakenvs-{core._state['uid']}-{i}-{pe}"

def _map(path, nbytes, dtype, shape):
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8).view(dtype).view(shape)

def tensor(shape, dtype):
    st = core._state
    if not st:
        raise RuntimeError("nvshmem not initialized")
    i = st["allocs"]; st["allocs"] += 1
    nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    path = _path(i, st["rank"])
    with open(path, "wb") as f:
        f.truncate(nbytes)
    t = _map(path, nbytes, dtype, shape)
    st["live"][t.data_ptr()] = (i, path, nbytes)
    core.calls.append(("tensor", tuple(shape), str(dtype)))
    return t

def get_peer_tensor(t, pe):
    i, _, nbytes = core._state["live"][t.data_ptr()]
    path = _path(i, pe)
    assert os.path.getsize(path) == nbytes, "peer allocation of another size"
    return _map(path, nbytes, t.dtype, t.shape)

def free_tensor(t):
    i, path, _ = core._state["live"].pop(t.data_ptr())
    core.calls.append(("free", i))
    os.remove(path)
'''


@pytest.fixture(scope="module")
def fake_dir(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("fake_nvshmem")
    (root / "nvshmem" / "core" / "interop").mkdir(parents=True)
    (root / "nvshmem" / "__init__.py").write_text("")
    (root / "nvshmem" / "core" / "__init__.py").write_text(textwrap.dedent(FAKE_CORE))
    (root / "nvshmem" / "core" / "interop" / "__init__.py").write_text("")
    (root / "nvshmem" / "core" / "interop" / "torch.py").write_text(textwrap.dedent(FAKE_TORCH))
    return str(root)


# ---------------------------------------------------------------------------- kernels, one process

def _channels(world: int, region_bytes: int, max_iters: int = 1000) -> list:
    """`world` simulated ranks' channels over ordinary tensors of this process."""
    from parallel.ep.nvshmem_kernels import PeerChannel

    regions = [torch.zeros(region_bytes, dtype=torch.uint8) for _ in range(world)]
    arrive = [torch.zeros(world, dtype=torch.int64) for _ in range(world)]
    free = [torch.zeros(world, dtype=torch.int64) for _ in range(world)]
    table = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64)  # noqa: E731
    return [PeerChannel(rank=r, size=world, region=regions[r], region_ptrs=table(regions), arrive=arrive[r],
                        arrive_ptrs=table(arrive), free=free[r], free_ptrs=table(free),
                        epoch=torch.zeros(1, dtype=torch.int64), err=torch.zeros(1, dtype=torch.int64),
                        max_iters=max_iters) for r in range(world)]


def test_channel_rows_land_in_the_peers_regions_over_two_epochs():
    world, row = 3, 16
    chans = _channels(world, 8 * row)
    for epoch in (1, 2):
        sent = []
        for s, ch in enumerate(chans):  # rank s sends rows (value 100*epoch + 10*s + d) to d at row s*2 + j
            rows = torch.tensor([[100 * epoch + 10 * s + d] * (row // 4) for d in range(world) for _ in range(2)],
                                dtype=torch.int32).view(torch.uint8)
            dest_rank = torch.arange(world).repeat_interleave(2)
            dest_row = s * 2 + torch.arange(2).repeat(world)
            dest_row[1] = -1  # skipped: row s*2 + 1 of rank 0 keeps what it had
            ch.begin()
            ch.put(rows, torch.arange(2 * world), dest_rank, dest_row, row, cols=(4, row))
            ch.post()
            sent.append(rows)
        for d, ch in enumerate(chans):
            got = ch.receive(2 * world, row).view(torch.int32)
            assert int(ch.err) == 0
            for s in range(world):
                for j in range(2):
                    want = 100 * epoch + 10 * s + d
                    if d == 0 and j == 1:
                        want = 0  # never written (the region started zeroed)
                    assert got[s * 2 + j, 1:].tolist() == [want] * 3, (epoch, d, s, j, got)
                    assert int(got[s * 2 + j, 0]) == 0  # column 0 was not sent
        assert [c.arrive.tolist() for c in chans] == [[epoch] * world] * world


def test_a_rank_that_never_posts_times_out_with_its_rank_in_the_error_word():
    from parallel.ep.nvshmem_kernels import describe_error

    chans = _channels(3, 64, max_iters=50)
    for s in (0, 1):  # rank 2 never sends
        chans[s].begin()
        chans[s].post()
    chans[0].receive(1, 16)
    assert describe_error(int(chans[0].err)) == "rank 2 never delivered its rows within the bounded wait"
    chans[0].begin()  # later waits return at once once the error word is set
    assert describe_error(int(chans[0].err)).startswith("rank 2 ")
    chans[1].receive(1, 16)
    assert "rank 2" in describe_error(int(chans[1].err))


def test_put_rows_rejects_partial_words():
    from parallel.ep.nvshmem_kernels import put_rows

    with pytest.raises(ValueError, match="B % 4 == 0"):
        put_rows(torch.zeros(2, 6, dtype=torch.uint8), torch.arange(2), torch.zeros(2), torch.zeros(2),
                 torch.zeros(1, dtype=torch.int64), 8)


# ---------------------------------------------------------------------------- ranks with a fake nvshmem

H, K = 8, 2


def _inputs(seed: int, world: int, num_experts: int, max_tokens: int) -> list[dict]:
    """Every rank's tokens from one seed: uneven counts (rank 1 none, the last rank full), -1
    slots, a token routed nowhere, expert 1 never chosen, values multiples of 1/4."""
    g = torch.Generator().manual_seed(seed)
    allowed = [e for e in range(num_experts) if e != 1]
    out = []
    for r in range(world):
        t = 0 if r == 1 else (max_tokens if r == world - 1 else int(torch.randint(1, max_tokens, (1,), generator=g)))
        ids = torch.stack([torch.tensor(allowed)[torch.randperm(len(allowed), generator=g)[:K]] for _ in range(t)]) \
            if t else torch.zeros(0, K, dtype=torch.int64)
        ids[torch.rand(t, K, generator=g) < 0.25] = -1
        if t > 2:
            ids[2] = -1
        w = torch.randint(0, 4, (t, K), generator=g).float() / 4 * (ids >= 0)
        x = torch.randint(-8, 8, (t, H), generator=g).float() / 4
        out.append({"x": x, "ids": ids, "w": w})
    return out


def _expert_fn(slab: torch.Tensor) -> torch.Tensor:
    """A stand-in for the experts: exact in fp32 on quarter values."""
    e = torch.arange(slab.shape[0], dtype=slab.dtype, device=slab.device)[:, None, None]
    return slab * 2 + e


def _slab_cases(group, rank: int, world: int, device: str = "cpu") -> dict:
    from dataclasses import replace

    from parallel.ep import NvshmemConfig, make_dispatcher
    from parallel.ep.nvshmem import NvshmemBuffer, NvshmemTransport

    e_total, tm = 2 * world, 6
    out = {}
    cfg = NvshmemConfig(max_tokens=tm, hidden=H, top_k=K, num_experts=e_total, dtype=torch.float32)
    with NvshmemBuffer(group, cfg, device=device) as buf:
        for seed in (0, 1):
            mine = _inputs(seed, world, e_total, tm)[rank]  # the reference runs on CPU tensors
            x, ids, w = (mine[k].to(device) for k in ("x", "ids", "w"))
            ref = make_dispatcher(group, e_total, H, backend="all_to_all", layout="slab", capacity=world * tm)
            want = ref.dispatch(mine["x"], mine["ids"], mine["w"])
            for cap in (world * tm, None):
                # None: the exact largest count, so the fullest expert fills its slab
                if cap is None:
                    tot = torch.tensor(want.counts_list)
                    torch.distributed.all_reduce(tot, op=torch.distributed.ReduceOp.MAX, group=group)
                    cap = max(1, int(tot.max()))
                    ref = make_dispatcher(group, e_total, H, backend="all_to_all", layout="slab", capacity=cap)
                    want = ref.dispatch(mine["x"], mine["ids"], mine["w"])
                tr = NvshmemTransport(buf, replace(cfg, capacity=cap))  # one buffer, several capacities
                assert tr.capacity == cap and tr.config.capacity == cap
                got = tr.dispatch_slab(x, ids, w)
                same = [torch.equal(got.x.cpu(), want.x), torch.equal(got.counts.cpu(), want.counts),
                        torch.equal(got.topk_weights.cpu(), want.topk_weights),
                        torch.equal(got.expert_ids.cpu(), want.expert_ids)]
                y = _expert_fn(got.x)
                same.append(torch.equal(tr.combine_slab(y, got.handle).cpu(),
                                        ref.combine(_expert_fn(want.x), want.handle)))
                tr.check()
                out[(seed, cap)] = same
                if cap < world * tm:
                    out[("full", seed)] = int(got.counts.max()) == cap
        # int64 ids past int32 range are no expert: narrowed as they were (the ids travel as
        # int32), 2**32 + 1 and -2**32 + 3 became experts 1 and 3 where their tokens were sent
        ids = torch.tensor([[0, 2**32 + 1], [e_total - 1, -1], [2, -2**32 + 3]], dtype=torch.int64)
        w = torch.tensor([[0.5, 0.25], [1.0, 0.0], [0.75, 0.25]])
        x = torch.arange(3 * H, dtype=torch.float32).view(3, H) / 4 - rank
        tr = NvshmemTransport(buf)
        got = tr.dispatch_slab(x.to(device), ids.to(device), w.to(device))
        y = tr.combine_slab(_expert_fn(got.x), got.handle).cpu()
        tr.check()
        want = torch.zeros(3, H)
        el = e_total // world
        for t in range(3):
            for k in range(K):
                g = int(ids[t, k])
                if 0 <= g < e_total:  # _expert_fn: 2 * x + the expert's local index
                    want[t] += float(w[t, k]) * (2 * x[t] + g % el)
        out["wide_ids"] = torch.equal(y, want)
        # bad input: more tokens than the buffer holds, before anything is written
        try:
            NvshmemTransport(buf).dispatch(torch.zeros(tm + 1, H, device=device), torch.zeros(tm + 1, K,
                                           dtype=torch.int64, device=device), torch.zeros(tm + 1, K, device=device))
            out["too_many"] = "no error"
        except ValueError as e:
            out["too_many"] = str(e)
    return out


def _format_cases(group, rank: int, world: int, device: str = "cpu") -> list[bool]:
    """A bf16 buffer carrying fp8 x with two fp32 scales a row, top-k = every expert, a token
    choosing one expert twice, -1 ids, T = 0 on some ranks and T changing between calls (the
    rows a call leaves in the regions must not reach the next one): dispatch_slab + combine_slab
    and dispatch + combine against a plain loop over this rank's tokens."""
    from parallel.ep.nvshmem import NvshmemConfig, NvshmemTransport

    e_total, tm = 2 * world, 5
    el, first = 2, 2 * rank
    out = []
    tr = NvshmemTransport.create(group, NvshmemConfig(max_tokens=tm, hidden=H, top_k=e_total, num_experts=e_total,
                                                      dtype=torch.bfloat16, scale_width=2), device=device)
    with tr.buffer:
        for call, counts in enumerate(([tm, 0, 3, tm], [tm, 2, 0, 4])):
            t = counts[rank % 4]
            g = torch.Generator().manual_seed(100 * call + rank)
            if call == 0:  # most tokens on every rank
                ids = torch.randint(-1, e_total, (t, e_total), generator=g)
                if t:
                    ids[0, :2] = 1  # expert 1 twice
                    ids[-1] = torch.randperm(e_total, generator=g)  # every expert
            else:  # each token on one rank (one of its experts twice), token 2 on none: the other
                ids = torch.full((t, e_total), -1)  # ranks' rows of the first call stay behind
                for i in range(t):
                    owner = (i + rank) % world
                    ids[i, :3] = torch.tensor([2 * owner + 1, 2 * owner, 2 * owner + 1])
                ids[2:3] = -1
            w = torch.randint(0, 4, (t, e_total), generator=g).float() / 4
            x = (torch.randint(-8, 8, (t, H), generator=g).float() / 4).to(torch.float8_e4m3fn)
            scale = torch.randint(1, 4, (t, 2), generator=g).float()
            want = torch.zeros(t, H)  # experts: y = 2 * x * scale[0] + the local expert index
            for i in range(t):
                for k in range(e_total):
                    if ids[i, k] >= 0:
                        want[i] += float(w[i, k]) * (2 * x[i].float() * scale[i, 0] + int(ids[i, k]) % el)
            xd, idd, wd, sd = (v.to(device) for v in (x, ids, w, scale))
            d = tr.dispatch_slab(xd, idd, wd, sd)
            e = torch.arange(el, device=device)[:, None, None]
            y = tr.combine_slab(2 * d.x.float() * d.x_scale[..., :1] + e, d.handle)
            out.append(y.dtype == torch.float32 and torch.equal(y.cpu(), want))
            b = tr.dispatch(xd, idd, wd, sd)
            part = torch.zeros(b.x.shape[0], H)
            bx, bs, bids, bw = (v.cpu() for v in (b.x, b.x_scale, b.topk_ids, b.topk_weights))
            for n in range(bx.shape[0]):
                for k in range(e_total):
                    if first <= bids[n, k] < first + el:
                        part[n] += float(bw[n, k]) * (2 * bx[n].float() * bs[n, 0] + int(bids[n, k]) % el)
            out.append(torch.equal(tr.combine(part.to(device), b).cpu(), want))
        tr.check()
    return out


def _dispatcher_cases(group, rank: int, world: int, device: str = "cpu") -> dict:
    """backend="nvshmem" against "all_to_all": layout, combine, gradients, async handles."""
    from parallel.ep import NvshmemConfig, make_dispatcher

    e_total, out = 2 * world, {}
    normal = NvshmemConfig(mode="normal", max_iters=1 << 21, min_region_bytes=4096)
    for seed in (2, 3):
        mine = _inputs(seed, world, e_total, 5)[rank]
        res = {}
        for backend in ("all_to_all", "nvshmem"):
            dev = device if backend == "nvshmem" else "cpu"  # the reference runs on CPU tensors
            d = make_dispatcher(group, e_total, H, backend=backend, align=2,
                                backend_config=normal if backend == "nvshmem" else None)
            # fresh leaves per backend: `.to("cpu")` returns the same tensor, so without the
            # clone the first backend's requires_grad_ would make the second one's copy a non-leaf
            # (its .grad then stays None)
            x = mine["x"].detach().clone().to(dev).requires_grad_(True)
            w = mine["w"].detach().clone().to(dev).requires_grad_(True)
            r = d.dispatch(x, mine["ids"].to(dev), w, async_op=True).wait()
            y = d.combine(r.x * 2 + 1, r.handle)
            (y * torch.arange(H, device=dev)).sum().backward()
            res[backend] = [None if v is None else v.detach().cpu()
                            for v in (r.x, r.counts, r.offsets, r.topk_weights, r.expert_ids, y, x.grad, w.grad)]
            if backend == "nvshmem":
                for b in (d.backend, d._worker_backend):
                    if b is not None:
                        # the config reached the backend (and its worker copy) and its buffers
                        assert b.config is normal and (b.buffer is None or b.buffer.max_iters == normal.max_iters)
                        b.destroy()
        out[seed] = [(a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                     for a, b in zip(res["all_to_all"], res["nvshmem"])]
    return out


def _moe_layer_case(group, rank: int, world: int, device: str = "cpu") -> float:
    """MoELayer's device path on the low-latency transport vs the EP = 1 layer."""
    import moe.layer
    from moe import MoEConfig, MoELayer
    from parallel.ep.nvshmem import NvshmemBuffer, NvshmemConfig, NvshmemTransport

    torch.manual_seed(0)
    cfg = MoEConfig(hidden=H, inter=16, num_experts=2 * world, top_k=K, num_shared=0, dtype=torch.float32)
    full = MoELayer(cfg, device=device)
    sizes = [3, 0, 5, 1][:world]
    x_all = torch.randn(sum(sizes), H, device=device)
    first = sum(sizes[:rank])
    mine = x_all[first:first + sizes[rank]]
    with torch.no_grad(), NvshmemBuffer(group, NvshmemConfig(max_tokens=6, hidden=H, top_k=K, num_experts=2 * world,
                                                             dtype=torch.float32), device=device) as buf:
        want = full(x_all)[first:first + sizes[rank]]
        if "nvshmem" in moe.layer.TRANSPORTS:
            layer = MoELayer(cfg, group, path="device", transport="nvshmem", max_tokens=6, device=device)
        else:  # the layer does not list it yet: give its device path this transport
            layer = MoELayer(cfg, group, path="device", max_tokens=6, device=device)
            layer._device_transport = NvshmemTransport(buf)
        state = full.state_dict()
        layer.load_state_dict({k: v for k, v in state.items() if not k.startswith("experts.")}, strict=False)
        idx = torch.tensor(layer.experts.local_experts)
        layer.experts.load_state_dict({k: (v[idx] if v is not None and v.dim() and v.shape[0] == cfg.num_experts
                                           else v) for k, v in full.experts.state_dict().items()})
        got = layer(mine)
        buf.check()
        layer.close()  # its own buffer (transport="nvshmem"), if it made one
    return float((got - want).abs().max()) if sizes[rank] else 0.0


def _error_cases(group, rank: int, world: int, device: str = "cpu") -> dict:
    import warnings
    from dataclasses import replace

    from parallel.ep.nvshmem import NvshmemBuffer, NvshmemTransport

    out = {}
    with warnings.catch_warnings(record=True) as caught:  # the deprecated keyword form still works
        warnings.simplefilter("always")
        try:  # rank 1 asks for other sizes: every rank raises at init
            NvshmemBuffer(group, max_tokens=4 + (rank == 1), hidden=H, top_k=K, num_experts=2 * world, device=device)
            out["sizes"] = "no error"
        except ValueError as e:
            out["sizes"] = str(e)
        buf = NvshmemBuffer(group, max_tokens=4, hidden=H, top_k=K, num_experts=2 * world, dtype=torch.float32,
                            device=device, max_iters=20000 if device == "cpu" else 1 << 20)
        out["legacy_transport_capacity"] = NvshmemTransport(buf, capacity=3).capacity
    out["warned"] = sorted(str(c.message).split("(")[0] for c in caught if c.category is DeprecationWarning)
    try:  # a transport's config must describe its buffer
        NvshmemTransport(buf, replace(buf.config, hidden=H + 1))
        out["mismatch"] = "no error"
    except ValueError as e:
        out["mismatch"] = str(e)
    if device != "cpu":
        torch.cuda.synchronize()
    torch.distributed.barrier(group=group)  # the ranks that do arrive start together
    tr = NvshmemTransport(buf)
    x, ids, w = torch.ones(2, H, device=device), torch.zeros(2, K, dtype=torch.int64, device=device), \
        torch.ones(2, K, device=device)
    if rank != world - 1:  # the last rank never arrives
        tr.dispatch(x, ids, w)
        try:
            buf.check()
            out["missing"] = "no error"
        except RuntimeError as e:
            out["missing"] = str(e)
        try:
            tr.dispatch(x, ids, w)
            out["refused"] = "no error"
        except RuntimeError as e:
            out["refused"] = str(e)
    torch.distributed.barrier(group=group)
    buf.destroy()
    try:
        tr.dispatch(x, ids, w)
    except ValueError as e:
        out["destroyed"] = str(e)
    return out


def _graph_case(group, rank: int, world: int, device: str) -> list[bool]:
    """dispatch_slab + experts + combine_slab captured in one CUDA graph; replays on new inputs
    equal the eager calls."""
    from parallel.ep.nvshmem import NvshmemConfig, NvshmemTransport

    e_total, tm = 2 * world, 6
    results = []
    tr = NvshmemTransport.create(group, NvshmemConfig(max_tokens=tm, hidden=H, top_k=K, num_experts=e_total,
                                                      dtype=torch.float32), device=device)
    with tr.buffer:
        t = 4  # a static token count on every rank
        inputs = []
        for seed in (5, 6, 7):
            g = torch.Generator().manual_seed(seed * 10 + rank)
            ids = torch.stack([torch.randperm(e_total, generator=g)[:K] for _ in range(t)])
            ids[0, 1] = -1
            inputs.append((torch.randint(-8, 8, (t, H), generator=g).float().div(4).to(device), ids.to(device),
                           torch.randint(0, 4, (t, K), generator=g).float().div(4).to(device)))
        eager = []
        for x, ids, w in inputs:
            d = tr.dispatch_slab(x, ids, w)
            eager.append(tr.combine_slab(_expert_fn(d.x), d.handle))
        sx, sids, sw = (v.clone() for v in inputs[0])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up (Triton compiles, caches fill) off the capture
            d = tr.dispatch_slab(sx, sids, sw)
            tr.combine_slab(_expert_fn(d.x), d.handle)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        torch.distributed.barrier(group=group)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            d = tr.dispatch_slab(sx, sids, sw)
            out = tr.combine_slab(_expert_fn(d.x), d.handle)
        torch.distributed.barrier(group=group)
        for (x, ids, w), want in zip(inputs, eager):
            sx.copy_(x), sids.copy_(ids), sw.copy_(w)
            graph.replay()
            results.append(torch.equal(out, want))
        torch.cuda.synchronize()
        tr.check()
        torch.distributed.barrier(group=group)
        del graph
    return results


def _rank(rank: int, world: int, fake_dir: str | None, device: str = "cpu") -> dict:
    if fake_dir is not None:
        sys.path.insert(0, fake_dir)
    if device != "cpu":
        torch.cuda.set_device(0)  # every rank on the one GPU (NVSHMEM "multiple processes per GPU")
    from parallel import ParallelConfig, destroy_parallel, init_parallel
    from parallel.ep.nvshmem import NvshmemBuffer, NvshmemConfig

    groups = init_parallel(ParallelConfig(world_size=world))
    keeper = None
    try:
        pg = groups.ep.group  # the raw ProcessGroup (gloo: NCCL refuses two ranks on one GPU)
        if device != "cpu":  # keep NVSHMEM initialized throughout (no finalize + re-init between cases)
            keeper = NvshmemBuffer(pg, NvshmemConfig(max_tokens=1, hidden=4, top_k=1, num_experts=world), device=device)
        cases = {"slab": _slab_cases, "formats": _format_cases, "dispatcher": _dispatcher_cases,
                 "moe": _moe_layer_case, "errors": _error_cases}
        if device != "cpu":
            cases["graph"] = _graph_case
        out = {}
        for name, case in cases.items():  # one case failing still reports the others
            try:
                out[name] = case(pg, rank, world, device)
            except Exception:
                import traceback

                out[name] = {"exception": traceback.format_exc()[-3000:]}
        if fake_dir is not None:
            import nvshmem.core

            out["calls"] = [c[0] for c in nvshmem.core.calls]
        return out
    finally:
        if keeper is not None:
            torch.distributed.barrier(group=groups.ep.group)
            keeper.destroy()
        destroy_parallel()


@pytest.mark.parametrize("world", [2, 4])
def test_nvshmem_backend_on_gloo_ranks_with_a_fake_nvshmem(world, fake_dir):
    from launch.local import launch_local

    results = launch_local(_rank, world, args=(world, fake_dir), timeout=400, env={"TRITON_INTERPRET": "1"})
    _check_results(results, world)
    for r in results:  # one NVSHMEM init per buffer lifetime, finalized once every buffer is destroyed
        assert r["calls"].count("init") == r["calls"].count("finalize") >= 1, r["calls"]
        assert r["calls"].count("tensor") == r["calls"].count("free"), r["calls"]


MPG = os.environ.get("MEGAPAR_NVSHMEM_MPG") == "1"


@pytest.mark.gpu
@pytest.mark.skipif(not MPG, reason="needs several NVSHMEM processes on one GPU under MPS: bench/run_nvshmem_mpg.sh")
@pytest.mark.parametrize("world", [2, 4])
def test_nvshmem_backend_several_ranks_on_one_gpu(world):
    """The same cases with real nvshmem4py, every rank on cuda:0, plus a CUDA graph of
    dispatch + experts + combine replayed on new inputs."""
    from launch.local import launch_local

    results = launch_local(_rank, world, args=(world, None, "cuda"), timeout=500,
                           env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(100 // world)})
    _check_results(results, world)
    for rank, r in enumerate(results):
        assert r["graph"] == [True] * 3, (rank, r["graph"])


def _check_results(results: list[dict], world: int) -> None:
    for rank, r in enumerate(results):
        failed = {k: v["exception"] for k, v in r.items() if isinstance(v, dict) and "exception" in v}
        assert not failed, f"rank {rank}: " + "\n".join(f"{k}: {v}" for k, v in failed.items())
        for key, same in r["slab"].items():
            if not isinstance(key, tuple) or key[0] == "full":
                continue
            assert same == [True] * 5, (rank, key, same)
        assert "tokens exceed the buffer's max_tokens (6)" in r["slab"]["too_many"], r["slab"]["too_many"]
        assert r["slab"]["wide_ids"] is True, (rank, "int64 ids past int32 reached an expert")
        assert r["formats"] == [True] * 4, (rank, r["formats"])
        for seed, same in r["dispatcher"].items():
            assert same == [True] * 8, (rank, seed, same)
        assert r["moe"] < 1e-5, (rank, r["moe"])
        err = r["errors"]
        assert "ranks [1] asked for different buffer sizes" in err["sizes"], err["sizes"]
        assert err["warned"] == ["NvshmemBuffer", "NvshmemTransport"], err["warned"]  # once each per process
        assert err["legacy_transport_capacity"] == 3
        assert "differs from its buffer's in ['hidden']" in err["mismatch"], err["mismatch"]
        if rank != world - 1:
            assert f"rank {world - 1} never delivered its rows" in err["missing"], err["missing"]
            assert "refuses further use" in err["refused"] or "failed earlier" in err["refused"], err["refused"]
        assert "destroyed" in err["destroyed"]
    # with capacity = the largest count, some rank's expert exactly fills its slab, for each seed
    for seed in (0, 1):
        assert any(r["slab"].get(("full", seed)) for r in results), seed


def test_nvshmem_config_validates_its_fields_and_modes():
    from parallel.ep import DispatcherConfig, NvshmemConfig, make_dispatcher

    cfg = NvshmemConfig(max_tokens=4, hidden=8, top_k=2, num_experts=4)
    assert cfg.dtype == torch.bfloat16 and cfg.mode == "low_latency" and cfg.capacity is None
    assert NvshmemConfig(mode="normal").dtype is None
    for kwargs, match in [
            (dict(mode="fast"), "mode='fast' is not known; valid: low_latency, normal"),
            (dict(max_tokens=0, hidden=8, top_k=2, num_experts=4), r"max_tokens \(0\) must be an int >= 1"),
            (dict(max_tokens=4, top_k=2, num_experts=4), r"hidden \(None\) must be an int >= 1"),
            (dict(max_tokens=4, hidden=8, top_k=2, num_experts=4, dtype="bf16"), "dtype must be a torch.dtype"),
            (dict(max_tokens=4, hidden=8, top_k=2, num_experts=4, capacity=0), r"capacity \(0\) must be an int >= 1"),
            (dict(max_tokens=4, hidden=8, top_k=2, num_experts=4, drop_policy="oldest"), "drop_policy='oldest'"),
            (dict(mode="normal", max_iters=0), r"max_iters \(0\) must be an int >= 1"),
            (dict(mode="normal", max_tokens=4, capacity=2), "max_tokens=4, capacity=2 apply to mode='low_latency'")]:
        with pytest.raises(ValueError, match=match):
            NvshmemConfig(**kwargs)
    with pytest.raises(ValueError, match="runs in normal mode"):
        DispatcherConfig(backend="nvshmem", backend_config=cfg)
    with pytest.raises(ValueError, match="backend='auto' takes no backend_config"):
        make_dispatcher(None, 4, 8, backend_config=NvshmemConfig(mode="normal"))
    with pytest.raises(TypeError, match="unknown options"):
        from parallel.ep.nvshmem import NvshmemBuffer

        NvshmemBuffer(None, max_tokens=4, hiden=8)


def test_registered_and_reported_with_the_reason_it_cannot_run():
    from parallel import impl
    from parallel.ep import backends, make_dispatcher

    assert "nvshmem" in backends.TRANSPORT.names
    report = impl.report()["ep.transport"]
    if not impl.importable("nvshmem.core"):
        assert "nvshmem.core" in report["nvshmem"] and "megapar[nvshmem]" in report["nvshmem"]
        with pytest.raises(ValueError, match="megapar\\[nvshmem\\]"):
            make_dispatcher(None, 4, 8, backend="nvshmem")
    assert backends.TRANSPORT.resolve("auto") != "nvshmem"  # never chosen by "auto"
