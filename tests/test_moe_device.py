"""The MoE layer's device-driven path (static shapes, no host sync) and its plan.

Checked against independent references: a loop over (token, k) pairs for the plan, and a
per-token dense computation (fp64, the layer's own dequantized weights) for the layer. Routing
is steered through a hash layer's table so the awkward cases are exact: -1 ids (padding
tokens), empty experts, every token on one expert, out-of-range ids. Multi-rank cases (the
replicated mode and the all-gather transport, uneven and empty ranks) run on gloo; CUDA-graph
capture, the sync check and the launch count run on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from moe import MoEConfig, MoELayer
from parallel.ep.static import plan_static

FORMATS = ("fp32", "bf16", "fp8_block", "mxfp4", "nvfp4")


def _plan_reference(ids: torch.Tensor, num_slots: int, first: int, total: int):
    """Loop over slots, then (token, k): rows, their tokens, counts, pair positions."""
    t, k = ids.shape
    pos = torch.full((t, k), -1, dtype=torch.long)
    tokens, counts = [], [0] * num_slots
    for e in range(num_slots):
        for i in range(t):
            for j in range(k):
                g = int(ids[i, j])
                if 0 <= g < total and g - first == e:
                    pos[i, j] = len(tokens)
                    tokens.append(i)
                    counts[e] += 1
    return pos, tokens, counts


PLAN_CASES = [  # (T, K, slots, first slot, total slots)
    (1, 6, 32, 0, 32), (7, 8, 32, 32, 64), (0, 4, 8, 0, 8), (64, 8, 256, 0, 256), (33, 3, 5, 2, 9), (9, 2, 1, 0, 1)]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_plan_matches_loop_reference_on_awkward_routing(backend, monkeypatch):
    if backend == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(1)
    for t, k, slots, first, total in PLAN_CASES:
        for variant in ("random", "one_expert", "skewed", "wide"):
            ids = torch.randint(-1, total, (t, k), generator=gen)
            if variant == "one_expert" and t:
                ids[:, 0] = first + slots - 1  # every token on one (the last) slot
            if variant == "skewed" and t > 3:
                ids[1] = -1  # a padding token
                ids[3, 0], ids[3, -1] = total + 3, -5  # out of range: skipped and counted
            if variant == "wide" and t > 2 and t % 2 == 0:
                # int64 ids past int32 (the plan reads int32): narrowed, they would be slots first and first + 1
                ids[2, 0], ids[2, -1] = 2 ** 32 + first, -2 ** 32 + first + 1
            bad = torch.zeros(1, dtype=torch.int32)
            plan = plan_static(ids.to(torch.int32 if t % 2 else torch.int64), slots, first_slot=first,
                               num_slots_total=total, bad_ids=bad, backend=backend)
            pos, tokens, counts = _plan_reference(ids, slots, first, total)
            case = (t, k, slots, first, total, variant)
            assert torch.equal(plan.pair_pos, pos), case
            assert plan.row_token[:len(tokens)].tolist() == tokens, case
            assert (plan.row_token[len(tokens):] == -1).all(), case
            assert plan.counts.tolist() == counts, case
            assert plan.offsets.tolist() == [0] + torch.tensor(counts, dtype=torch.long).cumsum(0).tolist(), case
            assert int(bad) == int(((ids < -1) | (ids >= total)).sum()), case


def test_plan_rejects_bad_arguments():
    ids = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"topk_ids must be \[T, K\]"):
        plan_static(ids[0], 4)
    with pytest.raises(ValueError, match="float32 is not int32 or int64"):
        plan_static(ids.float(), 4)
    with pytest.raises(ValueError, match=r"local slots \[6, 10\) must lie in \[0, num_slots_total=8\)"):
        plan_static(ids, 4, first_slot=6, num_slots_total=8)
    with pytest.raises(ValueError, match="bad_ids must be an int32"):
        plan_static(ids, 4, bad_ids=torch.zeros(1))


# ---- the layer, EP = 1 --------------------------------------------------------------------------

H, I, E, K, VOCAB = 64, 64, 8, 3, 32


def _config(fmt: str = "fp32", **kw) -> MoEConfig:
    base = dict(hidden=H, inter=I, num_experts=E, top_k=K, scoring="sigmoid", n_group=4, topk_group=2,
                routed_scaling=2.5, swiglu_limit=7.0, num_shared=1, dtype=torch.float32, expert_format=fmt)
    base.update(kw)
    return MoEConfig(**base)


def _dense_reference(layer: MoELayer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_k w[t, k] * FFN_{ids[t, k]}(x[t]) + shared(x[t]) per token, in fp64 (ids -1 skipped)."""
    w13, w2 = (w.double() for w in layer.experts.dequantized(torch.float64))
    limit = layer.config.swiglu_limit
    xd = x.double()
    out = torch.zeros_like(xd)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            s = layer.experts.local_experts.index(e)
            g, u = (w13[s] @ xd[t]).split(layer.config.inter)
            if limit is not None:
                g, u = g.clamp(max=limit), u.clamp(-limit, limit)
            out[t] += float(weights[t, j]) * (w2[s] @ (g * torch.sigmoid(g) * u))
    if layer.shared_experts is not None:
        se = layer.shared_experts
        g, u = xd @ se.w1.weight.double().t(), xd @ se.w3.weight.double().t()
        out += (g * torch.sigmoid(g) * u) @ se.w2.weight.double().t()
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm().clamp(min=1e-30))


