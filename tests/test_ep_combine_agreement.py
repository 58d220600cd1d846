"""EP combine given expert outputs of different dtypes or row widths on different ranks (gloo).

The partial rows go back in expert_out's dtype and width, so the ranks must agree on them. On
CPU the combine now agrees first (one all-gather of a few ints on the route's group): every
rank raises CombineInputError (a ValueError) naming each rank's value, and nothing is poisoned.
On the old code a bf16 expert_out beside an fp32 one made gloo abort the process (the transfer
sizes differ), beside an fp16 one the rows were misread (garbage, no error), and so were rows
of another width. One 2-rank launch runs every case.

An argument that one rank refuses on its own (a foreign handle or none, rows of another layout or
dtype) makes that rank join the same agreement with its error: every rank raises at that combine
and nothing is poisoned. On the old code that rank raised alone and was poisoned, and its peer
waited out the group timeout inside the combine. A second launch runs those cases.
"""

from __future__ import annotations

import torch

from launch.local import launch_local
from tests.helpers import outcome as _outcome



def _rank_cases(rank: int) -> dict[str, str]:
    torch.set_num_threads(1)
    from parallel import ParallelConfig, destroy_parallel, init_parallel
    from parallel.ep import make_dispatcher

    ep = init_parallel(ParallelConfig(world_size=2)).ep
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(5, 8, generator=g)
    ids = torch.tensor([[0, 2], [1, 3], [2, 0], [3, 1], [0, 1]])
    w = torch.full((5, 2), 0.5)
    out: dict[str, str] = {}
    try:
        for backend in ("all_to_all", "allgather"):
            d = make_dispatcher(ep, num_experts=4, hidden=8, backend=backend)
            for other, label in ((torch.float32, "fp32"), (torch.float16, "fp16")):
                res = d.dispatch(x, ids, w)
                y = res.x.to(torch.bfloat16 if rank == 0 else other)
                out[f"{backend}_{label}"] = _outcome(lambda: d.combine(y, res.handle))
            # async dispatch: the combine runs on the communication thread, and so does its agreement
            res = d.dispatch(x, ids, w, async_op=True).wait()
            y = res.x.to(torch.bfloat16 if rank == 0 else torch.float32)
            out[f"{backend}_thread"] = _outcome(lambda: d.combine(y, res.handle, async_op=True).wait())
            # one rank records autograd, its peer does not: only one would run the backward's transfer
            res = d.dispatch(x, ids, w)
            y = res.x.clone().requires_grad_(rank == 0)
            out[f"{backend}_grad"] = _outcome(lambda: d.combine(y, res.handle))
            # nothing was poisoned: a good round trip (identity experts; weights sum to 1 per token)
            res = d.dispatch(x, ids, w, async_op=True).wait()
            got = d.combine(res.x, res.handle)
            out[f"{backend}_after"] = "ok" if torch.allclose(got, x, atol=1e-6) else f"wrong {got}"
        # row widths: packed fp4 x (uint8 [T, H/2]) on a hidden-16 dispatcher beside plain uint8 x
        # [T, 8] on a hidden-8 one pass the census alike (uint8 rows of 8), then combine rows of 16 and 8
        d = make_dispatcher(ep, num_experts=4, hidden=16 if rank == 0 else 8)
        res = d.dispatch(torch.zeros(5, 8, dtype=torch.uint8), ids, w)
        y = torch.ones(res.x.shape[0], d.hidden)
        out["width"] = _outcome(lambda: d.combine(y, res.handle))
    finally:
        destroy_parallel()
    return out


def test_combine_refuses_expert_outputs_of_other_dtypes_or_widths_on_every_rank():
    r0, r1 = launch_local(_rank_cases, 2, timeout=90)
    for backend in ("all_to_all", "allgather"):
        for case, detail in (("fp32", "expert_out dtype: ['torch.bfloat16', 'torch.float32']"),
                             ("fp16", "expert_out dtype: ['torch.bfloat16', 'torch.float16']"),
                             ("thread", "expert_out dtype: ['torch.bfloat16', 'torch.float32']"),
                             ("grad", "autograd records the combine: [1, 0]")):
            for rank, r in enumerate((r0, r1)):
                got = r[f"{backend}_{case}"]
                assert got.startswith(f"CombineInputError: [rank {rank}] EP combine: the ranks of the group disagree "
                                      "(values per group rank) on "), (backend, case, got)
                assert detail in got, (backend, case, got)
            assert r0[f"{backend}_after"] == r1[f"{backend}_after"] == "ok", (backend, r0, r1)
    for rank, r in enumerate((r0, r1)):
        assert r["width"].startswith(f"CombineInputError: [rank {rank}] EP combine:"), r["width"]
        assert "expert_out row width: [16, 8]" in r["width"], r["width"]


