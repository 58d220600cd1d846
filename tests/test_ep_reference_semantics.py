"""The EP dispatch/combine contract against DeepEP's normal mode and vLLM's DeepEP finalize.

What the references say an EP dispatch/combine means (DeepEP's legacy ``Buffer`` docstrings and
kernels, vLLM's ``DeepEPHTPrepareAndFinalize``), restated below one token at a time:

- ``topk_idx`` is int64, ``-1`` = no expert for that slot; an id outside ``[0, E)`` is counted
  for no expert and no rank (``get_dispatch_layout`` tests ranges, not ``!= -1``).
- a token goes to a rank once when any of its slots names an expert there (``is_token_in_rank``),
  however many of its slots do; a token with no valid slot goes nowhere.
- received rows are ordered by source rank, then by token index on that rank (intranode).
- each received row carries local expert ids (-1 for slots of other ranks) and the router
  weights of the slots here (0 for slots of other ranks); per-local-expert counts are pair
  counts (a token naming one expert twice counts twice), summed over source ranks.
- DeepEP's normal combine adds the rows sent back WITHOUT weights; vLLM's finalize multiplies
  each (row, slot) output by its weight on the expert rank and sums the slots there first, so
  a token gets ``sum_k w_k f_{e_k}(x_t)`` over its valid slots (duplicates counted each time),
  0 when it has none. DeepEP's low-latency combine applies the weights itself: the same sum.

The project's `Dispatcher` keeps the weighting inside ``combine`` (``weighted=False`` multiplies
on the expert rank, as vLLM's finalize; ``weighted=True`` takes rows already multiplied), and
lays the received pairs out grouped by local expert. These tests run every CPU backend on 2 and
4 gloo ranks over awkward routings and compare counts, received rows (and their order inside
each expert's block), row weights, expert ids and the combined output with the restatement.
``allgather`` receives every token (rank-major) by design, so its ``num_recv_tokens`` is the
total token count; its per-expert rows and combine are the same.
"""

from __future__ import annotations

import torch

from launch.local import launch_local

H = 32  # 4 bf16 int4s a row

# ------------------------------------------------------------------ the reference, one token at a time


def ref_layout(ids: torch.Tensor, num_experts: int, world: int) -> tuple[list[int], list[int], list[list[bool]]]:
    """DeepEP's get_dispatch_layout: (tokens per rank, pairs per expert, is_token_in_rank)."""
    per = num_experts // world
    per_rank, per_expert = [0] * world, [0] * num_experts
    in_rank = []
    for row in ids.tolist():
        here = [False] * world
        for e in row:
            if 0 <= e < num_experts:
                per_expert[e] += 1
                here[e // per] = True
        in_rank.append(here)
        for d in range(world):
            per_rank[d] += here[d]
    return per_rank, per_expert, in_rank


def ref_dispatch(inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], num_experts: int, rank: int
                 ) -> tuple[list[tuple[int, int, list[int], list[float]]], list[int]]:
    """Rows rank `rank` receives: [(source rank, token, local ids, weights)] in arrival order,
    and the pair count of each of its local experts."""
    world = len(inputs)
    per = num_experts // world
    first = rank * per
    rows, counts = [], [0] * per
    for src, (_, ids, w) in enumerate(inputs):
        _, _, in_rank = ref_layout(ids, num_experts, world)
        for t in range(ids.shape[0]):
            if not in_rank[t][rank]:
                continue
            local = [e - first if first <= e < first + per else -1 for e in ids[t].tolist()]
            weights = [float(wk) if lk >= 0 else 0.0 for lk, wk in zip(local, w[t].tolist())]
            rows.append((src, t, local, weights))
            for lk in local:
                if lk >= 0:
                    counts[lk] += 1
    return rows, counts


