"""The DeepEP backend against a fake `deep_ep` (the PyPI build needs CUDA >= 13.1 and NCCL >=
2.32.3, newer than the GPU machine). The fake checks the dtypes and shapes of every call and
moves rows with gloo object collectives the way DeepEP's documentation says its buffer does
(received rows by source rank then token, local expert ids, combine = sum of the rows sent
back); `backend="deepep"` must then give what `backend="all_to_all"` gives.

The same per-rank body runs with the real `deep_ep` (DeepEP's pre-V2 source build) and both
ranks on one GPU under MPS in the `gpu` tests below, started by bench/run_deepep_mpg.sh
(MEGAPAR_DEEPEP_MPG=1; MEGAPAR_DEEPEP_LL=1 when the build has NVSHMEM, for low-latency mode)."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest
import torch

FAKE = '''
import torch
import torch.distributed as dist
calls = []
buffers = []  # the arguments of every Buffer made

def _row_check(x):
    """DeepEP's host asserts on the rows it moves (buffer.hpp: intranode_dispatch / _combine)."""
    assert x.dim() == 2 and x.is_contiguous(), "DeepEP asserts x.dim() == 2 and x.is_contiguous()"
    assert (x.shape[1] * x.element_size()) % 16 == 0, f"DeepEP asserts rows of whole int4s, got {tuple(x.shape)} {x.dtype}"

class _Handle:
    def __init__(self, sent, recv_counts, num_tokens):
        self.sent, self.recv_counts, self.num_tokens = sent, recv_counts, num_tokens

