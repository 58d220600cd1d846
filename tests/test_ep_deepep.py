"""The DeepEP backend against a fake `deep_ep` (the PyPI build needs CUDA >= 13.1 and NCCL >=
2.32.3, newer than the GPU machine). The fake checks the dtypes and shapes of every call and
moves rows with gloo object collectives the way DeepEP's documentation says its buffer does
(received rows by source rank then token, local expert ids, combine = sum of the rows sent
back); `backend="deepep"` must then give what `backend="all_to_all"` gives."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

FAKE = '''
import torch
import torch.distributed as dist
calls = []
buffers = []  # the arguments of every Buffer made

class _Handle:
    def __init__(self, sent, recv_counts, num_tokens):
        self.sent, self.recv_counts, self.num_tokens = sent, recv_counts, num_tokens

class Buffer:
    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=1):
        assert isinstance(num_nvl_bytes, int) and isinstance(num_rdma_bytes, int)
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
        per = num_experts // self.size
        dest = torch.where(topk_idx >= 0, topk_idx // per, self.size)
        in_rank = torch.zeros(topk_idx.shape[0], self.size + 1, dtype=torch.bool)
        in_rank.scatter_(1, dest, True)
        in_rank = in_rank[:, :self.size]
        key = torch.where(topk_idx >= 0, topk_idx, num_experts).reshape(-1)
        per_expert = torch.bincount(key, minlength=num_experts + 1)[:num_experts].int()
        calls.append(("get_dispatch_layout", tuple(topk_idx.shape), num_experts))
        return in_rank.sum(0).int(), None, per_expert, in_rank, None

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None, **kw):
        if handle is not None:
            assert isinstance(x, torch.Tensor) and x.shape[0] == handle.num_tokens, (x.shape, handle.num_tokens)
            calls.append(("dispatch_cached", tuple(x.shape)))
            everyone = self._all([x[handle.sent[d]] for d in range(self.size)])
            return torch.cat([everyone[s][self.rank] for s in range(self.size)]), None, None, None, handle, None
        x, scale = x if isinstance(x, tuple) else (x, None)
        t = x.shape[0]
        assert topk_idx.shape[0] == t and topk_weights.shape == topk_idx.shape and topk_weights.dtype == torch.float32
        assert is_token_in_rank.shape == (t, self.size) and num_tokens_per_rank.shape == (self.size,)
        calls.append(("dispatch", tuple(x.shape), str(x.dtype), scale is not None))
        sent = [is_token_in_rank[:, d].nonzero().reshape(-1) for d in range(self.size)]
        per = num_tokens_per_expert.shape[0] // self.size
        everyone = self._all([(x[i], None if scale is None else scale[i], topk_idx[i], topk_weights[i])
                              for i in sent])
        mine = [everyone[s][self.rank] for s in range(self.size)]
        ids = torch.cat([m[2] for m in mine])
        first = self.rank * per
        local = torch.where((ids >= first) & (ids < first + per), ids - first, torch.full_like(ids, -1))
        recv_x = torch.cat([m[0] for m in mine])
        if scale is not None:
            recv_x = (recv_x, torch.cat([m[1] for m in mine]))
        handle = _Handle(sent, [m[0].shape[0] for m in mine], t)
        return recv_x, local, torch.cat([m[3] for m in mine]), None, handle, None

    def combine(self, x, handle, **kw):
        assert x.dtype == torch.bfloat16, x.dtype  # DeepEP combines bf16
        assert x.shape[0] == sum(handle.recv_counts), (x.shape, handle.recv_counts)
        calls.append(("combine", tuple(x.shape)))
        blocks = list(torch.split(x, handle.recv_counts))  # block s: rows from rank s
        everyone = self._all(blocks)
        out = torch.zeros(handle.num_tokens, x.shape[1], dtype=torch.float32)
        for d in range(self.size):
            out.index_add_(0, handle.sent[d], everyone[d][self.rank].float())
        return out.to(torch.bfloat16), None, None

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=False, **kw):
        assert self.ll and topk_idx.dtype == torch.int64 and x.shape[0] <= num_max_dispatch_tokens_per_rank
        calls.append(("low_latency_dispatch", tuple(x.shape), num_max_dispatch_tokens_per_rank, num_experts))
        el = num_experts // self.size
        recv = torch.zeros(el, self.size * num_max_dispatch_tokens_per_rank, x.shape[1], dtype=x.dtype)
        return recv, torch.zeros(el, dtype=torch.int32), "ll-handle", None, None

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, **kw):
        assert handle == "ll-handle" and x.dim() == 3 and topk_weights.shape == topk_idx.shape
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


def _inputs(rank: int, world: int, e_total: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(rank)
    t = [5, 0, 7, 3][rank]
    ids = torch.stack([torch.randperm(e_total, generator=g)[:K] for _ in range(t)]) if t else \
        torch.zeros(0, K, dtype=torch.int64)
    ids[torch.rand(t, K, generator=g) < 0.25] = -1
    w = torch.randint(0, 4, (t, K), generator=g).float() / 4
    x = (torch.randint(-8, 8, (t, H), generator=g).float() / 4).to(torch.bfloat16)
    return x, ids, w


def _rank(rank: int, world: int, fake_dir: str) -> dict:
    sys.path.insert(0, fake_dir)
    from parallel import ParallelConfig, destroy_parallel, init_parallel
    import warnings

    from parallel.ep import DeepEPConfig, make_dispatcher
    from parallel.ep.deepep import NVL_BYTES, DeepEPLowLatency

    groups = init_parallel(ParallelConfig(world_size=world))
    try:
        pg, e_total = groups.ep.group, 2 * world
        x, ids, w = _inputs(rank, world, e_total)
        res = {}
        for backend in ("all_to_all", "deepep"):
            cfg = DeepEPConfig(num_nvl_bytes=1 << 22, num_qps_per_rank=3) if backend == "deepep" else None
            d = make_dispatcher(pg, e_total, H, backend=backend, comm_thread=False, backend_config=cfg)
            xx = x.clone().requires_grad_(True)
            r = d.dispatch(xx, ids, w)
            y = d.combine(r.x * 2, r.handle)
            (y.float() * torch.arange(H)).sum().backward()
            res[backend] = [r.x.detach(), r.counts, r.offsets, r.topk_weights.detach(), r.expert_ids, y.detach(),
                            xx.grad]
            if backend == "deepep":
                d.backend.destroy()
        # the default normal-mode buffer: NVL_BYTES, no RDMA, DeepEP's qps default
        make_dispatcher(pg, e_total, H, backend="deepep", comm_thread=False).backend.buffer
        with warnings.catch_warnings(record=True) as caught:  # the deprecated keyword form
            warnings.simplefilter("always")
            DeepEPLowLatency(pg, max_tokens=8, hidden=H, num_experts=e_total)
        ll = DeepEPLowLatency(pg, DeepEPConfig(low_latency_mode=True, max_dispatch_tokens_per_rank=8, hidden=H,
                                               num_experts=e_total))
        got = ll.dispatch(x, ids, w)
        out = ll.combine(got.x, got)
        import deep_ep

        return {"same": [torch.equal(a, b) for a, b in zip(res["all_to_all"], res["deepep"])],
                "ll_shapes": (tuple(got.x.shape), tuple(out.shape)), "calls": [c[0] for c in deep_ep.calls],
                "buffers": deep_ep.buffers, "nvl_default": NVL_BYTES,
                "warned": [str(c.message) for c in caught if c.category is DeprecationWarning]}
    finally:
        destroy_parallel()


def test_deepep_backend_matches_all_to_all_through_a_fake_deep_ep(fake_dir):
    from launch.local import launch_local

    world = 2
    for rank, r in enumerate(launch_local(_rank, world, args=(world, fake_dir), timeout=200)):
        assert r["same"] == [True] * 7, (rank, r["same"])
        assert r["ll_shapes"] == ((2, world * 8, H), ([5, 0][rank], H)), r["ll_shapes"]
        calls = r["calls"]
        # one buffer; layout + dispatch forward, a cached dispatch (combine's backward), combines
        assert calls[:4] == ["Buffer", "get_dispatch_layout", "dispatch", "combine"], calls
        assert "dispatch_cached" in calls and calls.count("combine") == 2, calls
        assert calls[-3:] == ["Buffer", "low_latency_dispatch", "low_latency_combine"], calls
        # Buffer(group, nvl, rdma, low_latency_mode, num_qps_per_rank) from each DeepEPConfig (fake default qps 1)
        rdma_hint = 8 * H * world * 16  # the fake's get_low_latency_rdma_size_hint
        assert r["buffers"] == [(1 << 22, 0, False, 3), (r["nvl_default"], 0, False, 1), (0, rdma_hint, True, 2),
                                (0, rdma_hint, True, 2)], r["buffers"]
        assert len(r["warned"]) == 1 and "DeepEPLowLatency(max_tokens=, hidden=, num_experts=) is deprecated" in \
            r["warned"][0], r["warned"]


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
