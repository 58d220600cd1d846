"""Faults inside collective sequences end in errors on every rank, never in results: a failed
micro-batch poisons the EP dispatcher (rank 0 only fails; both ranks then raise, naming the
failure), async EP honours init_parallel's timeout, EPLB migration commits all tensors or none.
Fault injection on gloo at 2 ranks; every case is bounded by a short group timeout."""

from __future__ import annotations

import datetime
import time
import traceback

import pytest
import torch


def _outcome(fn) -> str:
    """'ok' or 'ExcType: message' of fn()."""
    try:
        fn()
        return "ok"
    except Exception as exc:  # noqa: BLE001 - the test compares the outcome
        return f"{type(exc).__name__}: {exc}"


def _rank_ubatch_failure(rank: int, chunks: int) -> dict[str, str]:
    from moe import MoEConfig, MoELayer
    from parallel import ParallelConfig, destroy_parallel, init_parallel
    import torch.distributed as dist

    from parallel.ubatch import UBatchRunner, get_optional_ubatch

    groups = init_parallel(ParallelConfig(world_size=2), timeout=4)
    try:
        torch.manual_seed(0)  # identical weights on both ranks
        cfg = MoEConfig(hidden=16, inter=8, num_experts=4, top_k=2, num_shared=0, dtype=torch.float32,
                        expert_format="fp32")
        layer = MoELayer(cfg, ep_group=groups.ep, path="host", overlap_chunks=chunks)
        x = torch.randn(12 + rank, 16, generator=torch.Generator().manual_seed(rank))
        want = layer(x)
        runner = UBatchRunner(2, min_tokens=1)
        real = layer._experts

        def faulty(res):
            ctx = get_optional_ubatch()
            if rank == 0 and ctx is not None and ctx.ubatch_id == 1:
                raise RuntimeError("injected expert failure")
            return real(res)

        layer._experts = faulty  # instance attribute: the layer's host path calls it
        t0 = time.monotonic()
        out = {"split": _outcome(lambda: runner.run(layer, x, split=True)), "split_s": f"{time.monotonic() - t0:.1f}"}
        layer._experts = real
        t0 = time.monotonic()

        def again():
            got = layer(x)
            out["max_err"] = f"{(got - want).abs().max().item():.3g}"

        out["next"] = _outcome(again)
        out["next_s"] = f"{time.monotonic() - t0:.1f}"
        # rank 0 stays (its sockets open) until rank 1 is done: rank 1 must fail by the timeout
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=20))
        return out
    finally:
        destroy_parallel()


@pytest.mark.parametrize("chunks", [1, 2])  # 1: yields around dispatch/combine; 2: chunked overlap
def test_failed_microbatch_on_one_rank_poisons_ep_on_every_rank(chunks):
    from launch.local import launch_local

    t0 = time.monotonic()
    results = launch_local(_rank_ubatch_failure, 2, args=(chunks,), timeout=40)
    assert time.monotonic() - t0 < 30, results
    r0, r1 = results
    assert r0["split"].startswith("UBatchError: micro-batch 1 of 2 failed") and "injected" in r0["split"], r0
    # the peer, left inside its combine, fails by init_parallel's timeout (4 s), not torch's 30 min
    assert r1["split"].startswith("UBatchError: micro-batch 1 of 2 failed") and "Timed out" in r1["split"], r1
    assert 3 < float(r1["split_s"]) < 12, r1
    for r in results:  # the next use raises at once rather than pairing with the peer's old collectives
        assert "max_err" not in r and r["next"].startswith("EPPoisonedError: EP dispatch on ranks [0, 1]"), results
        assert float(r["next_s"]) < 1.0, results
    assert "micro-batch 1 of 2 failed: RuntimeError: injected expert failure" in r0["next"], r0  # names the cause
    assert "Timed out" in r1["next"].split("refused")[1], r1