class Buffer:
    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=1,
                 explicitly_destroy=False):
        assert isinstance(num_nvl_bytes, int) and isinstance(num_rdma_bytes, int)
        assert explicitly_destroy, "DeepEP's destroy() refuses a buffer made without explicitly_destroy=True"
        self.group, self.ll = group, low_latency_mode
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        calls.append(("Buffer", num_nvl_bytes > 0, num_rdma_bytes > 0, low_latency_mode))
        buffers.append((num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank))

    @staticmethod
    def get_low_latency_rdma_size_hint(max_tokens, hidden, num_ranks, num_experts):
        return max_tokens * hidden * num_ranks * 16

    def _all(self, obj):
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def get_dispatch_layout(self, topk_idx, num_experts):
        assert topk_idx.dtype == torch.int64 and topk_idx.dim() == 2, topk_idx.dtype
        assert topk_idx.is_contiguous(), "DeepEP asserts a contiguous topk_idx"
        per = num_experts // self.size
        # its kernel tests ranges: an id outside [0, num_experts) (not only -1) counts for no expert and no rank
        valid = (topk_idx >= 0) & (topk_idx < num_experts)
        dest = torch.where(valid, topk_idx // per, self.size)
        in_rank = torch.zeros(topk_idx.shape[0], self.size + 1, dtype=torch.bool)
        in_rank.scatter_(1, dest, True)
        in_rank = in_rank[:, :self.size]
        key = torch.where(valid, topk_idx, num_experts).reshape(-1)
        per_expert = torch.bincount(key, minlength=num_experts + 1)[:num_experts].int()
        calls.append(("get_dispatch_layout", tuple(topk_idx.shape), num_experts))
        return in_rank.sum(0).int(), None, per_expert, in_rank, None

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None, **kw):
        if handle is not None:
            assert isinstance(x, torch.Tensor) and x.shape[0] == handle.num_tokens, (x.shape, handle.num_tokens)
            _row_check(x)
            assert topk_idx is None and topk_weights is None, "DeepEP's cached dispatch takes no topk tensors"
            calls.append(("dispatch_cached", tuple(x.shape)))
            everyone = self._all([x[handle.sent[d]] for d in range(self.size)])
            # (the cached mode returns no ids, weights, counts or handle)
            return torch.cat([everyone[s][self.rank] for s in range(self.size)]), None, None, None, None, None
        x, scale = x if isinstance(x, tuple) else (x, None)
        t = x.shape[0]
        _row_check(x)
        assert topk_idx.shape[0] == t and topk_weights.shape == topk_idx.shape and topk_weights.dtype == torch.float32
        assert topk_idx.is_contiguous() and topk_weights.is_contiguous(), "DeepEP asserts contiguous topk tensors"
        assert topk_idx.dtype == torch.int64, "DeepEP reads topk_idx as topk_idx_t (int64)"
        assert topk_idx.shape[1] <= 32, "EP_DEVICE_ASSERT(num_topk <= 32)"
        assert scale is None or x.element_size() == 1, "DeepEP asserts 1-byte x with x_scales"
        assert scale is None or (scale.dtype in (torch.float32, torch.int32) and scale.dim() == 2 and scale.shape[0] == t)
        assert is_token_in_rank.shape == (t, self.size) and num_tokens_per_rank.shape == (self.size,)
        calls.append(("dispatch", tuple(x.shape), str(x.dtype), scale is not None))
        sent = [is_token_in_rank[:, d].nonzero().reshape(-1) for d in range(self.size)]
        per = num_tokens_per_expert.shape[0] // self.size
        xb = x.view(torch.uint8) if x.element_size() == 1 else x  # (fp8 does not pickle: move its bytes)
        everyone = self._all([(xb[i], None if scale is None else scale[i], topk_idx[i], topk_weights[i])
                              for i in sent])
        mine = [everyone[s][self.rank] for s in range(self.size)]
        ids = torch.cat([m[2] for m in mine])
        first = self.rank * per
        local = torch.where((ids >= first) & (ids < first + per), ids - first, torch.full_like(ids, -1))
        recv_x = torch.cat([m[0] for m in mine]).view(x.dtype)
        if scale is not None:
            recv_x = (recv_x, torch.cat([m[1] for m in mine]))
        handle = _Handle(sent, [m[0].shape[0] for m in mine], t)
        recv_w = torch.cat([m[3] for m in mine])
        recv_w = torch.where(local >= 0, recv_w, torch.zeros_like(recv_w))  # as its kernel: 0 off this rank
        # received pairs per local expert (a token naming one expert twice counts twice), as a host list
        per_expert = [int((local == e).sum()) for e in range(per)]
        return recv_x, local, recv_w, per_expert, handle, None

    def combine(self, x, handle, topk_weights=None, **kw):
        """Sums (no weights) the rows sent back; topk_weights [n, num_topk] fp32 are summed the same way."""
        assert x.dtype == torch.bfloat16, x.dtype  # DeepEP combines bf16
        _row_check(x)
        assert x.shape[0] == sum(handle.recv_counts), (x.shape, handle.recv_counts)
        calls.append(("combine", tuple(x.shape), topk_weights is not None))
        sums = []
        for t in [x] + ([] if topk_weights is None else [topk_weights]):
            if t is topk_weights:
                assert t.dtype == torch.float32 and t.dim() == 2 and t.is_contiguous() and t.shape[0] == x.shape[0]
                assert t.shape[1] <= 32  # EP_DEVICE_ASSERT(num_topk <= 32)
            blocks = list(torch.split(t, handle.recv_counts))  # block s: rows from rank s
            everyone = self._all(blocks)
            out = torch.zeros(handle.num_tokens, t.shape[1], dtype=torch.float32)
            for d in range(self.size):
                out.index_add_(0, handle.sent[d], everyone[d][self.rank].float())
            sums.append(out)
        return sums[0].to(torch.bfloat16), (sums[1] if topk_weights is not None else None), None

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=False, **kw):
        assert self.ll and topk_idx.dtype == torch.int64 and x.shape[0] <= num_max_dispatch_tokens_per_rank
        assert x.dtype == torch.bfloat16 and x.shape[1] % 128 == 0, "DeepEP asserts bf16 x, hidden % 128 == 0"
        assert ((topk_idx >= -1) & (topk_idx < num_experts)).all(), "DeepEP would address a rank that is not there"
        assert x.is_contiguous() and topk_idx.is_contiguous(), "DeepEP asserts contiguous x and topk_idx"
        calls.append(("low_latency_dispatch", tuple(x.shape), num_max_dispatch_tokens_per_rank, num_experts))
        el = num_experts // self.size
        recv = torch.zeros(el, self.size * num_max_dispatch_tokens_per_rank, x.shape[1], dtype=x.dtype)
        return recv, torch.zeros(el, dtype=torch.int32), "ll-handle", None, None

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, **kw):
        assert handle == "ll-handle" and x.dim() == 3 and topk_weights.shape == topk_idx.shape
        assert x.dtype == torch.bfloat16 and x.is_contiguous() and topk_idx.dtype == torch.int64
        assert topk_idx.is_contiguous() and topk_weights.is_contiguous() and topk_weights.dtype == torch.float32
        calls.append(("low_latency_combine", tuple(x.shape)))
        return torch.zeros(topk_idx.shape[0], x.shape[2], dtype=x.dtype), None, None

    def destroy(self):
        calls.append(("destroy",))