@pytest.mark.parametrize("fmt", FORMATS)
def test_device_path_matches_dense_reference_and_host_path(fmt):
    torch.manual_seed(0)
    cfg = _config(fmt)
    host = MoELayer(cfg, path="host")
    dev = MoELayer(cfg, path="device")
    dev.load_state_dict(host.state_dict())
    for t in (1, 5, 40):
        x = torch.randn(t, H)
        mask = torch.rand(t) > 0.3
        with torch.no_grad():
            y_dev = dev(x, token_mask=mask)
            y_host = host(x, token_mask=mask)
            r = dev.gate(x, token_mask=mask)
        ref = _dense_reference(dev, x, r.topk_ids, r.topk_weights)
        assert _rel(y_dev, ref) < 1e-5, (fmt, t)
        assert torch.allclose(y_dev, y_host, atol=1e-5, rtol=1e-5), (fmt, t)
        assert torch.equal(dev.expert_counts, host.expert_counts)
        expect = torch.bincount(r.topk_ids[r.topk_ids >= 0], minlength=E)
        assert torch.equal(dev.expert_counts, expect)


def _hash_layer(fmt: str, table: torch.Tensor, **kw) -> MoELayer:
    layer = MoELayer(_config(fmt, hash_layer=True, vocab=VOCAB, use_bias=False), path="device", **kw)
    with torch.no_grad():
        layer.gate.tid2eid.copy_(table)
    return layer


@pytest.mark.parametrize("fmt", ["fp32", "mxfp4"])
def test_device_path_on_steered_routing_empty_experts_one_expert_padding(fmt):
    torch.manual_seed(1)
    one = torch.full((VOCAB, K), 5, dtype=torch.int32)  # every token: expert 5 three times
    spread = torch.randint(0, 3, (VOCAB, K), dtype=torch.int32)  # experts 3..7 stay empty
    for table in (one, spread):
        layer = _hash_layer(fmt, table)
        x = torch.randn(24, H)
        ids = torch.randint(0, VOCAB, (24,))
        mask = torch.ones(24, dtype=torch.bool)
        mask[::5] = False  # padding tokens: routed nowhere, shared expert only
        with torch.no_grad():
            y = layer(x, input_ids=ids, token_mask=mask)
            r = layer.gate(x, input_ids=ids, token_mask=mask)
        assert (r.topk_ids[~mask] == -1).all()
        ref = _dense_reference(layer, x, r.topk_ids, r.topk_weights)
        assert _rel(y, ref) < 1e-5
        shared_only = _dense_reference(layer, x[~mask], torch.full((int((~mask).sum()), K), -1), r.topk_weights[~mask])
        assert torch.allclose(y[~mask].double(), shared_only, atol=1e-6)