def _rank_late_peer(rank: int, late: str) -> dict[str, str]:
    import torch.distributed as dist

    from parallel import ParallelConfig, destroy_parallel, init_parallel
    from parallel.ep import make_dispatcher

    groups = init_parallel(ParallelConfig(world_size=2), timeout=3)
    try:
        d = make_dispatcher(groups.ep, num_experts=4, hidden=8)
        x = torch.randn(5, 8)
        ids = torch.tensor([[0, 2], [1, 3], [2, 0], [3, 1], [0, 1]])
        w = torch.full((5, 2), 0.5)
        call = lambda: d.dispatch(x, ids, w, async_op=True).wait()  # noqa: E731
        out = {}
        if late == "collective":  # both make the communication thread; then rank 1 comes late
            out["first"] = _outcome(call)
        if rank == 0:
            t0 = time.monotonic()
            out["late"] = _outcome(call)
            out["late_s"] = f"{time.monotonic() - t0:.1f}"
            out["next"] = _outcome(call)
        else:
            time.sleep(8)  # 'late': longer than the 3 s timeout
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=20))

        def recreate():  # what EPPoisonedError tells the user to do
            nonlocal d
            destroy_parallel()
            d = make_dispatcher(init_parallel(ParallelConfig(world_size=2), timeout=3).ep, num_experts=4, hidden=8)

        if late == "collective":
            recreate()
            out["recreated"] = _outcome(call)  # rank 0 was poisoned: no longer
            if rank == 0:
                d.dispatch(x, ids, w, async_op=True)  # its peer never joins: the job times out in 3 s, ...
            recreate()
            time.sleep(3.5)  # ... under the next torch.distributed, whose dispatchers it must not poison
            out["after_stale"] = _outcome(call)
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=20))
        else:
            recreate()
            res = d.dispatch(x, ids, w, async_op=True).wait()  # (its combine runs on the communication thread)
            y = res.x[:-1] if rank == 0 else res.x  # rank 0 passes rows of another layout; rank 1 goes on
            out["refused"] = _outcome(lambda: d.combine(y, res.handle))  # ... into the combine's agreement
            out["after_refused"] = _outcome(call)  # in step on both ranks: nothing poisoned
            # a rank that fails on its own between dispatch and combine (rank 0 never combines): the
            # peer's combine, on the communication thread, fails by init_parallel's timeout
            res = d.dispatch(x, ids, w, async_op=True).wait()
            if rank == 1:
                t0 = time.monotonic()
                out["abandoned"] = _outcome(lambda: d.combine(res.x, res.handle))
                out["abandoned_s"] = f"{time.monotonic() - t0:.1f}"
                out["after_abandoned"] = _outcome(call)  # and it does not try again out of step
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=20))
        return out
    finally:
        destroy_parallel()


@pytest.mark.parametrize("late", ["create", "collective"])
def test_async_ep_takes_the_init_parallel_timeout(late):
    """A peer 8 s late: with timeout=3 the async dispatch fails after ~3 s (torch's default for a
    new group is 30 min), both where it creates its private group and in a collective on it.
    Recreating torch.distributed and the dispatcher then clears the poisoning; a job of the old
    communication thread that fails after that (its peer never came) does not poison the new one
    (it did: the new dispatcher refused, and its peer waited out the timeout). A combine whose
    peer never comes fails by the timeout too, on the communication thread, and poisons the rank;
    a combine that one rank refuses (expert_out of another layout) raises on both ranks through
    the combine's agreement and poisons neither."""
    from launch.local import launch_local

    r0, r1 = launch_local(_rank_late_peer, 2, args=(late,), timeout=40)
    if late == "collective":
        assert r0["first"] == r1["first"] == "ok", (r0, r1)
        assert r0["recreated"] == r1["recreated"] == "ok", (r0, r1)
        assert r0["after_stale"] == r1["after_stale"] == "ok", (r0, r1)
    else:
        # the refusing rank joins the combine's agreement with its error: both raise there, none is poisoned
        assert r0["refused"].startswith("CombineInputError: [rank 0] EP combine: expert_out shape"), r0
        assert r1["refused"].startswith("CombineInputError: [rank 1] EP combine aborted: group rank(s) [0]"), r1
        assert r0["after_refused"] == r1["after_refused"] == "ok", (r0, r1)
        # the peer left alone in its combine fails after ~3 s (torch's default is 30 min), then refuses
        assert r1["abandoned"] != "ok" and 2 < float(r1["abandoned_s"]) < 6.5, r1
        assert r1["after_abandoned"].startswith("EPPoisonedError: EP dispatch on ranks [0, 1]"), r1
        assert "Timed out" in r1["after_abandoned"] or "timed out" in r1["after_abandoned"].lower(), r1
    assert r0["late"] != "ok" and 2 < float(r0["late_s"]) < 6.5, r0
    assert r0["next"].startswith("EPPoisonedError"), r0  # and it does not try again out of step
    # what clears it: destroy_parallel() leaves a torch.distributed the user started up (and its WORLD,
    # under which the failure is recorded), so the message names its own teardown too
    assert "destroy_parallel(); init_parallel()" in r0["next"] and "destroy_process_group()" in r0["next"], r0


