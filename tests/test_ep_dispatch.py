"""EP dispatch/combine against an independent single-process reference (loops over ranks,
tokens and top-k slots), in one process (EP=1) and on real gloo ranks (2, 4, 8).

Every rank builds every rank's inputs from one seed, so each can compute what it must receive
and what combine must return without communicating. Multi-rank cases are batched into two
launch_local calls (process start-up dominates on 2 cores): 4 ranks (EP 4, and two EP-2
groups side by side given as raw ProcessGroups) and 8 ranks.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from parallel.ep import DispatchResult, make_dispatcher


def assert_close(got: torch.Tensor, want: torch.Tensor, *, atol: float, rtol: float, label: str) -> None:
    """|got - want| <= atol + rtol * |want| elementwise. (torch.testing.assert_close imports
    DTensor and sympy once torch.distributed is up: seconds per rank process.)"""
    assert got.shape == want.shape, (label, tuple(got.shape), tuple(want.shape))
    err = (got.double() - want.double()).abs()
    bound = atol + rtol * want.double().abs()
    if not bool((err <= bound).all()):
        worst = int((err - bound).argmax())
        raise AssertionError(f"{label}: max error {float(err.max()):.3g}; at flat index {worst}: "
                             f"got {float(got.flatten()[worst]):.6g}, want {float(want.flatten()[worst]):.6g}")


# ---------------------------------------------------------------------------------------------
# Independent reference.


def make_inputs(seed: int, world: int, num_experts: int, hidden: int, top_k: int, *, max_tokens: int = 12,
                dtype: torch.dtype = torch.float32, skip_experts: tuple[int, ...] = ()) -> list[dict]:
    """Every rank's tokens: uneven counts (some ranks none), distinct experts per token, some -1
    slots, some tokens with no expert at all, experts in `skip_experts` never chosen."""
    g = torch.Generator().manual_seed(seed)
    allowed = [e for e in range(num_experts) if e not in skip_experts]
    ranks = []
    for r in range(world):
        t = int(torch.randint(1, max_tokens + 1, (1,), generator=g))
        if r == 1 and (world > 2 or seed % 2):
            t = 0  # a rank that sends nothing
        ids = torch.full((t, top_k), -1, dtype=torch.int64)
        for i in range(t):
            pick = torch.randperm(len(allowed), generator=g)[:top_k]
            ids[i, : len(pick)] = torch.tensor([allowed[j] for j in pick])
        ids[torch.rand(t, top_k, generator=g) < 0.2] = -1
        if t > 2:
            ids[2] = -1  # a token routed nowhere
        w = torch.rand(t, top_k, generator=g) * (ids >= 0)
        w = w / w.sum(1, keepdim=True).clamp(min=1e-6)  # weights of each token sum to 1 (or 0)
        x = (torch.randn(t, hidden, generator=g) * 2).to(dtype)
        ranks.append({"x": x, "ids": ids.to(torch.int32 if r % 2 else torch.int64), "w": w})
    return ranks


def reference_pairs(inputs: list[dict], rank: int, num_experts: int) -> list[list[tuple[int, int, int]]]:
    """(source rank, token, k) of every pair for each local expert of `rank`, in received order."""
    per_rank = num_experts // len(inputs)
    pairs: list[list[tuple[int, int, int]]] = [[] for _ in range(per_rank)]
    for src, inp in enumerate(inputs):
        ids = inp["ids"].tolist()
        for t, row in enumerate(ids):
            for k, e in enumerate(row):
                if rank * per_rank <= e < (rank + 1) * per_rank:
                    pairs[e - rank * per_rank].append((src, t, k))
    return pairs


def kept_pairs(inputs: list[dict], num_experts: int, capacity: int | None) -> set[tuple[int, int, int]]:
    """Pairs that survive slab drops (the first `capacity` arrivals of each expert)."""
    kept = set()
    for r in range(len(inputs)):
        for lst in reference_pairs(inputs, r, num_experts):
            kept.update(lst if capacity is None else lst[:capacity])
    return kept


def expert_fn(e: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A toy expert that depends on the (global) expert id: rows [N, H] -> [N, H]."""
    e = e.to(torch.float32)[:, None]
    return x * (e + 1) + 0.25 * e


def reference_combine(inputs: list[dict], rank: int, num_experts: int, kept: set) -> torch.Tensor:
    inp = inputs[rank]
    out = torch.zeros(inp["x"].shape, dtype=torch.float64)
    for t in range(inp["x"].shape[0]):
        for k in range(inp["ids"].shape[1]):
            e = int(inp["ids"][t, k])
            if e >= 0 and (rank, t, k) in kept:
                y = expert_fn(torch.tensor([e]), inp["x"][t : t + 1].float()).double()[0]
                out[t] += float(inp["w"][t, k]) * y
    return out