def test_device_path_counts_out_of_range_ids_and_raises_after(monkeypatch):
    layer = MoELayer(_config(), path="device")
    real = layer.gate.forward

    def corrupted(*args, **kwargs):  # e.g. a corrupted hash table or EPLB map upstream
        r = real(*args, **kwargs)
        r.topk_ids[0, 1] = E + 4
        r.topk_ids[2, 0] = -7
        return r

    monkeypatch.setattr(layer.gate, "forward", corrupted)
    with torch.no_grad():
        y = layer(torch.randn(4, H))
    assert int(layer.bad_ids) == 2 and torch.isfinite(y).all()
    with pytest.raises(ValueError, match=r"2 id\(s\) outside \[-1, 8\)"):
        layer.raise_on_bad_ids()
    layer.raise_on_bad_ids()  # the flag was reset


def test_path_choice_and_errors():
    cfg = _config()
    layer = MoELayer(cfg)  # path="auto"
    x = torch.randn(3, H)
    assert layer.choose_path(x) == "host"  # grad mode with trainable weights: autograd needs the host path
    with torch.no_grad():
        assert layer.choose_path(x) == "device"
    with torch.inference_mode():
        assert layer.choose_path(x) == "device"
    dev = MoELayer(cfg, path="device")
    with pytest.raises(ValueError, match="path='device' is inference only"):
        dev(x)
    with pytest.raises(ValueError, match="unknown MoE forward path 'fast'"):
        MoELayer(cfg, path="fast")
    with pytest.raises(ValueError, match="unknown EP transport 'nvlink'"):
        MoELayer(cfg, transport="nvlink")
    with pytest.raises(ValueError, match=r"max_tokens \(0\) must be an int >= 1"):
        MoELayer(cfg, max_tokens=0)
    with pytest.raises(ValueError, match="backend='mega_moe' is not implemented"):
        MoELayer(cfg, backend="mega_moe")
    with pytest.warns(DeprecationWarning, match="kernel_backend"):
        old = MoELayer(cfg, kernel_backend="torch")
    assert old.experts.backend == "torch"


def test_device_path_gradient_request_uses_host_path_with_equal_values():
    torch.manual_seed(2)
    layer = MoELayer(_config())
    x = torch.randn(6, H, requires_grad=True)
    y = layer(x)  # host path (autograd)
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    with torch.no_grad():
        assert torch.allclose(layer(x), y, atol=1e-6)


# ---- multi-rank (gloo) --------------------------------------------------------------------------

def _multirank(rank: int) -> dict:
    import torch.distributed as dist

    from parallel import ParallelConfig, destroy_parallel, init_parallel

    world = dist.get_world_size() if dist.is_initialized() else None
    groups = init_parallel(ParallelConfig(world_size=int(__import__("os").environ["WORLD_SIZE"])))
    world = groups.ep.size
    out: dict[str, float] = {}
    try:
        torch.manual_seed(0)  # same weights and global tokens everywhere
        cfg = _config("mxfp4", num_experts=4 * world)
        ref_layer = MoELayer(cfg)  # EP = 1 copy holding every expert
        state = ref_layer.state_dict()
        sizes = [3, 0, 7, 1][:world] if world <= 4 else [2] * world  # uneven, one rank empty
        total = sum(sizes)
        x_all = torch.randn(total, H)
        first = sum(sizes[:rank])
        mine = x_all[first:first + sizes[rank]]
        with torch.no_grad():
            full = ref_layer(x_all)
            # replicated mode: every rank holds all tokens
            rep = MoELayer(cfg, groups.ep, tokens="replicated", path="device")
            rep.load_state_dict({k: v for k, v in state.items() if not k.startswith("experts.")}, strict=False)
            rep.experts.load_state_dict(_local_expert_state(ref_layer, rep))
            out["replicated"] = float((rep(x_all) - full).abs().max())
            # all-gather transport: each rank its own (uneven, possibly no) tokens
            ag = MoELayer(cfg, groups.ep, path="device", max_tokens=8)
            ag.load_state_dict({k: v for k, v in state.items() if not k.startswith("experts.")}, strict=False)
            ag.experts.load_state_dict(_local_expert_state(ref_layer, ag))
            y = ag(mine)
            out["allgather"] = float((y - full[first:first + sizes[rank]]).abs().max()) if sizes[rank] else 0.0
            out["allgather_shape_ok"] = float(tuple(y.shape) == (sizes[rank], H))
            # the host path (all_to_all) on the same tokens agrees too
            host = MoELayer(cfg, groups.ep, path="host")
            host.load_state_dict({k: v for k, v in state.items() if not k.startswith("experts.")}, strict=False)
            host.experts.load_state_dict(_local_expert_state(ref_layer, host))
            yh = host(mine)
            out["host_vs_device"] = float((yh - y).abs().max()) if sizes[rank] else 0.0
            try:
                ag(torch.randn(9, H))
                out["too_many"] = 0.0
            except ValueError as exc:
                out["too_many"] = float("max_tokens (8)" in str(exc))
    finally:
        destroy_parallel()
    return out


