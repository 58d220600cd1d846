"""Sequence-parallel ops given shards of different sizes (or dtypes, or options) on different ranks.

The SP collectives move equal shards (uneven token counts are padded first, `sp_shard`), so a
rank whose shard differs is refused: on CPU every rank raises ValueError naming the per-rank
values, before anything moves, and the group stays usable. On the old code these calls made
gloo abort the process (transfer sizes differ) or returned misread bytes (bf16 beside fp16).
One 2-rank launch runs every case.
"""

from __future__ import annotations

import torch

from launch.local import launch_local
from tests.helpers import outcome as _outcome



def _rank_cases(rank: int) -> dict[str, str]:
    torch.set_num_threads(1)
    from parallel import ParallelConfig, destroy_parallel, init_parallel
    from parallel.sp import (all_gather_fp8, all_gather_matmul, all_gather_matmul_fp8, matmul_reduce_scatter,
                             matmul_reduce_scatter_fp8, quantize_fp8_per_token, rms_norm_quantize_all_gather,
                             sp_all_gather, sp_reduce_scatter, sp_shard)

    tp = init_parallel(ParallelConfig(world_size=2, tp=2)).tp
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 4, generator=g)
    one_more = 1 if rank == 1 else 0  # rank 1 holds one row more
    out: dict[str, str] = {}
    try:
        out["all_gather_rows"] = _outcome(lambda: sp_all_gather(torch.randn(3 + one_more, 8), tp))
        # same bytes per element, other dtype: the gather used to succeed and misread rank 1's rows
        dt = torch.bfloat16 if rank == 0 else torch.float16
        out["all_gather_dtype"] = _outcome(lambda: sp_all_gather(torch.ones(3, 8, dtype=dt), tp))
        out["all_gather_middle_dim"] = _outcome(lambda: sp_all_gather(torch.randn(2, 3 + one_more, 8), tp, dim=1))
        out["reduce_scatter_hidden"] = _outcome(lambda: sp_reduce_scatter(torch.randn(4, 8 + one_more), tp))
        out["reduce_scatter_tokens"] = _outcome(lambda: sp_reduce_scatter(torch.randn(4 + one_more, 8), tp))
        for backend in ("decomposed", "reference"):
            out[f"agm_{backend}"] = _outcome(lambda: all_gather_matmul(torch.randn(3 + one_more, 8), [w], tp,
                                                                       backend=backend))
            out[f"mrs_{backend}"] = _outcome(lambda: matmul_reduce_scatter(torch.randn(4 + 2 * one_more, 8), w, tp,
                                                                           backend=backend))
        out["agm_backends"] = _outcome(lambda: all_gather_matmul(
            torch.randn(3, 8), [w], tp, backend="decomposed" if rank == 0 else "reference"))
        # a bad argument on one rank only: the peer raises too instead of waiting in the gather
        out["agm_bad_weight_one_rank"] = _outcome(lambda: all_gather_matmul(
            torch.randn(3, 8), [w if rank == 0 else torch.randn(5, 4)], tp))
        q = quantize_fp8_per_token(torch.randn(3 + one_more, 32))
        out["all_gather_fp8"] = _outcome(lambda: all_gather_fp8(q, tp))
        out["norm_quantize_gather"] = _outcome(lambda: rms_norm_quantize_all_gather(
            torch.randn(3 + one_more, 32), torch.ones(32), tp))
        w8 = torch.randn(32, 16, generator=g)
        out["agm_fp8"] = _outcome(lambda: all_gather_matmul_fp8(torch.randn(3 + one_more, 32), [w8], tp))
        out["mrs_fp8_out_dtype"] = _outcome(lambda: matmul_reduce_scatter_fp8(
            torch.randn(4, 32), w8, tp, out_dtype=torch.bfloat16 if rank == 0 else torch.float32))
        # sp_shard moves nothing forward; its backward gathers shards of ceil(T / P) rows: 3 and 4 here
        x = torch.randn(6 + 2 * one_more, 8, requires_grad=True)
        out["shard_backward"] = _outcome(lambda: sp_shard(x, tp).sum().backward())
        # the group is still in step: an even call works
        y = torch.full((2, 8), float(rank))
        out["even_after"] = "ok" if torch.equal(sp_all_gather(y, tp), torch.cat([torch.zeros(2, 8),
                                                                                torch.ones(2, 8)])) else "wrong"
    finally:
        destroy_parallel()
    return out


def test_sp_ops_refuse_shards_that_differ_between_ranks_on_every_rank():
    """Every case raises ValueError on both ranks, naming the per-rank values that differ (both
    ranks get the same message, the bad-argument case aside: there the bad rank gets its own)."""
    r0, r1 = launch_local(_rank_cases, 2, timeout=90)
    shapes = {
        "all_gather_rows": "x_shard.shape[0]: [3, 4]",
        "all_gather_dtype": "dtype: ['torch.bfloat16', 'torch.float16']",
        "all_gather_middle_dim": "x_shard.shape[1]: [3, 4]",
        "reduce_scatter_hidden": "x.shape[1]: [8, 9]",
        "reduce_scatter_tokens": "x.shape[0]: [4, 5]",
        "agm_decomposed": "x_shard.shape[0]: [3, 4]",
        "agm_reference": "x_shard.shape[0]: [3, 4]",
        "mrs_decomposed": "x.shape[0]: [4, 6]",
        "mrs_reference": "x.shape[0]: [4, 6]",
        "agm_backends": "backend (0: local, 1: symm_mem, 2: decomposed, 3: reference): [2, 3]",
        "all_gather_fp8": "q_shard.data.shape[0]: [3, 4]",
        "norm_quantize_gather": "x_shard.shape[0]: [3, 4]",
        "agm_fp8": "q.data.shape[0]: [3, 4]",
        "mrs_fp8_out_dtype": "out_dtype: ['torch.bfloat16', 'torch.float32']",
        "shard_backward": "grad.shape[0]: [3, 4]",
    }
    for case, detail in shapes.items():
        for r in (r0, r1):
            assert r[case].startswith("ValueError: ") and "the ranks of the group disagree" in r[case], (case, r[case])
            assert detail in r[case], (case, detail, r[case])
        assert r0[case] == r1[case], case
    assert "uneven token counts are not supported" in r0["all_gather_rows"], r0["all_gather_rows"]
    assert r1["agm_bad_weight_one_rank"].startswith("ValueError: all_gather_matmul: weight 0 has shape (5, 4)"), r1
    assert r0["agm_bad_weight_one_rank"] == ("ValueError: all_gather_matmul aborted: group rank(s) [1] had invalid "
                                             "input (see the error raised there)"), r0
    assert r0["even_after"] == r1["even_after"] == "ok", (r0, r1)