'''

H, K = 8, 2


@pytest.fixture(scope="module")
def fake_dir(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("fake_deep_ep")
    (root / "deep_ep").mkdir()
    (root / "deep_ep" / "__init__.py").write_text(textwrap.dedent(FAKE))
    return str(root)


LL_HIDDEN = 2048  # the smallest hidden size DeepEP's low-latency kernels are compiled for
FAKE_LL_HIDDEN = 128  # the fake asserts what DeepEP's host code does: bf16 rows, hidden % 128 == 0
NORMAL_HIDDEN = 256


def _inputs(rank: int, world: int, e_total: int, hidden: int = H) -> tuple[torch.Tensor, ...]:
    """Rank `rank`'s x [T, hidden] bf16, ids [T, K] int64 (-1 = none), weights [T, K] fp32 (a
    function of the rank only, so every rank can rebuild the others' inputs)."""
    g = torch.Generator().manual_seed(rank)
    t = [5, 0, 7, 3][rank]
    ids = torch.stack([torch.randperm(e_total, generator=g)[:K] for _ in range(t)]) if t else \
        torch.zeros(0, K, dtype=torch.int64)
    ids[torch.rand(t, K, generator=g) < 0.25] = -1
    w = torch.randint(0, 4, (t, K), generator=g).float() / 4
    x = (torch.randint(-8, 8, (t, hidden), generator=g).float() / 4).to(torch.bfloat16)
    return x, ids, w


def _normal_case(pg, rank: int, world: int, e_total: int, device: str) -> dict:
    """backend "deepep" (on `device`) against "all_to_all" (on the CPU): rows, counts, offsets,
    row weights, expert ids, combine output and the gradients of x and of the router weights
    (also alone); the combine output and the weight gradients also against a plain loop.
    x and the weights are non-contiguous views (DeepEP asserts contiguous tensors; the
    dispatcher takes any strides)."""
    from parallel.ep import DeepEPConfig, make_dispatcher

    # the real DeepEP's SM90 intranode dispatch traps unless a row is a multiple of 32 bytes (its
    # TMA copies move half rows of int4s): 256 bf16 values, with the fake too (the backend checks)
    hidden = NORMAL_HIDDEN
    x, ids, w = _inputs(rank, world, e_total, hidden)
    if ids.shape[0]:
        ids[0, 1] = ids[0, 0] = 2 * rank + 1  # a token choosing one expert twice
    res, ref = {}, {}
    for backend in ("all_to_all", "deepep"):
        dev = device if backend == "deepep" else "cpu"
        cfg = DeepEPConfig(num_nvl_bytes=1 << 22, num_qps_per_rank=3) if backend == "deepep" else None
        d = make_dispatcher(pg, e_total, hidden, backend=backend, comm_thread=False, backend_config=cfg)
        xt = x.t().contiguous().to(dev).requires_grad_(True)  # leaves [H, T] and [K, T]: x, w are their .t()
        wt = w.t().contiguous().to(dev).requires_grad_(True)
        r = d.dispatch(xt.t(), ids.to(dev), wt.t())
        y = d.combine(r.x * 2, r.handle)
        (y.float() * torch.arange(hidden, device=dev)).sum().backward()
        # only the router weights need a gradient: dispatch's backward reduces the [n, K] piece alone
        wt2 = w.t().contiguous().to(dev).requires_grad_(True)
        r2 = d.dispatch(x.to(dev), ids.to(dev), wt2.t())
        (d.combine(r2.x * 2, r2.handle).float() * torch.arange(hidden, device=dev)).sum().backward()
        res[backend] = [t.detach().cpu() for t in (r.x, r.counts, r.offsets, r.topk_weights, r.expert_ids, y,
                                                   xt.grad, wt.grad, wt2.grad)]
        if backend == "deepep":
            d.backend.destroy()
    # a plain loop (experts: y = 2 x): out[t] = sum_k w[t, k] 2 x[t], dL/dw[t, k] = 2 x[t] . arange(H)
    # over the valid k; every value is exact in fp32 and bf16
    y_ref, gw_ref = torch.zeros(x.shape[0], hidden), torch.zeros(w.shape)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            if ids[t, k] >= 0:
                y_ref[t] += float(w[t, k]) * 2 * x[t].float()
                gw_ref[t, k] = float((2 * x[t].float() * torch.arange(hidden)).sum())
    same = [torch.equal(a, b) for a, b in zip(res["all_to_all"], res["deepep"])]
    loop = [torch.equal(res["deepep"][5].float(), y_ref), torch.equal(res["deepep"][7].t(), gw_ref),
            torch.equal(res["deepep"][8].t(), gw_ref)]
    # the default normal-mode buffer: NVL_BYTES, no RDMA, DeepEP's qps default
    d = make_dispatcher(pg, e_total, hidden, backend="deepep", comm_thread=False)
    assert d.backend.buffer is not None
    d.backend.destroy()
    return {"same": same, "loop": loop}


def _low_latency_case(pg, rank: int, world: int, e_total: int, device: str, hidden: int,
                      fake: bool) -> dict:
    """DeepEPLowLatency: slab shapes; with the real DeepEP also the per-expert counts and rows
    against the inputs of every rank, and combine (experts = identity) against x * sum_k w_k."""
    import warnings

    from parallel.ep import DeepEPConfig
    from parallel.ep.deepep import DeepEPLowLatency

    out = {}
    if fake:  # the deprecated keyword form (a second NVSHMEM buffer in one process: fake only)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            DeepEPLowLatency(pg, max_tokens=8, hidden=hidden, num_experts=e_total)
        out["warned"] = [str(c.message) for c in caught if c.category is DeprecationWarning]
    ll = DeepEPLowLatency(pg, DeepEPConfig(low_latency_mode=True, max_dispatch_tokens_per_rank=8, hidden=hidden,
                                           num_experts=e_total))
    x, ids, w = (t.to(device) for t in _inputs(rank, world, e_total, hidden))
    ids, w = ids.t().contiguous().t(), w.t().contiguous().t()  # non-contiguous (DeepEP asserts contiguous)
    got = ll.dispatch(x, ids, w)
    y = ll.combine(got.x, got)
    out["ll_shapes"] = (tuple(got.x.shape), tuple(y.shape))
    if fake and ids.shape[0]:  # ids outside [0, E) count as no expert, as elsewhere (DeepEP would address rank E // E_local)
        bad = ids.clone()
        bad[0, 0], bad[-1, -1] = e_total, -7
        sent = ll.dispatch(x, bad, w).topk_ids
        want = bad.clone()
        want[0, 0] = want[-1, -1] = -1
        out["ll_bad_ids"] = torch.equal(sent.cpu(), want.long().cpu())
    if not fake:
        per = e_total // world
        counts, rows = [], []
        for e in range(per):  # reference: every rank's tokens that chose expert rank * per + e
            mine = []
            for s in range(world):
                xs, ids_s, _ = _inputs(s, world, e_total, hidden)
                mine += [xs[t] for t in range(xs.shape[0]) if (ids_s[t] == rank * per + e).any()]
            counts.append(len(mine))
            recv = got.x[e, :len(mine)].cpu()
            rows.append(sorted(map(tuple, recv.float().tolist())) == sorted(tuple(r.float().tolist()) for r in mine))
        ref = (x.float() * torch.where(ids >= 0, w, torch.zeros_like(w)).sum(1, keepdim=True)).cpu()
        out["ll_counts"] = (got.counts.cpu().tolist(), counts)
        out["ll_rows"] = rows
        out["ll_combine"] = torch.allclose(y.float().cpu(), ref, rtol=2 ** -7, atol=0)
        # the same step captured in a CUDA graph (as a decode step runs it: no host sync inside), replayed
        # on copies of the inputs: the same counts and combined rows as the eager calls
        sx, sids, sw = x.clone(), ids.clone(), w.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_got = ll.dispatch(sx, sids, sw)
            g_y = ll.combine(g_got.x, g_got)
        for _ in range(2):
            g_y.zero_()
            graph.replay()
        torch.cuda.synchronize()
        out["ll_graph"] = [torch.equal(g_got.counts.cpu(), got.counts.cpu()), torch.equal(g_y.cpu(), y.cpu())]
    ll.destroy()
    return out


def _rank(rank: int, world: int, fake_dir: str | None = None, device: str = "cpu",
          cases: tuple[str, ...] = ("normal", "low_latency")) -> dict:
    """One rank: `cases` of "normal" / "low_latency"; fake_dir None: the real deep_ep, every
    rank on cuda:0 (two processes on one GPU, under MPS)."""
    if fake_dir is not None:
        sys.path.insert(0, fake_dir)
    if device != "cpu":
        torch.cuda.set_device(0)
    from parallel import ParallelConfig, destroy_parallel, init_parallel
    from parallel.ep.deepep import NVL_BYTES

    groups = init_parallel(ParallelConfig(world_size=world))  # gloo: NCCL refuses two ranks on one GPU
    try:
        pg, e_total = groups.ep.group, 2 * world
        out: dict = {"nvl_default": NVL_BYTES}
        if "normal" in cases:
            out.update(_normal_case(pg, rank, world, e_total, device))
        if "low_latency" in cases:
            hidden = FAKE_LL_HIDDEN if fake_dir is not None else LL_HIDDEN
            out.update(_low_latency_case(pg, rank, world, e_total, device, hidden, fake_dir is not None))
        if fake_dir is not None:
            import deep_ep

            out["calls"], out["buffers"] = [c[0] for c in deep_ep.calls], deep_ep.buffers
        return out
    finally:
        destroy_parallel()


def test_deepep_backend_matches_all_to_all_through_a_fake_deep_ep(fake_dir):
    from launch.local import launch_local

    world = 2
    for rank, r in enumerate(launch_local(_rank, world, args=(world, fake_dir), timeout=200)):
        assert r["same"] == [True] * 9 and r["loop"] == [True] * 3, (rank, r["same"], r["loop"])
        assert r["ll_shapes"] == ((2, world * 8, FAKE_LL_HIDDEN), ([5, 0][rank], FAKE_LL_HIDDEN)), r["ll_shapes"]
        assert r.get("ll_bad_ids", rank == 1), rank   # rank 1 has no tokens
        calls = r["calls"]
        # one buffer; layout + dispatch forward, a cached dispatch (combine's backward), combines:
        # per dispatch one forward and one for its backward (x's rows with the weights' gradients)
        assert calls[:4] == ["Buffer", "get_dispatch_layout", "dispatch", "combine"], calls
        assert "dispatch_cached" in calls and calls.count("combine") == 4, calls
        tail = ["Buffer", "low_latency_dispatch", "low_latency_combine"] + ["low_latency_dispatch"] * (rank == 0)
        assert calls[-len(tail) - 1:] == tail + ["destroy"], calls      # rank 0 also sent ids out of range
        assert calls.count("destroy") == 3, calls  # every buffer the body frees, freed once
        # Buffer(group, nvl, rdma, low_latency_mode, num_qps_per_rank) from each DeepEPConfig (fake default qps 1)
        rdma_hint = 8 * FAKE_LL_HIDDEN * world * 16  # the fake's get_low_latency_rdma_size_hint
        assert r["buffers"] == [(1 << 22, 0, False, 3), (r["nvl_default"], 0, False, 1), (0, rdma_hint, True, 2),
                                (0, rdma_hint, True, 2)], r["buffers"]
        assert len(r["warned"]) == 1 and "DeepEPLowLatency(max_tokens=, hidden=, num_experts=) is deprecated" in \
            r["warned"][0], r["warned"]


MPG = os.environ.get("MEGAPAR_DEEPEP_MPG") == "1"
LL = os.environ.get("MEGAPAR_DEEPEP_LL") == "1"
_WHY = "needs DeepEP's pre-V2 build and two processes on one GPU under MPS: bench/run_deepep_mpg.sh"


@pytest.mark.gpu
@pytest.mark.skipif(not MPG, reason=_WHY)
def test_deepep_normal_mode_two_ranks_on_one_gpu():
    """The fake test's normal-mode body with the real DeepEP (intranode kernels, CUDA IPC
    buffers), both ranks on cuda:0: the same rows, counts, combine and gradient as all_to_all."""
    from launch.local import launch_local

    world = 2
    results = launch_local(_rank, world, args=(world, None, "cuda", ("normal",)), timeout=110,
                           env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(100 // world)})
    for rank, r in enumerate(results):
        assert r["same"] == [True] * 9 and r["loop"] == [True] * 3, (rank, r["same"], r["loop"])


@pytest.mark.gpu
@pytest.mark.skipif(not (MPG and LL), reason=_WHY + " (a build with NVSHMEM: MEGAPAR_DEEPEP_LL=1)")
def test_deepep_low_latency_two_ranks_on_one_gpu():
    """DeepEPLowLatency with the real DeepEP (NVSHMEM), both ranks on cuda:0: slab shapes,
    per-expert counts and rows against every rank's inputs, combine against x * sum_k w_k, and
    dispatch + combine captured in one CUDA graph giving the eager results on replay."""
    from launch.local import launch_local

    world = 2
    results = launch_local(_rank, world, args=(world, None, "cuda", ("low_latency",)), timeout=50,
                           env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(100 // world)})
    for rank, r in enumerate(results):
        assert r["ll_shapes"] == ((2, world * 8, LL_HIDDEN), ([5, 0][rank], LL_HIDDEN)), (rank, r["ll_shapes"])
        got, want = r["ll_counts"]
        assert got == want, (rank, got, want)
        assert r["ll_rows"] == [True] * 2, (rank, r["ll_rows"])
        assert r["ll_combine"], rank
        assert r["ll_graph"] == [True, True], (rank, r["ll_graph"])


def test_deepep_config_validates_and_reaches_the_dispatcher_only_by_name():
    from parallel.ep import DeepEPConfig, DispatcherConfig, NvshmemConfig

    assert DeepEPConfig().low_latency_mode is False
    for kwargs, match in [
            (dict(num_nvl_bytes=-1), r"num_nvl_bytes \(-1\) must be an int >= 0 or None"),
            (dict(num_qps_per_rank=0), r"num_qps_per_rank \(0\) must be an int >= 1 or None"),
            (dict(low_latency_mode="yes"), "low_latency_mode must be True or False, got 'yes'"),
            (dict(low_latency_mode=True, hidden=8, num_experts=4),
             r"max_dispatch_tokens_per_rank \(None\) must be an int >= 1"),
            (dict(hidden=8), r"hidden=8 apply to low_latency_mode=True only"),
            (dict(use_fp8=True), r"use_fp8=True apply to low_latency_mode=True only")]:
        with pytest.raises(ValueError, match=match):
            DeepEPConfig(**kwargs)
    with pytest.raises(ValueError, match="backend='all_to_all' takes no backend_config"):
        DispatcherConfig(backend="all_to_all", backend_config=DeepEPConfig())
    with pytest.raises(ValueError, match="backend='deepep' takes a DeepEPConfig as backend_config, got NvshmemConfig"):
        DispatcherConfig(backend="deepep", backend_config=NvshmemConfig(mode="normal"))
    with pytest.raises(ValueError, match="runs DeepEP's normal mode"):
        DispatcherConfig(backend="deepep", backend_config=DeepEPConfig(
            low_latency_mode=True, max_dispatch_tokens_per_rank=8, hidden=8, num_experts=4))
    assert DispatcherConfig(backend="deepep", backend_config=DeepEPConfig(num_rdma_bytes=5)).backend_config \
        == DeepEPConfig(num_rdma_bytes=5)


def test_deepep_is_registered_and_reports_why_it_cannot_run():
    from parallel import impl
    from parallel.ep import backends, make_dispatcher

    assert "deepep" in backends.TRANSPORT.names
    if not impl.importable("deep_ep"):
        assert "megapar[deepep]" in impl.report()["ep.transport"]["deepep"]
        with pytest.raises(ValueError, match="deep_ep"):
            make_dispatcher(None, 4, 8, backend="deepep")
    assert backends.TRANSPORT.resolve("auto") not in ("deepep", "nvshmem")


def test_deepep_rows_that_would_trap_its_dispatch_are_refused():
    from parallel.ep.deepep import MAX_ROW_BYTES, check_row_bytes

    check_row_bytes(torch.zeros(3, 7168, dtype=torch.bfloat16))
    check_row_bytes(torch.zeros(3, 7168, dtype=torch.float8_e4m3fn))
    for hidden, dtype in ((8, torch.bfloat16), (7176, torch.float8_e4m3fn), (MAX_ROW_BYTES // 2 + 16, torch.bfloat16)):
        with pytest.raises(ValueError, match=rf"hidden {hidden} x \d B .* = \d+ B"):
            check_row_bytes(torch.zeros(1, hidden, dtype=dtype))


def _awkward_rank(rank: int, world: int, fake_dir: str) -> dict:
    """Through the fake: payloads DeepEP's host code refuses are refused by the census on every
    rank (nothing reaches deep_ep, nothing poisoned); awkward routings give what all_to_all gives."""
    sys.path.insert(0, fake_dir)
    from parallel import ParallelConfig, destroy_parallel, init_parallel
    from parallel.ep import DispatchInputError, make_dispatcher

    groups = init_parallel(ParallelConfig(world_size=world))
    out: dict = {"refused": [], "same": []}
    try:
        import deep_ep

        pg, e_total, hidden = groups.ep.group, 2 * world, NORMAL_HIDDEN
        g = torch.Generator().manual_seed(rank)
        t = [4, 6][rank]
        x = (torch.randint(-8, 8, (t, hidden), generator=g).float() / 4).to(torch.bfloat16)
        d = make_dispatcher(pg, e_total, hidden, backend="deepep", comm_thread=False)
        ids2, w2 = torch.zeros(t, 2, dtype=torch.int64), torch.ones(t, 2)
        wide = torch.zeros(t, 33, dtype=torch.int64)
        for args, kw in (((x, ids2, w2), {"x_scale": torch.ones(t, 2)}),  # a scale beside bf16 x
                         ((x.to(torch.float8_e4m3fn), ids2, w2), {"x_scale": torch.ones(t, 2, dtype=torch.float16)}),
                         ((x, wide, torch.ones(t, 33)), {})):  # K = 33 > DeepEP's 32
            before = len(deep_ep.calls)
            try:
                d.dispatch(*args, **kw)
                out["refused"].append("accepted")
            except DispatchInputError as exc:
                out["refused"].append("DeepEP" in str(exc) or "rank(s)" in str(exc))
            out["refused"].append(not any(c[0].startswith("dispatch") for c in deep_ep.calls[before:]))
        # fp8 with fp32 scales goes through (and matches all_to_all below)
        # awkward routings: every token to rank 0's experts, K = 3 > 2 experts a rank, repeats,
        # ids out of range with check_ids=False (DeepEP's layout counts them for no rank)
        routes = {"one_rank": torch.randint(0, 2, (t, 3), generator=g),
                  "odd_ids": torch.randint(-1, e_total + 3, (t, 3), generator=g)}
        w = torch.randint(1, 8, (t, 3), generator=g).float() / 8
        for name, ids in routes.items():
            res = {}
            for backend in ("all_to_all", "deepep"):
                dd = make_dispatcher(pg, e_total, hidden, backend=backend, comm_thread=False, check_ids=False)
                r = dd.dispatch(x, ids, w)
                y = dd.combine(r.x * 2, r.handle)
                res[backend] = (r.x, r.counts, r.topk_weights, r.expert_ids, y)
                if backend == "deepep":
                    dd.backend.destroy()
            out["same"].append([torch.equal(a, b) for a, b in zip(res["all_to_all"], res["deepep"])])
        xs = torch.ones(t, 1)
        res = []
        for backend in ("all_to_all", "deepep"):
            dd = make_dispatcher(pg, e_total, hidden, backend=backend, comm_thread=False)
            r = dd.dispatch(x.to(torch.float8_e4m3fn), routes["one_rank"], w, x_scale=xs)
            res.append((r.x.view(torch.uint8), r.x_scale, r.counts))
            if backend == "deepep":
                dd.backend.destroy()
        out["same"].append([torch.equal(a, b) for a, b in zip(*res)])
        d.backend.destroy()
        return out
    finally:
        destroy_parallel()


def test_deepep_refuses_what_deepep_asserts_and_matches_all_to_all_on_awkward_routings(fake_dir):
    """Old code: a scale beside bf16 x, or K > 32, reached DeepEP (its host / device asserts:
    the rank crashed inside the collective, its peers hung); now the census refuses them on every
    rank. Routings with every token on one rank, K above the experts a rank and out-of-range ids
    give what all_to_all gives."""
    from launch.local import launch_local

    for rank, r in enumerate(launch_local(_awkward_rank, 2, args=(2, fake_dir), timeout=120)):
        assert r["refused"] == [True] * 6, (rank, r["refused"])
        assert r["same"] == [[True] * 5, [True] * 5, [True] * 3], (rank, r["same"])