def _local_expert_state(full: MoELayer, part: MoELayer) -> dict[str, torch.Tensor]:
    """`full`'s expert tensors restricted to `part`'s slots (slot order)."""
    idx = torch.tensor(part.experts.local_experts)
    return {k: (v[idx] if v is not None and v.dim() and v.shape[0] == full.experts.num_slots else v)
            for k, v in full.experts.state_dict().items()}


@pytest.mark.parametrize("world", [2, 4])
def test_device_path_multirank_replicated_and_allgather_match_ep1(world):
    from launch.local import launch_local

    results = launch_local(_multirank, world, timeout=150)
    for rank, res in enumerate(results):
        assert res["replicated"] < 1e-5, (rank, res)
        assert res["allgather"] < 1e-5, (rank, res)
        assert res["allgather_shape_ok"] == 1.0, (rank, res)
        assert res["host_vs_device"] < 1e-5, (rank, res)
        assert res["too_many"] == 1.0, (rank, res)



def _allgather_wide_ids(rank: int) -> dict:
    """Each rank brings int64 ids, some past int32 range, through the all-gather transport and
    plans its two slots on what it receives."""
    from parallel import ParallelConfig, destroy_parallel, init_parallel
    from parallel.comm import resolve_group
    from parallel.ep.static import AllGatherTransport

    groups = init_parallel(ParallelConfig(world_size=2))
    try:
        pg, _, size = resolve_group(groups.ep)
        x = torch.full((2, 8), float(rank + 1))
        # 2**32 + 1 and -2**32 + 3 narrow to the valid slots 1 and 3 if cast as they are
        ids = torch.tensor([[0, 2**32 + 1], [3, -2**32 + 3]], dtype=torch.int64)
        transport = AllGatherTransport(pg, size, max_tokens=4)
        try:  # float ids (1.5 would be truncated onto expert 1 by the narrowing copy), on every rank
            transport.dispatch(x, torch.tensor([[0.0, 1.5], [3.0, 2.0]]), torch.full((2, 2), 0.5))
            refused = "no error"
        except ValueError as exc:
            refused = str(exc)
        batch = transport.dispatch(x, ids, torch.full((2, 2), 0.5))
        bad = torch.zeros(1, dtype=torch.int32)
        plan = plan_static(batch.topk_ids, 2, first_slot=2 * rank, num_slots_total=4, bad_ids=bad, backend="torch")
        return {"counts": plan.counts.tolist(), "bad": int(bad), "float_ids": refused}
    finally:
        destroy_parallel()