# ---- EPLB migration: all tensors or none, MigrationError for a dead peer ----------------------

def _migration_tensors(rank: int, phy2log: list[int]) -> list[torch.Tensor]:
    """Per-slot rows of 4 canonical per-expert tables (bf16, uint8, fp8, fp32) for this rank's 2 slots."""
    g = torch.Generator().manual_seed(7)
    tables = [torch.randn(4, 3, 5, generator=g).to(torch.bfloat16),
              torch.randint(0, 256, (4, 6), generator=g, dtype=torch.uint8),
              (torch.randn(4, 2, 2, generator=g) * 4).to(torch.float8_e4m3fn),
              torch.randn(4, 3, generator=g)]
    mine = torch.tensor(phy2log[rank * 2:(rank + 1) * 2])
    return [t[mine].contiguous() for t in tables]


def _bytes(tensors: list[torch.Tensor]) -> list[list[int]]:
    return [t.reshape(t.shape[0], -1).view(torch.uint8).flatten().tolist() for t in tensors]


OLD, NEW = [0, 1, 2, 3], [2, 1, 0, 3]  # each rank's slot 0 comes from the other rank


def _rank_migration_fault(rank: int, case: str, path: str) -> dict[str, object]:
    import json
    import os

    from parallel import ParallelConfig, destroy_parallel, init_parallel
    from parallel.ep.eplb_migrate import rearrange_weights

    groups = init_parallel(ParallelConfig(world_size=2), timeout=5)
    tensors = _migration_tensors(rank, OLD)
    before = _bytes(tensors)

    def hook(stage: str) -> None:
        if case == "commit" and stage == "commit" and rank == 0:
            raise RuntimeError("injected failure between two tensors' commits")
        if case == "killed" and stage == "unpack" and rank == 1:
            os._exit(3)  # a peer dies mid-migration (after the exchange, before the agreement)

    out: dict[str, object] = {"outcome": _outcome(lambda: rearrange_weights(
        torch.tensor(OLD), torch.tensor(NEW), tensors, groups.ep, fault_hook=hook))}
    after = _bytes(tensors)
    out["untouched"] = [a == b for a, b in zip(after, before)]
    out["all_new"] = after == _bytes(_migration_tensors(rank, NEW))
    with open(f"{path}.{rank}", "w") as f:
        json.dump(out, f)
    if case != "killed":
        destroy_parallel()
    return out


@pytest.mark.parametrize("case", ["commit", "killed"])
def test_migration_commits_all_tensors_or_none(case, tmp_path):
    import json

    from launch.local import RankError, launch_local

    path = str(tmp_path / "rank")
    try:
        launch_local(_rank_migration_fault, 2, args=(case, path), timeout=40)
        assert case == "commit", "rank 1 was killed: launch_local must report it"
    except RankError as exc:
        assert case == "killed" and exc.rank == 1, exc
    ranks = [0, 1] if case == "commit" else [0]
    for rank in ranks:
        with open(f"{path}.{rank}") as f:
            out = json.load(f)
        assert out["outcome"].startswith("MigrationError"), (rank, out)
        assert out["untouched"] == [True] * 4 and not out["all_new"], (rank, out)  # every tensor old
        if case == "commit":
            assert "group ranks [0] failed" in out["outcome"], out
        else:
            assert "agreement" in out["outcome"], out


def test_fp8_token_of_empty_rows_raises_naming_the_shape():
    from moe.quant import quantize

    with pytest.raises(ValueError, match=r"fp8_token needs the last dim K >= 1 .*got shape \(4, 0\)"):
        quantize(torch.randn(4, 0), "fp8_token")
    q = quantize(torch.randn(0, 8), "fp8_token")  # no rows is fine: nothing to scale
    assert q.data.shape == (0, 8) and q.scale.shape == (0, 1)


def test_split_run_keeps_the_callers_autocast():
    """Autocast is thread-local like grad mode: the micro-batch threads must run under the
    caller's, or a split run silently computes in another dtype than the unsplit one."""
    from parallel.ubatch import UBatchRunner

    w = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(2))
    runner = UBatchRunner(2, min_tokens=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = x @ w
        got = runner.run(lambda t: t @ w, x, split=True)
        with torch.autocast("cpu", enabled=False):  # a disabled inner region stays disabled
            plain = runner.run(lambda t: t @ w, x, split=True)
    assert want.dtype == got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert plain.dtype == torch.float32 and torch.equal(plain, x @ w)