def check_received(res: DispatchResult, inputs: list[dict], rank: int, num_experts: int, *, layout: str,
                   align: int = 1, capacity: int | None = None, label: str = "") -> None:
    """Rows, weights, expert ids, counts and offsets equal the reference, padding is zero."""
    pairs = reference_pairs(inputs, rank, num_experts)
    per_rank = num_experts // len(inputs)
    hidden = inputs[0]["x"].shape[1]
    if layout == "slab":
        assert res.x.shape == (per_rank, capacity, hidden), label
        rows = res.x.reshape(per_rank * capacity, hidden)
        starts = [e * capacity for e in range(per_rank)]
        pairs = [p[:capacity] for p in pairs]
    else:
        rows = res.x
        starts, pos = [], 0
        for p in pairs:
            starts.append(pos)
            pos += math.ceil(len(p) / align) * align
        assert rows.shape[0] == pos, (label, rows.shape, pos)
    assert res.counts.tolist() == [len(p) for p in pairs], (label, res.counts.tolist())
    assert res.rows_hint >= 0 and (layout != "slab" or res.rows_hint <= capacity), (label, res.rows_hint)
    assert res.offsets.tolist()[:-1] == starts, (label, res.offsets.tolist(), starts)
    weights = res.topk_weights.reshape(-1)
    eids = res.expert_ids.reshape(-1)
    used = torch.zeros(rows.shape[0], dtype=torch.bool)
    for e, plist in enumerate(pairs):
        for i, (src, t, k) in enumerate(plist):
            j = starts[e] + i
            used[j] = True
            want = inputs[src]["x"][t]
            got = rows[j]
            if want.dtype.itemsize == 1:
                want, got = want.view(torch.uint8), got.view(torch.uint8)
            assert torch.equal(got, want), (label, "row", e, i, (src, t, k))
            assert float(weights[j]) == float(inputs[src]["w"][t, k]), (label, "weight", e, i)
            assert int(eids[j]) == e, (label, "expert id", j)
            if res.x_scale is not None:
                assert torch.equal(res.x_scale.reshape(rows.shape[0], -1)[j], inputs[src]["scale"][t]), label
    pad = ~used
    assert not rows.view(torch.uint8)[pad].any(), (label, "padding rows must be zero")
    assert not weights[pad].any() and (eids[pad] == -1).all(), (label, "padding marks")


def run_expert(res: DispatchResult, rank: int, per_rank: int, pad_value: float = 1e4) -> torch.Tensor:
    """Apply `expert_fn` to every layout row; padding rows get garbage that combine must ignore."""
    h = res.x.shape[-1]
    rows = res.x.reshape(-1, h).float()
    eids = res.expert_ids.reshape(-1).long()
    y = expert_fn(eids + rank * per_rank, rows)
    y = torch.where(eids[:, None] >= 0, y, torch.full_like(y, pad_value))
    return y.reshape(res.x.shape[:-1] + (h,))


# ---------------------------------------------------------------------------------------------
# The cases, shared by the in-process (EP=1) tests and the rank functions.


def _cpu(res: DispatchResult) -> DispatchResult:
    """The result's tensors on the CPU, for checking."""
    return dataclasses.replace(res, x=res.x.cpu(), x_scale=None if res.x_scale is None else res.x_scale.cpu(),
                               counts=res.counts.cpu(), offsets=res.offsets.cpu(),
                               topk_weights=res.topk_weights.cpu(), expert_ids=res.expert_ids.cpu())


def dispatch_combine_cases(group, rank: int, world: int, *, backends: tuple[str, ...], full: bool,
                           device: str = "cpu") -> int:
    """Check every case for this rank; returns the number of cases checked. Inputs are built on
    the CPU, moved to `device` for dispatch/combine, and results are checked on the CPU."""
    num_experts, top_k = 4 * world, 3
    configs = [
        dict(layout="contiguous", align=1, async_op=False),
        dict(layout="contiguous", align=8, async_op=True),
        dict(layout="slab", capacity=64, async_op=False),
        dict(layout="slab", capacity=2, drop_policy="drop", async_op=True),
    ]
    if full:
        configs += [dict(layout="contiguous", align=4, async_op=False, hidden=7, dtype=torch.bfloat16),
                    dict(layout="slab", capacity=64, async_op=False, hidden=24, quant="per_token"),
                    dict(layout="contiguous", align=1, async_op=True, hidden=160, quant="per_128")]
    checked = 0
    for backend in backends:
        for ci, cfg in enumerate(configs):
            cfg = dict(cfg)
            hidden, dtype, quant = cfg.pop("hidden", 40), cfg.pop("dtype", torch.float32), cfg.pop("quant", None)
            async_op = cfg.pop("async_op")
            label = f"[rank {rank}] {backend} {cfg} hidden={hidden} {dtype} quant={quant} async={async_op}"
            inputs = make_inputs(1000 + 17 * ci + world, world, num_experts, hidden, top_k, dtype=dtype,
                                 skip_experts=(1, num_experts - 1))
            scale = None
            if quant is not None:
                group_size = hidden if quant == "per_token" else 128
                num_groups = math.ceil(hidden / group_size)
                for inp in inputs:
                    x = inp["x"].float()
                    xg = torch.nn.functional.pad(x, (0, num_groups * group_size - hidden))
                    inp["scale"] = xg.view(x.shape[0], num_groups, group_size).abs().amax(2).clamp(min=1e-4) / 448
                    rep = inp["scale"].repeat_interleave(group_size, 1)[:, :hidden]
                    inp["x"] = (x / rep).to(torch.float8_e4m3fn)
                    inp["dequant"] = inp["x"].float() * rep
                scale = inputs[rank]["scale"]
            d = make_dispatcher(group, num_experts, hidden, backend=backend, **cfg)
            mine = inputs[rank]
            on = lambda t: None if t is None else t.to(device)
            res_dev = d.dispatch(on(mine["x"]), on(mine["ids"]), on(mine["w"]), x_scale=on(scale), async_op=async_op)
            res_dev = res_dev.wait() if async_op else res_dev
            res = _cpu(res_dev)
            check_received(res, inputs, rank, num_experts, layout=cfg["layout"], align=cfg.get("align", 1),
                           capacity=cfg.get("capacity"), label=label)
            if cfg.get("drop_policy") == "drop":
                total = sum(len(p) - min(len(p), cfg["capacity"]) for p in reference_pairs(inputs, rank, num_experts))
                assert res.num_dropped == total, (label, res.num_dropped, total)

            # combine: toy experts (dequantized for fp8), padding rows hold garbage
            per_rank = num_experts // world
            expert_in = res
            if quant is not None:
                s = res.x_scale.reshape(-1, res.x_scale.shape[-1])
                rep = s.repeat_interleave(group_size, 1)[:, :hidden]
                deq = res.x.reshape(-1, hidden).float() * rep
                expert_in = dataclasses.replace(res, x=deq.view(res.x.shape), x_scale=None)
                for inp in inputs:
                    inp["x"] = inp["dequant"]
            y = run_expert(expert_in, rank, per_rank).to(torch.bfloat16 if quant else dtype)
            kept = kept_pairs(inputs, num_experts, cfg.get("capacity") if cfg.get("drop_policy") else None)
            want = reference_combine(inputs, rank, num_experts, kept)
            out = d.combine(on(y), res.handle, async_op=async_op)
            out = (out.wait() if async_op else out).cpu()
            assert out.dtype == (torch.bfloat16 if quant else dtype), (label, out.dtype)
            tol = dict(atol=0.1, rtol=0.02) if (quant or dtype == torch.bfloat16) else dict(atol=1e-4, rtol=1e-5)
            assert_close(out.double(), want, **tol, label=f"{label}")
            # pre-weighted expert outputs: same result
            yw = (y.float() * res.topk_weights[..., None]).to(y.dtype)
            out_w = d.combine(on(yw), res.handle, weighted=True).cpu()
            assert_close(out_w.double(), want, **tol, label=f"{label} weighted")
            if quant is None and cfg.get("drop_policy") is None:
                # identity experts give x back (weights sum to 1; tokens routed nowhere give 0)
                ident = d.combine(res_dev.x, res.handle).cpu()
                has = (mine["ids"] >= 0).any(1, keepdim=True)
                assert_close(ident.float(), mine["x"].float() * has, **tol,
                             label=f"{label} identity")
            checked += 1
    return checked