def expert_fn(e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert e of the tests: y = (e + 1) x - e (different for every expert; exact on the test values)."""
    return (e + 1) * x - e


def ref_combine(inputs, num_experts: int, rank: int, *, slot_dtype: torch.dtype | None = None,
                wire_dtype: torch.dtype | None = None) -> torch.Tensor:
    """What rank `rank`'s tokens get back: per rank holding one of its experts, that rank's sum
    over its slots of w * f(x) (vLLM's finalize), then DeepEP's unweighted sum over ranks (float64).

    slot_dtype: each w * f(x) rounded to it (vLLM multiplies in place in the activations' dtype;
    the project's weighted=True rows); wire_dtype: each rank's partial sum rounded to it (what
    travels back: bf16 through DeepEP's combine)."""
    world = len(inputs)
    per = num_experts // world
    rnd = lambda v, dt: v if dt is None else v.to(dt).double()  # noqa: E731
    x = inputs[rank][0].double()
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for d in range(world):
        partial = torch.zeros_like(out)
        for src, t, local, weights in ref_dispatch(inputs, num_experts, d)[0]:
            if src != rank:
                continue
            for lk, wk in zip(local, weights):
                if lk >= 0:
                    partial[t] += rnd(wk * expert_fn(d * per + lk, x[t]), slot_dtype)
        out += rnd(partial, wire_dtype)
    return out


# ------------------------------------------------------------------ routings


def _x(rank: int, t: int, g: torch.Generator) -> torch.Tensor:
    """x rows that name their (rank, token) in the first two columns; small dyadic values (exact in bf16)."""
    x = torch.randint(-4, 5, (t, H), generator=g).float() / 4
    if t:
        x[:, 0], x[:, 1] = rank, torch.arange(t).float()
    return x


def routing(case: str, rank: int, world: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [T, H] fp32, topk_ids [T, K] int64, topk_weights [T, K] fp32) of `rank` in `case`."""
    g = torch.Generator().manual_seed(1000 * world + 17 * rank + len(case))
    per = num_experts // world
    if case == "mixed":  # -1 slots, a token with none, repeats, K > experts per rank, an empty rank
        t = [6, 0, 9, 4][rank]
        k = per + 2
        ids = torch.randint(0, num_experts, (t, k), generator=g)
        ids[torch.rand(t, k, generator=g) < 0.3] = -1
        if t:
            ids[0] = -1  # no expert at all: sent nowhere, combines to 0
        if t > 2:
            ids[1, :2] = ids[1, 2] = (rank + 1) % num_experts  # one expert in three slots
            ids[2] = torch.arange(k) % num_experts  # K consecutive experts: spans ranks
    elif case == "one_rank":  # every token of every rank to rank 0's experts: the others receive nothing
        t, k = [5, 3, 4, 2][rank], 2
        ids = torch.randint(0, per, (t, k), generator=g)
    elif case == "one_expert":  # every pair to the last expert, twice per token
        t, k = [3, 4, 1, 2][rank], 2
        ids = torch.full((t, k), num_experts - 1, dtype=torch.int64)
    else:
        raise ValueError(case)
    w = torch.randint(1, 8, ids.shape, generator=g).float() / 8
    return _x(rank, ids.shape[0], g), ids.long(), w


CASES = ("mixed", "one_rank", "one_expert")


def test_reference_restatement_on_a_hand_example():
    """The restatement itself on a routing small enough to check by hand (E = 4, 2 ranks)."""
    ids0 = torch.tensor([[0, 3], [1, 1], [-1, -1], [2, 7]])  # 7 >= E: no expert, no rank
    ids1 = torch.tensor([[3, -1]])
    w0 = torch.tensor([[0.5, 0.25], [1.0, 2.0], [4.0, 4.0], [0.125, 8.0]])
    w1 = torch.tensor([[0.75, 3.0]])
    x0, x1 = torch.arange(4.0)[:, None].repeat(1, 2), torch.full((1, 2), 10.0)
    assert ref_layout(ids0, 4, 2) == ([2, 2], [1, 2, 1, 1], [[True, True], [True, False], [False, False],
                                                             [False, True]])
    inputs = [(x0, ids0, w0), (x1, ids1, w1)]
    rows0, counts0 = ref_dispatch(inputs, 4, 0)
    assert rows0 == [(0, 0, [0, -1], [0.5, 0.0]), (0, 1, [1, 1], [1.0, 2.0])] and counts0 == [1, 2]
    rows1, counts1 = ref_dispatch(inputs, 4, 1)
    assert rows1 == [(0, 0, [-1, 1], [0.0, 0.25]), (0, 3, [0, -1], [0.125, 0.0]), (1, 0, [1, -1], [0.75, 0.0])]
    assert counts1 == [1, 2]
    out0 = ref_combine(inputs, 4, 0)
    # token 0: 0.5 f0(0) + 0.25 f3(0) = 0 + 0.25 * (-3); token 1: (1 + 2) f1(1) = 3 * 1; token 2: 0;
    # token 3: 0.125 f2(3) = 0.125 * 7
    assert out0[:, 0].tolist() == [-0.75, 3.0, 0.0, 0.875]
    assert ref_combine(inputs, 4, 1)[:, 0].tolist() == [0.75 * (4 * 10 - 3)]


# ------------------------------------------------------------------ the project on gloo ranks


def _compare(d, r, inputs, num_experts: int, rank: int, backend: str, dtype: torch.dtype, weighted: bool) -> list[str]:
    """Differences between DispatchResult `r` (+ its combine) and the restatement (empty = none)."""
    world = len(inputs)
    per = num_experts // world
    rows, counts = ref_dispatch(inputs, num_experts, rank)
    bad = []
    if r.counts.dtype != torch.int32 or r.counts.tolist() != counts:
        bad.append(f"counts {r.counts.tolist()} ({r.counts.dtype}) != {counts}")
    want_recv = sum(i[0].shape[0] for i in inputs) if backend == "allgather" else len(rows)
    if r.num_recv_tokens != want_recv:
        bad.append(f"num_recv_tokens {r.num_recv_tokens} != {want_recv}")
    if r.topk_weights.dtype != torch.float32 or r.expert_ids.dtype != torch.int32:
        bad.append(f"row weights {r.topk_weights.dtype} / expert ids {r.expert_ids.dtype}")
    offsets = r.offsets.tolist()
    for e in range(per):
        # the pairs of expert e in arrival order (rows by source rank then token; a row's slots in order)
        want = [(src, t, wk) for src, t, local, weights in rows for lk, wk in zip(local, weights) if lk == e]
        block = slice(offsets[e], offsets[e] + counts[e])
        got_x = r.x[block].float()
        got = [(int(xr[0]), int(xr[1]), float(wr)) for xr, wr in zip(got_x, r.topk_weights[block])]
        if got != want:
            bad.append(f"expert {e}: rows (rank, token, weight) {got} != {want}")
            continue
        if not all(torch.equal(got_x[i], inputs[s][0][t].to(dtype).float()) for i, (s, t, _) in enumerate(want)):
            bad.append(f"expert {e}: row values differ from the senders' x")
        if not bool((r.expert_ids[block] == e).all()):
            bad.append(f"expert {e}: expert_ids {r.expert_ids[block].tolist()}")
    # padding rows (align > 1): weight 0, expert id -1
    valid = torch.zeros(r.x.shape[0], dtype=torch.bool)
    for e in range(per):
        valid[offsets[e]:offsets[e] + counts[e]] = True
    if bool((r.expert_ids[~valid] != -1).any()) or bool((r.topk_weights[~valid] != 0).any()):
        bad.append("padding rows carry an expert id or a weight")
    # experts: y = f_e(x) on each valid row (padding rows hold garbage on purpose)
    ids = r.expert_ids.long()
    y = expert_fn(rank * per + ids.clamp(min=0)[:, None], r.x.float())
    y = torch.where(valid[:, None], y, torch.full_like(y, 1e30))  # a padding row that reached a token would show
    if weighted:
        y = torch.where(valid[:, None], (y * r.topk_weights[:, None]).to(dtype).float(), y)
    out = d.combine(y.to(dtype), r.handle, weighted=weighted)
    # partial sums travel in expert_out's dtype (fp32 for allgather, whose collective sums), as
    # through DeepEP's combine; weighted rows were rounded to it per slot
    want_out = ref_combine([(i[0].to(dtype).float(), i[1], i[2]) for i in inputs], num_experts, rank,
                           slot_dtype=dtype if weighted else None,
                           wire_dtype=torch.float32 if backend == "allgather" else dtype)
    if out.dtype != dtype or out.shape != want_out.shape or not torch.equal(out.double(), want_out.to(dtype).double()):
        diff = (out.double() - want_out).abs().max().item() if out.shape == want_out.shape and out.numel() else None
        bad.append(f"combine ({dtype}, weighted={weighted}) differs from the reference: max |diff| {diff}")
    return bad


def _rank(rank: int, world: int) -> dict:
    from parallel import ParallelConfig, destroy_parallel, init_parallel
    from parallel.ep import make_dispatcher

    groups = init_parallel(ParallelConfig(world_size=world))
    problems: dict[str, list[str]] = {}
    try:
        pg = groups.ep.group
        num_experts = 2 * world
        for case in CASES:
            inputs = [routing(case, s, world, num_experts) for s in range(world)]
            x, ids, w = inputs[rank]
            for backend in ("all_to_all", "allgather"):
                for variant, dtype, weighted, align, ids_dtype, async_op in (
                        ("fp32", torch.float32, False, 1, torch.int64, False),
                        ("bf16 int32-ids weighted align4", torch.bfloat16, True, 4, torch.int32, False),
                        ("fp32 async", torch.float32, False, 1, torch.int64, True)):
                    d = make_dispatcher(pg, num_experts, H, backend=backend, align=align)
                    r = d.dispatch(x.to(dtype), ids.to(ids_dtype), w, async_op=async_op)
                    r = r.wait() if async_op else r
                    bad = _compare(d, r, inputs, num_experts, rank, backend, dtype, weighted)
                    if bad:
                        problems[f"{case}/{backend}/{variant}"] = bad
            # ids outside [0, E) with check_ids=False: DeepEP's layout counts them for no expert and no rank
            if ids.numel():
                odd = ids.clone()
                odd[ids == -1] = num_experts + 3
                d = make_dispatcher(pg, num_experts, H, check_ids=False)
                r = d.dispatch(x, odd, w)
                bad = _compare(d, r, inputs, num_experts, rank, "all_to_all", torch.float32, False)
            else:  # (an empty rank still joins the collectives)
                d = make_dispatcher(pg, num_experts, H, check_ids=False)
                bad = _compare(d, d.dispatch(x, ids, w), inputs, num_experts, rank, "all_to_all", torch.float32,
                               False)
            if bad:
                problems[f"{case}/out-of-range ids"] = bad
        return problems
    finally:
        destroy_parallel()


def test_dispatch_combine_match_the_reference_on_2_ranks():
    for rank, problems in enumerate(launch_local(_rank, 2, args=(2,), timeout=120)):
        assert not problems, (rank, problems)


def test_dispatch_combine_match_the_reference_on_4_ranks():
    for rank, problems in enumerate(launch_local(_rank, 4, args=(4,), timeout=180)):
        assert not problems, (rank, problems)
