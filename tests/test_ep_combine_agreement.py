"""EP combine given expert outputs of different dtypes or row widths on different ranks (gloo).

The partial rows go back in expert_out's dtype and width, so the ranks must agree on them. On
CPU the combine now agrees first (one all-gather of a few ints on the route's group): every
rank raises CombineInputError (a ValueError) naming each rank's value, and nothing is poisoned.
On the old code a bf16 expert_out beside an fp32 one made gloo abort the process (the transfer
sizes differ), beside an fp16 one the rows were misread (garbage, no error), and so were rows
of another width. One 2-rank launch runs every case.
"""

from __future__ import annotations

import torch

from launch.local import launch_local


def _outcome(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


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