def gradient_cases(group, rank: int, world: int, *, backends: tuple[str, ...], device: str = "cpu") -> int:
    """Gradients to x and topk_weights equal those of a dense single-process computation."""
    num_experts, top_k, hidden = 2 * world, 2, 12
    mats_cpu = torch.randn(num_experts, hidden, hidden, generator=torch.Generator().manual_seed(7)) / 3
    mats = mats_cpu.to(device)
    checked = 0
    for backend in backends:
        for layout, weighted in (("contiguous", False), ("slab", True), ("contiguous", True)):
            label = f"[rank {rank}] grad {backend} {layout} weighted={weighted}"
            inputs = make_inputs(2000 + world, world, num_experts, hidden, top_k)
            mine = inputs[rank]
            g_out = torch.randn(mine["x"].shape, generator=torch.Generator().manual_seed(3 + rank))
            kwargs = dict(capacity=64) if layout == "slab" else dict(align=4)
            d = make_dispatcher(group, num_experts, hidden, backend=backend, layout=layout, **kwargs)
            x = mine["x"].clone().to(device).requires_grad_(True)
            w = mine["w"].clone().to(device).requires_grad_(True)
            res = d.dispatch(x, mine["ids"].to(device), w)
            rows = res.x.reshape(-1, hidden)
            eids = res.expert_ids.reshape(-1).long()
            row_mats = torch.where(eids[:, None, None] >= 0, mats[(eids + rank * num_experts // world).clamp(min=0)],
                                   torch.zeros((), device=device))
            y = torch.bmm(rows[:, None, :], row_mats)[:, 0]
            if weighted:
                y = y * res.topk_weights.reshape(-1, 1)
            out = d.combine(y.view(res.x.shape), res.handle, weighted=weighted)
            (out * g_out.to(device)).sum().backward()
            out, x, w = out.cpu(), x.grad.cpu(), w.grad.cpu()

            xr = mine["x"].clone().requires_grad_(True)
            wr = mine["w"].clone().requires_grad_(True)
            ids = mine["ids"].long()
            ys = torch.einsum("th,tkhj->tkj", xr, mats_cpu[ids.clamp(min=0)])
            dense = ((wr * (ids >= 0))[..., None] * ys).sum(1)
            (dense * g_out).sum().backward()
            assert_close(out, dense, atol=1e-5, rtol=1e-5, label=f"{label} out")
            assert_close(x, xr.grad, atol=1e-5, rtol=1e-5, label=f"{label} dx")
            assert_close(w, wr.grad * (ids >= 0), atol=1e-5, rtol=1e-5,
                         label=f"{label} dw")
            checked += 1
    return checked


def awkward_gradient_cases(group, rank: int, world: int) -> int:
    """Gradients to x and topk_weights (combine weighted and not, sync and async) against autograd
    of a plain loop out[t] = sum_k w[t, k] * f_e(x[t]) over the pairs that survive, with an expert
    chosen twice (and three times) by one token, -1 ids, a token routed nowhere, and a slab that
    drops its last arrivals (and a padded contiguous layout)."""
    num_experts, top_k, hidden = 2 * world, 3, 6
    mats = torch.randn(num_experts, hidden, hidden, generator=torch.Generator().manual_seed(11)) / 3
    g = torch.Generator().manual_seed(5000 + world)
    inputs = []
    for r in range(world):
        t = 5 + r
        ids = torch.randint(0, num_experts, (t, top_k), generator=g)
        ids[0, 1] = ids[0, 0]  # one expert twice
        ids[1, :] = ids[1, 0]  # three times
        ids[2, 1] = -1
        ids[3] = -1  # routed nowhere
        inputs.append({"x": torch.randn(t, hidden, generator=g), "ids": ids, "w": torch.rand(t, top_k, generator=g)})
    mine = inputs[rank]
    g_out = torch.randn(mine["x"].shape, generator=torch.Generator().manual_seed(rank))
    checked = 0
    for layout, kwargs in (("slab", dict(capacity=2, drop_policy="drop")), ("contiguous", dict(align=4))):
        kept = kept_pairs(inputs, num_experts, kwargs.get("capacity"))
        d = make_dispatcher(group, num_experts, hidden, layout=layout, **kwargs)
        for weighted, async_op in ((False, False), (True, True)):
            label = f"[rank {rank}] awkward grad {layout} weighted={weighted} async={async_op}"
            x, w = mine["x"].clone().requires_grad_(True), mine["w"].clone().requires_grad_(True)
            res = d.dispatch(x, mine["ids"], w, async_op=async_op)
            res = res.wait() if async_op else res
            eids = res.expert_ids.reshape(-1).long()
            row_mats = mats[(eids + rank * num_experts // world).clamp(min=0)]
            y = torch.bmm(res.x.reshape(-1, 1, hidden), row_mats)[:, 0]
            y = torch.where(eids[:, None] >= 0, y, torch.full_like(y, 1e4))  # padding: garbage
            if weighted:
                y = y * res.topk_weights.reshape(-1, 1)
            out = d.combine(y.view(res.x.shape), res.handle, weighted=weighted, async_op=async_op)
            out = out.wait() if async_op else out
            (out * g_out).sum().backward()

            xr, wr = mine["x"].double().requires_grad_(True), mine["w"].double().requires_grad_(True)
            rows = [0 * (xr[t] + wr[t].sum()) for t in range(xr.shape[0])]
            for t, row in enumerate(mine["ids"].tolist()):
                for k, e in enumerate(row):
                    if e >= 0 and (rank, t, k) in kept:
                        rows[t] = rows[t] + wr[t, k] * (xr[t] @ mats[e].double())
            want = torch.stack(rows)
            (want * g_out.double()).sum().backward()
            assert_close(out, want, atol=1e-5, rtol=1e-5, label=f"{label} out")
            assert_close(x.grad, xr.grad, atol=1e-5, rtol=1e-5, label=f"{label} dx")
            assert_close(w.grad, wr.grad, atol=1e-5, rtol=1e-5, label=f"{label} dw")
            checked += 1
    return checked


def empty_cases(group, world: int) -> int:
    """No tokens anywhere, or tokens routed nowhere: empty layouts, zero outputs and gradients."""
    checked = 0
    for backend in ("all_to_all", "allgather"):
        for layout, kwargs in (("contiguous", dict(align=4)), ("slab", dict(capacity=3))):
            d = make_dispatcher(group, 2 * world, 8, backend=backend, layout=layout, **kwargs)
            x, w = torch.randn(0, 8, requires_grad=True), torch.rand(0, 2, requires_grad=True)
            res = d.dispatch(x, torch.zeros(0, 2, dtype=torch.int64), w, async_op=True).wait()
            d.combine(res.x * 2, res.handle).sum().backward()
            assert x.grad.shape == (0, 8) and res.counts.tolist() == [0, 0]
            res = d.dispatch(torch.randn(3, 8), torch.full((3, 2), -1), torch.rand(3, 2))
            assert res.x.shape == ((0, 8) if layout == "contiguous" else (2, 3, 8)) and not res.x.any()
            assert torch.equal(d.combine(res.x, res.handle), torch.zeros(3, 8))
            checked += 1
    return checked


def pipelined_cases(group, rank: int, world: int) -> int:
    """Two dispatches and two combines in flight at once, waited out of order, give the same
    results as one at a time (the overlap pattern of the MoE layer)."""
    num_experts, hidden = 2 * world, 16
    checked = 0
    for backend in ("all_to_all", "allgather"):
        d = make_dispatcher(group, num_experts, hidden, backend=backend, align=2)
        a, b = (make_inputs(seed, world, num_experts, hidden, 2)[rank] for seed in (4000, 4001))
        pending_a = d.dispatch(a["x"], a["ids"], a["w"], async_op=True)
        pending_b = d.dispatch(b["x"], b["ids"], b["w"], async_op=True)
        res_b, res_a = pending_b.wait(), pending_a.wait()
        out_a = d.combine(res_a.x * 2, res_a.handle, async_op=True)
        out_b = d.combine(res_b.x * 3, res_b.handle, async_op=True)
        got_b, got_a = out_b.wait(), out_a.wait()
        for inp, got, factor in ((a, got_a, 2), (b, got_b, 3)):
            res = d.dispatch(inp["x"], inp["ids"], inp["w"])
            assert torch.equal(got, d.combine(res.x * factor, res.handle)), (rank, backend)
        assert torch.equal(res_a.x, d.dispatch(a["x"], a["ids"], a["w"]).x)
        if world > 1:
            nonblocking_cases(d, group, rank, a)
        checked += 1
    return checked


def nonblocking_cases(d, group, rank: int, inp: dict) -> None:
    """On CPU, async dispatch/combine return before the peers arrive (the census runs on the
    communication thread), and a collective the caller issues on the same group while they
    are in flight does not get mixed up with theirs (the thread uses a private group)."""
    import time

    import torch.distributed as dist

    from parallel.comm import resolve_group

    pg, _, _ = resolve_group(group)
    want = d.combine(*(lambda r: (r.x * 2, r.handle))(d.dispatch(inp["x"], inp["ids"], inp["w"])))
    if rank == 1:
        time.sleep(0.4)  # the others' dispatch() must not wait for this rank
    start = time.perf_counter()
    pending = d.dispatch(inp["x"], inp["ids"], inp["w"], async_op=True)
    launched = time.perf_counter() - start
    assert rank == 1 or launched < 0.2, f"async dispatch blocked the caller for {launched:.3f} s"
    tag = torch.full((3,), float(rank + 1))
    dist.all_reduce(tag, group=pg)  # the caller's own collective while the dispatch is in flight
    res = pending.wait()
    out = d.combine(res.x * 2, res.handle, async_op=True)
    dist.all_reduce(tag, group=pg)
    assert torch.equal(out.wait(), want)
    size = dist.get_world_size(pg)
    assert torch.equal(tag, torch.full((3,), float(size * size * (size + 1) // 2)))


def error_cases(group, rank: int, world: int) -> list[str]:
    """Bad input on one rank makes every rank raise, before any payload moves; then the group
    still works. Returns this rank's error messages in order."""
    num_experts, hidden = 2 * world, 8
    messages = []
    inputs = make_inputs(3000, world, num_experts, hidden, 2)
    mine = inputs[rank]
    bad_rank = world - 1
    variants = ("bad_id", "bad_hidden", "overflow", "top_k", "x_dtype")
    for variant in variants:
        x, ids = mine["x"], mine["ids"].clone()
        kwargs = {}
        if variant == "top_k" and rank == bad_rank:
            ids = ids[:, :1].contiguous()  # K = 1 where the others have K = 2
        if variant == "bad_id" and rank == bad_rank:
            ids = torch.full((max(ids.shape[0], 1), 2), num_experts, dtype=ids.dtype)
            x, w = torch.zeros(ids.shape[0], hidden), torch.ones(ids.shape[0], 2)
        if variant == "x_dtype" and rank == bad_rank:
            x = x.to(torch.bfloat16)  # the same row width in elements, other bytes per row
        if variant == "bad_hidden" and rank == bad_rank:
            x = torch.zeros(x.shape[0], hidden + 1)
        if variant == "overflow":
            kwargs = dict(layout="slab", capacity=1)
            ids = torch.zeros(4, 2, dtype=torch.int64)
            ids[:, 1] = -1
            x = torch.zeros(4, hidden)
        w = torch.ones(ids.shape, dtype=torch.float32) * 0.5
        d = make_dispatcher(group, num_experts, hidden, backend="all_to_all" if world > 1 else "auto", **kwargs)
        try:
            d.dispatch(x, ids, w)
            messages.append("no error")
        except ValueError as e:
            messages.append(str(e))
    # the group is still usable: a good dispatch/combine round trip
    d = make_dispatcher(group, num_experts, hidden)
    res = d.dispatch(mine["x"], mine["ids"], mine["w"])
    out = d.combine(res.x, res.handle)
    has = (mine["ids"] >= 0).any(1, keepdim=True)
    assert_close(out, mine["x"] * has, atol=1e-5, rtol=1e-5, label="after errors")
    return messages


def _rank_main(rank: int, world: int) -> dict:
    """Both backends on the EP group of all ranks; with 4 ranks also the full matrix (both
    layouts, sync and async, bf16 / fp8 payloads, gradients) on two 2-rank groups given as
    raw ProcessGroups, which run side by side."""
    import torch.distributed as dist

    from parallel import ParallelConfig, init_parallel

    groups = init_parallel(ParallelConfig(world_size=world))
    backends = ("all_to_all", "allgather")
    out = {}
    if world == 4:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        pair = pairs[rank // 2]
        out[2] = {"cases": dispatch_combine_cases(pair, rank % 2, 2, backends=backends, full=True)
                  + empty_cases(pair, 2),
                  "grads": gradient_cases(pair, rank % 2, 2, backends=backends)
                  + awkward_gradient_cases(pair, rank % 2, 2),
                  "errors": error_cases(pair, rank % 2, 2)}
    out[world] = {"cases": dispatch_combine_cases(groups.ep, rank, world, backends=backends, full=False)
                  + pipelined_cases(groups.ep, rank, world),
                  "grads": gradient_cases(groups.ep, rank, world, backends=("all_to_all",))
                  + awkward_gradient_cases(groups.ep, rank, world),
                  "errors": error_cases(groups.ep, rank, world)}
    return out


def _rank_gpu(rank: int, world: int) -> tuple[int, int]:
    from parallel import ParallelConfig, init_parallel

    groups = init_parallel(ParallelConfig(world_size=world), backend="nccl")
    device = f"cuda:{torch.cuda.current_device()}"
    backends = ("all_to_all", "allgather")
    return (dispatch_combine_cases(groups.ep, rank, world, backends=backends, full=True, device=device),
            gradient_cases(groups.ep, rank, world, backends=backends, device=device))


def _check_error_messages(results: list[dict], world: int) -> None:
    bad_rank = world - 1
    for rank, r in enumerate(results):
        bad_id, bad_hidden, overflow, top_k, x_dtype = r["errors"]
        # likewise by the payload's pieces: an fp32 x beside a bf16 one aborted the process (gloo: the
        # received size does not match) or would be misread
        dtypes = ["'torch.float32'"] * (world - 1) + ["'torch.bfloat16'"]
        assert x_dtype.startswith(f"[rank {rank}] EP dispatch: the EP ranks' payloads differ (by rank) in x dtype: "
                                  f"[{', '.join(dtypes)}]"), x_dtype
        # the rows are packed by K: a receiver with another K dropped (or invented) pairs the census
        # counted, and combined a wrong result without an error
        ks = [2] * (world - 1) + [1]
        assert top_k.startswith(f"[rank {rank}] EP dispatch: the EP ranks' topk_ids have different top-k widths K "
                                f"(by rank: {ks})"), top_k
        if rank == bad_rank:
            assert "outside [-1," in bad_id, bad_id
            assert "hidden size 9 != the dispatcher's hidden (8)" in bad_hidden, bad_hidden
        else:
            assert f"rank(s) [{bad_rank}]" in bad_id and f"rank(s) [{bad_rank}]" in bad_hidden, (bad_id, bad_hidden)
        assert "capacity >= " + str(4 * world) in overflow, overflow


# ---------------------------------------------------------------------------------------------
# Tests.


def test_single_rank_dispatch_combine_match_reference_without_communication():
    assert dispatch_combine_cases(None, 0, 1, backends=("auto", "all_to_all", "allgather"), full=True) == 21


def test_single_rank_gradients_match_dense_computation():
    assert gradient_cases(None, 0, 1, backends=("auto",)) == 3 and awkward_gradient_cases(None, 0, 1) == 4
    assert empty_cases(None, 1) == 4 and pipelined_cases(None, 0, 1) == 2


def test_size_one_group_object_means_no_communication():
    from parallel.groups import Group

    d = make_dispatcher(Group("ep", None, 0, 1, (0,)), 4, 8, backend="all_to_all")
    assert d.backend.name == "local" and d.experts_per_rank == 4
    x = torch.randn(5, 8)
    res = d.dispatch(x, torch.tensor([[0, 3]] * 5), torch.full((5, 2), 0.5))
    assert res.counts.tolist() == [5, 0, 0, 5]
    assert torch.allclose(d.combine(res.x, res.handle), x)


def _graph_safe_pair(device: str):
    """A sync-free dispatcher (one rank, slab, drop, no id check) and a checked twin."""
    kwargs = dict(layout="slab", capacity=6, drop_policy="drop")
    return (make_dispatcher(None, 16, 24, check_ids=False, **kwargs), make_dispatcher(None, 16, 24, **kwargs))


def test_single_rank_slab_without_checks_skips_the_census_and_matches():
    fast, checked = _graph_safe_pair("cpu")
    assert fast._graph_safe and not checked._graph_safe
    x, ids, w = torch.randn(30, 24), torch.rand(30, 16).topk(4, dim=1).indices, torch.rand(30, 4)
    a, b = fast.dispatch(x, ids, w), checked.dispatch(x, ids, w)
    assert torch.equal(a.x, b.x) and torch.equal(a.counts, b.counts) and a.num_dropped is None and b.num_dropped > 0
    assert torch.equal(fast.combine(a.x * 3, a.handle), checked.combine(b.x * 3, b.handle))


@pytest.mark.gpu
def test_single_gpu_slab_dispatch_combine_capture_in_a_cuda_graph():
    fast, checked = _graph_safe_pair("cuda")
    dev = torch.device("cuda")

    def inputs(seed: int):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(30, 24, generator=g)
        return [x.to(dev), torch.rand(30, 16, generator=g).topk(4, dim=1).indices.to(dev),
                torch.rand(30, 4, generator=g).to(dev)]

    static = inputs(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compiles the kernels) outside the capture
        for _ in range(2):
            res = fast.dispatch(*static)
            out = fast.combine(res.x * 3, res.handle)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = fast.dispatch(*static)
        out = fast.combine(res.x * 3, res.handle)
    fresh = inputs(1)
    for buf, value in zip(static, fresh):
        buf.copy_(value)
    graph.replay()
    torch.cuda.synchronize()
    ref = checked.dispatch(*fresh)
    assert torch.equal(res.x, ref.x) and torch.equal(res.counts, ref.counts)
    assert torch.allclose(out, checked.combine(ref.x * 3, ref.handle), atol=1e-5)


@pytest.mark.gpu
def test_single_gpu_dispatch_combine_and_gradients_match_reference():
    assert dispatch_combine_cases(None, 0, 1, backends=("auto",), full=True, device="cuda") == 7
    assert gradient_cases(None, 0, 1, backends=("auto",), device="cuda") == 3


@pytest.mark.multigpu
def test_nccl_two_gpus_dispatch_combine_and_gradients_match_reference():
    from launch.local import launch_local

    assert launch_local(_rank_gpu, 2, backend="nccl", args=(2,), timeout=300) == [(14, 6), (14, 6)]


def test_single_rank_bad_input_raises_value_error_naming_values():
    messages = error_cases(None, 0, 1)
    assert "outside [-1, 2)" in messages[0] and "hidden size 9" in messages[1] and "capacity >= 4" in messages[2]
    assert messages[3] == "no error"  # one rank: any K
    d = make_dispatcher(None, 8, 16)
    x, ids, w = torch.randn(3, 16), torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2)
    with pytest.raises(ValueError, match="int32 or int64"):
        d.dispatch(x, ids.float(), w)
    with pytest.raises(ValueError, match=r"topk_weights shape \(3, 3\)"):
        d.dispatch(x, ids, torch.ones(3, 3))
    with pytest.raises(ValueError, match=r"topk_ids must be \[T=3, K\]"):
        d.dispatch(x, ids[:2], w[:2])
    with pytest.raises(ValueError, match=r"outside \[-1, 8\)"):
        d.dispatch(x, ids - 2, w)
    out = make_dispatcher(None, 8, 16, check_ids=False).dispatch(x, ids - 2, w)  # treated as -1
    assert out.x.shape[0] == 0
    res = d.dispatch(x, ids, w)
    with pytest.raises(ValueError, match=r"expert_out shape \(3, 15\)"):
        d.combine(torch.zeros(3, 15), res.handle)
    with pytest.raises(ValueError, match="another Dispatcher"):
        make_dispatcher(None, 8, 16).combine(res.x, res.handle)
    with pytest.raises(ValueError, match="valid layouts: contiguous, slab"):
        make_dispatcher(None, 8, 16, layout="masked")
    with pytest.raises(ValueError, match="needs capacity"):
        make_dispatcher(None, 8, 16, layout="slab")
    with pytest.raises(ValueError, match="valid backends"):
        make_dispatcher(None, 8, 16, backend="nccl")


def test_only_implemented_transports_are_listed_and_unknown_names_raise():
    from parallel.ep import backends

    assert backends.BACKENDS == ("auto", "all_to_all", "allgather", "nvshmem", "deepep")
    with pytest.raises(ValueError, match=r"valid backends: auto, all_to_all, allgather, nvshmem, deepep"):
        make_dispatcher(None, 8, 16, backend="symm_mem")  # not written yet: not offered
    assert backends.select_backend("auto", size=4) is backends.AllToAllBackend
    assert backends.select_backend("allgather", size=4) is backends.AllGatherBackend


def test_registered_transport_joins_the_auto_order_with_its_check(monkeypatch):
    from parallel import impl
    from parallel.ep import backends

    class Fake(backends.AllToAllBackend):
        name = "fake"

    monkeypatch.setattr(backends, "_REGISTRY", dict(backends._REGISTRY))
    monkeypatch.setattr(backends, "TRANSPORT", impl.Op("test.ep.transport", list(backends.TRANSPORT.impls)))
    backends.register_backend("fake", Fake, check=impl.needs_cuda_tensor, before="all_to_all")
    assert backends.select_backend("auto", size=2, device=torch.device("cpu")) is backends.AllToAllBackend
    assert backends.select_backend("auto", size=2, device=torch.device("cuda")) is Fake
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        backends.select_backend("fake", size=2, device=torch.device("cpu"))


def _transport_input_error_rank(rank: int) -> dict:
    """A transport whose rows check refuses x (DeepEP's: 16-byte rows) on 2 gloo ranks."""
    from parallel import ParallelConfig, destroy_parallel, init_parallel
    from parallel.ep import backends, deepep
    from parallel.ep.dispatch import DispatchInputError

    class RowChecked(backends.AllToAllBackend):
        name = "row_checked"
        input_error = staticmethod(deepep.row_bytes_error)  # DeepEP's check on the all-to-all transport

    backends.register_backend("row_checked", RowChecked, auto=False)
    groups = init_parallel(ParallelConfig(world_size=2))
    out: dict = {}
    try:
        ids = torch.tensor([[0, 3], [1, -1], [2, 2]])
        w = torch.full((3, 2), 0.5)
        d = make_dispatcher(groups.ep, 4, 8, backend="row_checked")
        try:
            d.dispatch(torch.ones(3, 8, dtype=torch.bfloat16), ids, w)  # 8 x 2 B = 16 B rows
            out["refused"] = "no error"
        except DispatchInputError as exc:
            out["refused"] = str(exc)
        # the group is not poisoned: 32-byte rows go through and match the plain transport
        x = torch.arange(48, dtype=torch.float32).view(3, 16).to(torch.bfloat16) + rank
        got = make_dispatcher(groups.ep, 4, 16, backend="row_checked").dispatch(x, ids, w)
        want = make_dispatcher(groups.ep, 4, 16, backend="all_to_all").dispatch(x, ids, w)
        out["same"] = torch.equal(got.x, want.x) and torch.equal(got.topk_weights, want.topk_weights)
        return out
    finally:
        destroy_parallel()


def test_transport_input_error_is_agreed_on_and_poisons_nothing():
    """A transport's row check (DeepEP's row bytes) runs before the census: every rank raises
    DispatchInputError together, and the next dispatch works (raised inside the transport's send,
    it poisoned the group)."""
    from launch.local import launch_local

    results = launch_local(_transport_input_error_rank, 2, timeout=90)
    for rank, r in enumerate(results):
        assert r["same"] is True, r
        assert r["refused"].startswith(f"[rank {rank}] EP dispatch: DeepEP's intranode dispatch needs rows of a "
                                       "multiple of 32 bytes"), r
        assert "hidden 8 x 2 B (torch.bfloat16) = 16 B" in r["refused"], r


def test_multirank_dispatch_combine_gradients_and_errors_2_and_4_ranks():
    from launch.local import launch_local

    results = launch_local(_rank_main, 4, args=(4,), timeout=150)
    for world, cases, grads in ((2, 18, 10), (4, 10, 7)):
        per_rank = [r[world] for r in results[:world]]  # ranks 2, 3 repeat the 2-rank cases
        assert all(r["cases"] == cases and r["grads"] == grads for r in per_rank), per_rank
        _check_error_messages(per_rank, world)
    assert all(r[2]["cases"] == 18 for r in results[2:])


def test_multirank_dispatch_combine_8_ranks():
    from launch.local import launch_local

    results = [r[8] for r in launch_local(_rank_main, 8, args=(8,), timeout=180)]
    assert all(r["cases"] == 10 and r["grads"] == 7 for r in results), results
    _check_error_messages(results, 8)


def test_dispatcher_config_is_typed_and_keywords_override_it():
    from parallel.ep import DispatcherConfig

    cfg = DispatcherConfig(layout="slab", capacity=4)
    d = make_dispatcher(None, 8, 16, cfg, drop_policy="drop")
    assert (d.layout, d.capacity, d.drop_policy, cfg.drop_policy) == ("slab", 4, "drop", None)
    with pytest.raises(TypeError, match=r"unknown options \['bogus'\]"):
        make_dispatcher(None, 8, 16, bogus=1)
    with pytest.raises(ValueError, match="needs capacity"):
        DispatcherConfig(layout="slab")
    with pytest.raises(ValueError, match="valid backends: auto, all_to_all, allgather"):
        DispatcherConfig(backend="nccl")


def test_rows_hint_is_the_uniform_routing_expectation():
    """expected_rows_per_expert against a simulation of the routing it assumes: K distinct experts
    per token, uniform over E; rank 0 holds experts [0, E / world) and receives a token when any of
    its experts is among them. Its rows per expert on average, within 3% (20000 tokens)."""
    from parallel.ep.dispatch import expected_rows_per_expert

    g = torch.Generator().manual_seed(5)
    for E, K, world in ((64, 8, 2), (64, 8, 8), (256, 8, 32), (16, 2, 4), (8, 8, 1)):
        here_n = E // world
        ids = torch.rand(20000, E, generator=g).topk(K, dim=1).indices
        here = ids < here_n
        received = int(here.any(1).sum())
        mean_rows = int(here.sum()) / here_n
        hint = expected_rows_per_expert(received, K, here_n, E)
        assert abs(hint - mean_rows) / mean_rows < 0.03, (E, K, world, hint, mean_rows)
    assert expected_rows_per_expert(10, 8, 32, 256, capacity=2) <= 2
    assert expected_rows_per_expert(0, 8, 32, 256) == 0.0


def test_single_rank_slab_result_carries_its_rows_hint():
    """One rank, every id valid: the hint is the mean of the counts (T * K / E), within capacity."""
    d = make_dispatcher(None, 16, 24, layout="slab", capacity=64)
    x, ids, w = torch.randn(30, 24), torch.rand(30, 16).topk(4, dim=1).indices, torch.rand(30, 4)
    res = d.dispatch(x, ids, w)
    assert res.rows_hint == pytest.approx(float(res.counts.float().mean())) == pytest.approx(30 * 4 / 16)
    small = make_dispatcher(None, 16, 24, layout="slab", capacity=3, drop_policy="drop").dispatch(x, ids, w)
    assert small.rows_hint == 3


def _rank_unchecked_wide_ids(rank: int, world: int) -> dict:
    """check_ids=False with int64 ids that do not fit int32: the census counts them as no expert,
    and so must the receivers (the ids travel as int32)."""
    from parallel import ParallelConfig, init_parallel

    groups = init_parallel(ParallelConfig(world_size=world))
    num_experts, hidden = 2 * world, 8
    d = make_dispatcher(groups.ep, num_experts, hidden, check_ids=False)
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(rank))
    # 2**32 + 1 narrows to 1 (rank 0's expert, where token 0 goes for its expert 0);
    # -2**32 + 3 narrows to 3 (rank 1's expert, where token 2 goes for its expert 2)
    ids = torch.tensor([[0, 2**32 + 1], [3, -1], [2, -2**32 + 3]], dtype=torch.int64)
    w = torch.tensor([[0.5, 0.25], [1.0, 0.0], [0.75, 0.125]])
    res = d.dispatch(x, ids, w)
    per_rank = num_experts // world
    y = res.x * (res.expert_ids.float()[:, None] + 1 + rank * per_rank)  # expert e scales by e + 1
    out = d.combine(y, res.handle)
    want = torch.zeros(3, hidden, dtype=torch.float64)
    for t in range(3):
        for k in range(2):
            e = int(ids[t, k])
            if 0 <= e < num_experts:
                want[t] += float(w[t, k]) * (e + 1) * x[t].double()
    return {"counts": res.counts.tolist(), "err": float((out.double() - want).abs().max())}


def test_multirank_unchecked_ids_past_int32_count_as_no_expert():
    """With check_ids=False an id outside [0, E) is no expert. The ids travel as int32, and an
    int64 id past its range used to wrap onto a valid expert on the receiving rank, which the
    census had not counted: that rank's layout broke (an index error, its peer left waiting)."""
    from launch.local import launch_local

    results = launch_local(_rank_unchecked_wide_ids, 2, args=(2,), timeout=90)
    assert [r["counts"] for r in results] == [[2, 0], [2, 2]], results
    assert all(r["err"] < 1e-5 for r in results), results