def _any_outcome(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares the outcome (EPPoisonedError is no ValueError)
        return f"{type(e).__name__}: {e}"
    return "ok"


# rank 0's bad arguments (rank 1 passes good ones); res: rank 0's DispatchResult, foreign: a handle of another dispatcher
_REFUSED = {
    "layout": (lambda res, foreign: (res.x[:-1], res.handle), "expert_out shape (11, 8) != the dispatched layout (12, 8)"),
    "dtype": (lambda res, foreign: (res.x.to(torch.float8_e4m3fn), res.handle), "expert_out dtype torch.float8_e4m3fn must be bf16"),
    "not_a_tensor": (lambda res, foreign: (res.x.tolist(), res.handle), "expert_out must be a tensor, got list"),
    "foreign": (lambda res, foreign: (res.x, foreign), "this handle was made by another Dispatcher"),
    "not_a_handle": (lambda res, foreign: (res.x, res), "handle must be the CombineHandle of a DispatchResult, got "
                                                        "DispatchResult"),
}


def _rank_refused(rank: int) -> dict[str, str]:
    torch.set_num_threads(1)
    from parallel import ParallelConfig, destroy_parallel, init_parallel
    from parallel.ep import make_dispatcher

    # a short group timeout: on the old code rank 1 waited it out inside the combine
    ep = init_parallel(ParallelConfig(world_size=2), timeout=8).ep
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(rank))
    ids = torch.tensor([[0, 2], [1, 3], [2, 0], [3, 1], [0, 1]])
    w = torch.full((5, 2), 0.5)
    out: dict[str, str] = {}
    try:
        d = make_dispatcher(ep, num_experts=4, hidden=8)
        other = make_dispatcher(ep, num_experts=4, hidden=8)
        for mode in ("sync", "async"):  # async: the dispatch and combine (and its agreement) run on the thread
            asynchronous = mode == "async"
            for case, (bad, _) in _REFUSED.items():
                res = d.dispatch(x, ids, w, async_op=asynchronous)
                res = res.wait() if asynchronous else res
                foreign = other.dispatch(x, ids, w, async_op=asynchronous)
                foreign = (foreign.wait() if asynchronous else foreign).handle
                y, handle = bad(res, foreign) if rank == 0 else (res.x, res.handle)
                out[f"{mode}_{case}"] = _any_outcome(
                    lambda: d.combine(y, handle, async_op=True).wait() if asynchronous else d.combine(y, handle))
                # nothing was poisoned: a good round trip (identity experts; weights sum to 1 per token)
                res = d.dispatch(x, ids, w, async_op=asynchronous)
                res = res.wait() if asynchronous else res
                got = _any_outcome(lambda: out.__setitem__("y", d.combine(res.x, res.handle)))
                out[f"{mode}_{case}_after"] = got if got != "ok" else (
                    "ok" if torch.allclose(out.pop("y"), x, atol=1e-6) else "wrong")
    finally:
        destroy_parallel()
    return out


def test_combine_arguments_one_rank_refuses_raise_on_every_rank_and_poison_nothing():
    """Rank 0 passes combine an argument it refuses on its own (a foreign handle or none, rows of
    another layout or dtype, no tensor); rank 1's are good. Every rank raises CombineInputError at
    that combine (rank 1's names group rank 0), and the next dispatch + combine succeed on both.
    On the old code rank 0 raised alone and was poisoned, and rank 1 waited out the group timeout
    inside the combine."""
    r0, r1 = launch_local(_rank_refused, 2, timeout=60)
    for mode in ("sync", "async"):
        for case, (_, detail) in _REFUSED.items():
            got0, got1 = r0[f"{mode}_{case}"], r1[f"{mode}_{case}"]
            assert got0.startswith("CombineInputError: [rank 0] EP combine: ") and detail in got0, (mode, case, got0)
            assert got1 == ("CombineInputError: [rank 1] EP combine aborted: group rank(s) [0] had invalid input "
                            "(see the error raised there)"), (mode, case, got1)
            assert r0[f"{mode}_{case}_after"] == r1[f"{mode}_{case}_after"] == "ok", (mode, case, r0, r1)
