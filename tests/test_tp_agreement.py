"""Plain tensor parallelism (sequence_parallel=False) with one rank's activation of another shape or
dtype (gloo, 2 ranks).

ColumnParallelLinear all-reduces its input's gradient (comm.copy_to_region), RowParallelLinear
its output (comm.reduce_from_region). On the old code a rank with one token more made gloo abort
the process ("Received data size doesn't match"), and a rank with another dtype failed its matmul
alone while its peer waited in the all-reduce (until the group timeout). On CPU the layers and
the region functions now agree first: every rank raises ValueError naming the per-rank values,
and the group stays in step (a good forward + backward follows). One launch runs every case.
"""

from __future__ import annotations

import torch

from launch.local import launch_local
from tests.helpers import outcome as _outcome

T, H, F = 5, 8, 6



def _rank_cases(rank: int) -> dict[str, str]:
    torch.set_num_threads(1)
    from parallel import ParallelConfig, comm, destroy_parallel, init_parallel
    from parallel.sp import ColumnParallelLinear, RowParallelLinear

    # a short group timeout: on the old code the dtype cases left rank 0 waiting in the all-reduce
    tp = init_parallel(ParallelConfig(world_size=2, tp=2), timeout=8).tp
    torch.manual_seed(0)  # the same full weights on both ranks
    lin1, lin2 = torch.nn.Linear(H, F), torch.nn.Linear(F, H)
    col = ColumnParallelLinear.from_full(lin1.weight.detach(), lin1.bias.detach(), tp)
    row = RowParallelLinear.from_full(lin2.weight.detach(), lin2.bias.detach(), tp)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1))
    h = torch.randn(T, F // 2, generator=torch.Generator().manual_seed(2 + rank))
    out: dict[str, str] = {}
    try:
        # rank 1 differs; forward and backward, as a training step would run them
        cases = {
            "col_tokens": lambda: col((x.clone() if rank == 0 else torch.cat([x, x[:1]])).requires_grad_()).sum().backward(),
            "col_dtype": lambda: col(x if rank == 0 else x.bfloat16()).sum().backward(),
            "col_grad": lambda: col(x.clone().requires_grad_(rank == 0)).sum().backward(),
            "row_tokens": lambda: row(h if rank == 0 else torch.cat([h, h[:1]])).sum().backward(),
            "row_dtype": lambda: row(h if rank == 0 else h.bfloat16()).sum().backward(),
            "row_dims": lambda: row(h if rank == 0 else h[None]).sum().backward(),
            "region_copy": lambda: comm.copy_to_region(x if rank == 0 else x[:, :3], tp),
            "region_reduce": lambda: comm.reduce_from_region(x if rank == 0 else x.double(), tp),
        }
        for name, case in cases.items():
            out[name] = _outcome(case)
        # in step afterwards: the layer pair against the unsharded one, forward and gradient of x
        xl = x.clone().requires_grad_()
        y = row(col(xl))
        y.sum().backward()
        xf = x.clone().requires_grad_()
        want = lin2(lin1(xf))
        want.sum().backward()
        ok = torch.allclose(y, want, atol=1e-5) and torch.allclose(xl.grad, xf.grad, atol=1e-5)
        out["after"] = "ok" if ok else f"wrong: {(y - want).abs().max()} {(xl.grad - xf.grad).abs().max()}"
    finally:
        destroy_parallel()
    return out


def test_tensor_parallel_layers_refuse_activations_that_differ_between_ranks_on_every_rank():
    r0, r1 = launch_local(_rank_cases, 2, timeout=60)
    col = "ColumnParallelLinear (sequence_parallel=False) input: the ranks of the group disagree (values per group rank) on "
    row = "RowParallelLinear (sequence_parallel=False) input: the ranks of the group disagree (values per group rank) on "
    expect = {
        "col_tokens": col + "shape[0]: [5, 6]; every rank",
        "col_dtype": col + "dtype: ['torch.float32', 'torch.bfloat16']",
        "col_grad": col + "autograd records it: [1, 0]",
        "row_tokens": row + "shape[0]: [5, 6]",
        "row_dtype": row + "dtype: ['torch.float32', 'torch.bfloat16']",
        "row_dims": row + "dims: [2, 3]; shape[0]: [5, 1]; shape[1]: [3, 5]; shape[2]: [-1, 3]",
        "region_copy": "copy_to_region: the ranks of the group disagree (values per group rank) on shape[1]: [8, 3]",
        "region_reduce": "reduce_from_region: the ranks of the group disagree (values per group rank) on "
                         "dtype: ['torch.float32', 'torch.float64']",
    }
    for name, detail in expect.items():
        for r in (r0, r1):  # the same message on both ranks
            assert r[name].startswith("ValueError: " + detail), (name, r[name])
    assert r0["after"] == r1["after"] == "ok", (r0["after"], r1["after"])