def test_allgather_transport_keeps_int64_ids_past_int32_out_of_range():
    """The transport moves ids as int32. An int64 id past that range is out of range (skipped,
    counted in bad_ids); narrowed as it was, it wrapped onto a valid slot and was computed."""
    from launch.local import launch_local

    results = launch_local(_allgather_wide_ids, 2, timeout=90)
    # every rank sees both ranks' tokens: slot 0 twice, slot 3 twice, four out-of-range ids
    refused = "topk_ids dtype torch.float32 is not int32 or int64"
    assert results == [{"counts": [2, 0], "bad": 4, "float_ids": refused},
                       {"counts": [0, 2], "bad": 4, "float_ids": refused}], results


# ---- GPU ----------------------------------------------------------------------------------------

def gpu(fn):
    """A GPU test: marked `gpu`, skipped without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(fn))


def _gpu_layer(fmt: str, **kw) -> MoELayer:
    cfg = MoEConfig.deepseek_v4_flash(num_experts=32, expert_format=fmt, hidden=1024, inter=512)
    return MoELayer(cfg, device="cuda", **kw)


@gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "bf16"])
def test_gpu_device_path_matches_host_path_and_is_sync_free(fmt):
    torch.manual_seed(0)
    dev = _gpu_layer(fmt, path="device")
    host = _gpu_layer(fmt, path="host")
    host.load_state_dict(dev.state_dict())
    for t in (1, 7, 64, 1000):
        x = torch.randn(t, 1024, device="cuda", dtype=torch.bfloat16)
        with torch.inference_mode():
            y_host = host(x)
            dev(x)  # compile / warm up
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                y_dev = dev(x)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert _rel(y_dev.float(), y_host.float()) < 2e-2, (fmt, t)
        assert torch.equal(dev.expert_counts, host.expert_counts)


@gpu
def test_gpu_graph_capture_replays_eager_results_and_counts():
    from moe.graphs import GraphedMoE

    torch.manual_seed(0)
    layer = _gpu_layer("mxfp4")
    graphed = GraphedMoE(layer, [1, 4, 16, 64])
    for t in (1, 3, 16, 50):
        x = torch.randn(t, 1024, device="cuda", dtype=torch.bfloat16)
        with torch.inference_mode():
            eager = layer(x).clone()
            counts = layer.expert_counts.clone()
        y = graphed(x)
        assert graphed.size_for(t) >= t
        if graphed.size_for(t) == t:  # same shapes, same kernels, same order: bit-identical
            assert torch.equal(y, eager), t
        else:  # a larger captured size: the GEMMs may block differently (rows per expert pick the tile)
            assert _rel(y.float(), eager.float()) < 1e-2, t
        assert torch.equal(layer.expert_counts, counts), t  # padding rows are not counted
    with pytest.raises(ValueError, match="exceeds the largest captured size"):
        graphed(torch.randn(65, 1024, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="captured for torch.bfloat16"):
        graphed(torch.randn(2, 1024, device="cuda"))


@gpu
def test_gpu_plain_cuda_graph_with_eplb_counts_inside():
    from parallel.ep.eplb_state import Eplb, EplbConfig

    torch.manual_seed(0)
    cfg = MoEConfig.deepseek_v4_flash(num_experts=32, expert_format="mxfp4", hidden=1024, inter=512)
    eplb = Eplb(1, 32, config=EplbConfig(num_redundant=8), device="cuda")
    layer = MoELayer(cfg, device="cuda", eplb=eplb)
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        eager = layer(x).clone()
        layer(x)
        torch.cuda.synchronize()
        before = eplb.tracker.step_counts[0].clone()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = layer(x)
        g.replay()
        torch.cuda.synchronize()
    assert torch.equal(y, eager)
    assert int((eplb.tracker.step_counts[0] - before)[:-1].sum()) == 8 * cfg.top_k  # counted inside the graph


@gpu
def test_gpu_graphed_moe_warmup_is_not_counted_as_eplb_load():
    """GraphedMoE's warm-up forwards counted warmup x sum(sizes) x top_k phantom tokens into the
    EPLB tracker's step (at every recapture after a migration too); its replays still count."""
    from moe.graphs import GraphedMoE
    from parallel.ep.eplb_state import Eplb, EplbConfig

    torch.manual_seed(0)
    cfg = MoEConfig.deepseek_v4_flash(num_experts=32, expert_format="mxfp4", hidden=1024, inter=512)
    eplb = Eplb(1, 32, config=EplbConfig(num_redundant=8), device="cuda")
    layer = MoELayer(cfg, device="cuda", eplb=eplb)
    eplb.tracker.step_counts[0, 3] = 5                       # a step in progress keeps its own counts
    before = eplb.tracker.step_counts.clone()
    graphed = GraphedMoE(layer, [4, 16])
    assert torch.equal(eplb.tracker.step_counts, before)
    graphed(torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16))
    torch.cuda.synchronize()
    assert int((eplb.tracker.step_counts - before)[0, :-1].sum()) == 4 * cfg.top_k


@gpu
def test_gpu_launches_per_forward_are_bounded():
    from torch.profiler import ProfilerActivity, profile

    layer = _gpu_layer("mxfp4")
    x = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        layer(x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            layer(x)
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    # gate GEMM + route + counts (2) + plan + gather + 2 expert GEMMs + combine + shared expert (~5) + add
    names = [e.name[:60] for e in kernels]
    print(len(names), names)
    assert len(kernels) <= 24, names


@gpu
def test_gpu_enable_cuda_graphs_serves_eager_calls_with_fresh_results():
    torch.manual_seed(0)
    layer = _gpu_layer("mxfp4")
    xs = [torch.randn(t, 1024, device="cuda", dtype=torch.bfloat16) for t in (1, 3, 8)]
    with torch.inference_mode():
        plain = [layer(x).clone() for x in xs]
        layer.enable_cuda_graphs([1, 4, 8])
        graphed = [layer(x) for x in xs]
        again = layer(xs[0])
    for p, g in zip(plain, graphed):
        assert torch.equal(p, g)
    assert torch.equal(graphed[0], again) and graphed[0].data_ptr() != again.data_ptr()  # fresh tensors
    with torch.no_grad():  # replacing the weights drops the graphs; the next call recaptures
        layer.experts._set_weights(torch.randn(32, 1024, 1024, device="cuda") * 0.02,
                                   torch.randn(32, 1024, 512, device="cuda") * 0.02)
        layer._graphed_before = layer._graphed
        y = layer(xs[1])
        layer._graphed_after = layer._graphed
        layer.disable_cuda_graphs()
        ref = layer(xs[1])
    assert layer._graphed_before is not layer._graphed_after
    assert torch.equal(y, ref)


def test_triton_swiglu_matches_torch(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from moe.kernels.ffn import swiglu as torch_swiglu
    from moe.kernels.triton_swiglu import swiglu

    gen = torch.Generator().manual_seed(3)
    g, u = torch.randn(37, 19, generator=gen) * 4, torch.randn(37, 19, generator=gen) * 4
    for limit, alpha, beta in ((None, 1.0, 0.0), (0.5, 1.702, 1.0), (7.0, 1.0, 0.0)):
        out = swiglu(g, u, limit=limit, alpha=alpha, beta=beta)
        ref = torch_swiglu(g, u, limit=limit, alpha=alpha, beta=beta)
        assert torch.allclose(out, ref, atol=1e-6, rtol=1e-6), (limit, alpha, beta)
    with pytest.raises(ValueError, match="must have one shape"):
        swiglu(g, u[:3])


def _nccl_capture_rank(rank: int, world: int) -> float:
    from megapar.parallel import ParallelConfig, destroy_parallel, init_parallel

    torch.cuda.set_device(rank)
    groups = init_parallel(ParallelConfig(world_size=world))
    try:
        torch.manual_seed(0)
        cfg = MoEConfig.deepseek_v4_flash(num_experts=8 * world, expert_format="mxfp4", hidden=1024, inter=512)
        layer = MoELayer(cfg, groups.ep, device="cuda", path="device", transport="allgather", max_tokens=16)
        x = torch.randn(3 + rank, 1024, device="cuda", dtype=torch.bfloat16)  # uneven tokens per rank
        with torch.inference_mode():
            eager = layer(x).clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = layer(x)
            graph.replay()
            torch.cuda.synchronize()
        return float((y.float() - eager.float()).abs().max())
    finally:
        destroy_parallel()


@pytest.mark.multigpu
def test_multigpu_allgather_device_path_captures_and_replays_eager_results():
    from megapar.launch.local import launch_local

    world = min(torch.cuda.device_count(), 8)
    assert launch_local(_nccl_capture_rank, world, backend="nccl", args=(world,), timeout=300) == [0.0] * world


def test_device_path_w4a8_quantizes_each_token_once_before_the_gather(monkeypatch):
    """kernels="triton_w4a8" (the interpreter here): the experts receive fp8_token rows that were
    quantized per token before the top-k gather. The output equals, bit for bit, that of bf16
    rows gathered first and quantized inside the experts (per-row quantization commutes with the
    gather), and it stays near the fp64 dense reference (within fp8's rounding)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(3)
    h = 128                                           # whole fp8 / MXFP4 blocks
    layer = MoELayer(_config("mxfp4", hidden=h, num_shared=0), path="device", kernels="triton_w4a8")
    seen = []
    forward = layer.experts.forward

    def spy(x, counts, offsets=None, out_dtype=None):
        seen.append(type(x).__name__)
        return forward(x, counts, offsets, out_dtype)

    monkeypatch.setattr(layer.experts, "forward", spy)
    for t in (1, 33):
        x = torch.randn(t, h)
        mask = torch.rand(t) > 0.2
        with torch.no_grad():
            y = layer(x, token_mask=mask)
            with monkeypatch.context() as m:      # the other order: gather bf16 rows, quantize inside
                m.setattr(layer.experts, "takes_fp8_rows", lambda *a: False)
                y_after = layer(x, token_mask=mask)
            r = layer.gate(x, token_mask=mask)
        assert seen[-2:] == ["QuantizedTensor", "Tensor"], seen
        assert torch.equal(y, y_after), (t, (y - y_after).abs().max())
        # two E4M3 roundings (x, then h) against fp64: a few % relative
        assert _rel(y, _dense_reference(layer, x, r.topk_ids, r.topk_weights)) < 8e-2, t


def _graphs_refuse_host_sizes(rank: int) -> dict:
    from moe.graphs import GraphedMoE
    from parallel import ParallelConfig, destroy_parallel, init_parallel

    groups = init_parallel(ParallelConfig(world_size=int(__import__("os").environ["WORLD_SIZE"])))
    out = {}
    try:
        cfg = _config("bf16", num_experts=4 * groups.ep.size)
        for name, kwargs, sizes in (("allgather", dict(max_tokens=512), (1, 8, 300)),
                                    ("all_to_all", dict(transport="all_to_all"), (1, 8))):
            layer = MoELayer(cfg, groups.ep, **kwargs)
            try:
                GraphedMoE(layer, sizes)
                out[name] = "no error"
            except ValueError as e:
                out[name] = str(e)
    finally:
        destroy_parallel()
    return out


def test_graphs_refuse_token_counts_that_take_the_host_path():
    """CUDA graphs of an EP layer with path 'auto': sizes that take the host path (the all-gather
    transport above MEGAPAR_ALLGATHER_MAX_TOKENS, or an all-to-all transport, whose decode has no
    device path) would have synced inside the capture; they are refused by size, before anything is
    captured (here, before the layer's CPU device is refused too)."""
    from launch.local import launch_local

    from moe.layer import ALLGATHER_MAX_TOKENS

    assert ALLGATHER_MAX_TOKENS < 300
    for res in launch_local(_graphs_refuse_host_sizes, 2, timeout=120):
        assert "token counts [300] take this layer's host path" in res["allgather"], res
        assert "token counts [1, 8] take this layer's host path (transport 'all_to_all'" in res["all_to_all"], res
