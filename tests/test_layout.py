"""Rank layout and config validation (pure, no processes)."""

from __future__ import annotations

import itertools

import pytest
import torch

from parallel.config import ParallelConfig
from parallel.layout import AXES, coords, rank_groups


def test_dcp_carved_from_tp_example():
    g = rank_groups(ParallelConfig(world_size=8, dp=2, tp=4, dcp=2))
    assert g["tp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["dcp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["ep"] == [list(range(8))]
    assert g["edp"] == [[r] for r in range(8)]


def test_pp_pcp_tp_example():
    g = rank_groups(ParallelConfig(world_size=8, pp=2, pcp=2, tp=2))
    assert g["pcp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert g["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_world_alone_means_dp_and_ep_everywhere():
    cfg = ParallelConfig(world_size=4)
    assert cfg.dp == 4 and cfg.ep == 4
    g = rank_groups(cfg)
    assert g["ep"] == [[0, 1, 2, 3]] and g["dp"] == [[0, 1, 2, 3]]


def test_dcp_is_carved_from_tp_whatever_pcp_is():
    # vLLM: DCP groups are all_ranks.reshape(-1, dcp); the KV cache spans pcp * dcp ranks
    g = rank_groups(ParallelConfig(world_size=8, tp=4, pcp=2, dcp=2), derived=True)
    assert g["dcp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["pcp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["cp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert [coords(ParallelConfig(world_size=8, tp=4, pcp=2, dcp=2), r)["cp"] for r in range(8)] == \
        [0, 1, 0, 1, 2, 3, 2, 3]
    g = rank_groups(ParallelConfig(world_size=8, pcp=2, tp=2, dcp=2), derived=True)
    assert g["dcp"] == [[0, 1], [2, 3], [4, 5], [6, 7]] and g["cp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    g = rank_groups(ParallelConfig(world_size=8, pcp=4, tp=2, dcp=1), derived=True)
    assert g["dcp"] == [[r] for r in range(8)] and g["cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]


def _vllm_cp_coords(cfg: ParallelConfig) -> dict[int, tuple[tuple[int, ...], tuple[int, ...], int]]:
    """vLLM's formulas, written from its parallel_state / block_table code with loops:
    rank -> (its DCP group, its PCP group, total_cp_rank = pcp_rank * dcp + dcp_rank)."""
    all_ranks = list(range(cfg.world_size))
    dcp_groups = [tuple(all_ranks[i:i + cfg.dcp]) for i in range(0, cfg.world_size, cfg.dcp)]
    out = {}
    for r in all_ranks:
        dcp_group = next(g for g in dcp_groups if r in g)
        block = r - r % (cfg.pcp * cfg.tp)                      # first rank of this (ext, dp, pp) cell
        pcp_group = tuple(block + c * cfg.tp + r % cfg.tp for c in range(cfg.pcp))
        out[r] = (dcp_group, pcp_group, pcp_group.index(r) * cfg.dcp + dcp_group.index(r))
    return out


@pytest.mark.parametrize("world,tp,pp,pcp,dcp", [
    (8, 4, 1, 2, 2), (8, 2, 1, 2, 2), (8, 2, 1, 4, 1), (16, 4, 1, 2, 4), (16, 8, 1, 2, 2), (32, 4, 2, 2, 2),
    (48, 4, 1, 3, 2), (64, 8, 2, 2, 4), (16, 2, 2, 2, 2), (24, 6, 1, 2, 3), (8, 8, 1, 1, 8), (4, 1, 1, 4, 1),
])
def test_dcp_groups_and_token_placement_match_vllm(world, tp, pp, pcp, dcp):
    from parallel.cp import DCPLayout

    cfg = ParallelConfig(world_size=world, tp=tp, pp=pp, pcp=pcp, dcp=dcp)
    g = rank_groups(cfg, derived=True)
    ref = _vllm_cp_coords(cfg)
    n = pcp * dcp
    for r in range(world):
        dcp_group, pcp_group, total = ref[r]
        c = coords(cfg, r)
        assert tuple(next(x for x in g["dcp"] if r in x)) == dcp_group
        assert tuple(next(x for x in g["pcp"] if r in x)) == pcp_group
        assert c["dcp"] == dcp_group.index(r) and c["pcp"] == pcp_group.index(r) and c["cp"] == total
        cp_group = next(x for x in g["cp"] if r in x)
        assert len(cp_group) == n and cp_group.index(r) == total, (r, cp_group)
    for block, interleave in ((4, 1), (4, 2), (8, 4)):
        positions = torch.arange(3 * block * n + 5)
        for cp_group in g["cp"]:
            held = torch.zeros_like(positions)
            for r in cp_group:
                total = ref[r][2]
                layout = DCPLayout(size=n, rank=total, block_size=block, interleave=interleave)
                # vLLM: virtual block = block * n, owner = offset // interleave % n, slot in its physical block
                offset = positions % (block * n)
                owner = [(int(p) // interleave) % n for p in positions]
                assert layout.owner(positions).tolist() == owner
                assert ((offset // interleave) % n == total).tolist() == [o == total for o in owner]
                table = torch.arange(100, 100 + positions.numel() // (block * n) + 1)
                slots = layout.slot_mapping(positions, table)
                want = table[positions // (block * n)] * block + (offset // (n * interleave)) * interleave + \
                    offset % interleave
                assert torch.equal(slots, torch.where(offset // interleave % n == total, want, -1))
                held += (slots >= 0).long()
            assert (held == 1).all()                            # every position on exactly one rank


def test_smaller_ep_makes_contiguous_blocks_and_edp_joins_same_experts():
    g = rank_groups(ParallelConfig(world_size=8, tp=2, ep=4))
    assert g["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["edp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def _brute_force_groups(cfg: ParallelConfig, axis: str) -> list[list[int]]:
    """Independent construction from per-rank coordinates (loops, no tensor reshapes)."""
    def rank_of(e, d, p, c, t):
        return (((e * cfg.dp + d) * cfg.pp + p) * cfg.pcp + c) * cfg.tp + t
    ranges = {"e": range(cfg.ext_dp), "d": range(cfg.dp), "p": range(cfg.pp), "c": range(cfg.pcp), "t": range(cfg.tp)}
    fixed = {"tp": "edpc", "pcp": "edpt", "pp": "edct", "dp": "epct"}[axis]
    vary = {"tp": "t", "pcp": "c", "pp": "p", "dp": "d"}[axis]
    groups = set()
    for combo in itertools.product(*(ranges[k] for k in fixed)):
        env = dict(zip(fixed, combo))
        members = []
        for v in ranges[vary]:
            env[vary] = v
            members.append(rank_of(env["e"], env["d"], env["p"], env["c"], env["t"]))
        groups.add(tuple(members))
    return sorted(list(g) for g in groups)


@pytest.mark.parametrize("world,tp,pp,pcp,dcp,ep", [
    (1, 1, 1, 1, 1, None), (16, 4, 1, 2, 2, None), (64, 8, 2, 2, 4, 8), (4096, 8, 4, 4, 8, 64),
    (2048, 4, 2, 1, 4, 16), (24, 2, 3, 2, 1, 4),
])
def test_every_axis_partitions_the_world(world, tp, pp, pcp, dcp, ep):
    cfg = ParallelConfig(world_size=world, tp=tp, pp=pp, pcp=pcp, dcp=dcp, ep=ep)
    g = rank_groups(cfg)
    sizes = cfg.sizes()
    for axis in AXES:
        assert all(grp == sorted(grp) for grp in g[axis]), axis
        flat = sorted(r for grp in g[axis] for r in grp)
        assert flat == list(range(world)), axis
        assert all(len(grp) == sizes[axis] for grp in g[axis]), axis
    for axis in ("tp", "pcp", "pp", "dp"):
        assert sorted(g[axis]) == _brute_force_groups(cfg, axis)
    # EP groups stay inside one PP stage; every DCP group lies inside one TP group
    pp_stage = {r: coords(cfg, r)["pp"] for r in range(world)}
    for grp in g["ep"]:
        assert len({pp_stage[r] for r in grp}) == 1
    tp_group = {r: i for i, grp in enumerate(g["tp"]) for r in grp}
    for grp in g["dcp"]:
        assert len({tp_group[r] for r in grp}) == 1
    # coords agree with the group position
    for axis in ("tp", "pcp", "pp", "dp", "dcp", "ep", "edp"):
        for grp in g[axis][:50]:
            for i, r in enumerate(grp):
                assert coords(cfg, r)[axis] == i, (axis, r)


@pytest.mark.parametrize("kwargs,needles", [
    (dict(world_size=6, tp=4), ["tp (4)", "pp (1)", "pcp (1)", "world_size (6)", "1, 2, 3, 6"]),
    (dict(world_size=8, tp=4, dcp=3), ["dcp (3)", "tp (4)", "valid dcp: 1, 2, 4"]),
    (dict(world_size=8, tp=2, pcp=2, dcp=4), ["dcp (4)", "tp (2)", "pcp 2", "valid dcp: 1, 2"]),
    (dict(world_size=4, pcp=4, dcp=2), ["dcp (2)", "tp (1)", "valid dcp: 1"]),
    (dict(world_size=8, tp=2, ep=3), ["ep (3)", "dp (4)", "= 8", "valid ep: 1, 2, 4, 8"]),
    (dict(world_size=8, tp=2, dp=3), ["dp (3)", "valid dp: 1, 2, 4"]),
    (dict(world_size=8, tp=0), ["tp must be a positive int"]),
])
def test_bad_sizes_name_every_factor(kwargs, needles):
    with pytest.raises(ValueError) as err:
        ParallelConfig(**kwargs)
    for n in needles:
        assert n in str(err.value), (n, str(err.value))


def test_config_is_frozen():
    cfg = ParallelConfig(world_size=2)
    with pytest.raises(Exception):
        cfg.tp = 2  # type: ignore[misc]


def test_format_layout_shows_ext_dp_when_there_are_outer_replicas():
    # The rank table had no ext_dp column: with ext_dp = 2, rank r and rank r + 4 printed the
    # same row. The column appears only where ext_dp > 1 (the ext_dp = 1 table is unchanged).
    from parallel.layout import format_layout

    cfg = ParallelConfig(world_size=8, dp=2, tp=2)
    assert cfg.ext_dp == 2
    lines = format_layout(cfg).splitlines()
    table = lines[lines.index("rank  ext_dp   dp   pp  pcp   tp  dcp   ep  edp"):]
    assert table[1:] == [
        "   0       0    0    0    0    0    0    0    0",
        "   1       0    0    0    0    1    0    1    0",
        "   2       0    1    0    0    0    0    2    0",
        "   3       0    1    0    0    1    0    3    0",
        "   4       1    0    0    0    0    0    0    0",
        "   5       1    0    0    0    1    0    1    0",
        "   6       1    1    0    0    0    0    2    0",
        "   7       1    1    0    0    1    0    3    0",
    ]
    assert len({row.split(maxsplit=1)[1] for row in table[1:]}) == 8   # no two ranks look alike
    plain = format_layout(ParallelConfig(world_size=4, tp=2)).splitlines()
    assert ParallelConfig(world_size=4, tp=2).ext_dp == 1
    assert plain[plain.index("rank    dp   pp  pcp   tp  dcp   ep  edp"):][1:] == [
        "   0     0    0    0    0    0    0    0",
        "   1     0    0    0    1    0    1    0",
        "   2     1    0    0    0    0    2    0",
        "   3     1    0    0    1    0    3    0",
    ]


def _vllm_groups(cfg: ParallelConfig) -> dict[str, list[list[int]]]:
    """Every axis's groups, in vLLM's listing order, from per-rank coordinates with loops (no
    reshapes), after vllm/distributed/parallel_state.py `initialize_model_parallel`:
    all_ranks = arange(world).reshape(-1, dp, pp, pcp, tp); TP = view(-1, tp); DCP =
    reshape(-1, dcp); PCP / PP / DP = transpose(3|2|1, 4).reshape(-1, size); EP =
    transpose(1, 2).reshape(-1, dp * pcp * tp) (megapar: cut into contiguous blocks of `ep`, EDP
    = the same position of those blocks); "cp" = a DCP block and its PCP peers, pcp-major."""
    E, D, P, C, T = cfg.ext_dp, cfg.dp, cfg.pp, cfg.pcp, cfg.tp

    def r(e, d, p, c, t):
        return (((e * D + d) * P + p) * C + c) * T + t
    E_, D_, P_, C_, T_ = (range(n) for n in (E, D, P, C, T))
    g = {
        "tp": [[r(e, d, p, c, t) for t in T_] for e in E_ for d in D_ for p in P_ for c in C_],
        "pcp": [[r(e, d, p, c, t) for c in C_] for e in E_ for d in D_ for p in P_ for t in T_],
        # transpose(2, 4): the remaining dims in the order (ext, dp, tp, pcp)
        "pp": [[r(e, d, p, c, t) for p in P_] for e in E_ for d in D_ for t in T_ for c in C_],
        # transpose(1, 4): (ext, tp, pp, pcp)
        "dp": [[r(e, d, p, c, t) for d in D_] for e in E_ for t in T_ for p in P_ for c in C_],
        "dcp": [list(range(i, i + cfg.dcp)) for i in range(0, cfg.world_size, cfg.dcp)],
    }
    stages = [[r(e, d, p, c, t) for d in D_ for c in C_ for t in T_] for e in E_ for p in P_]
    g["ep"] = [s[i:i + cfg.ep] for s in stages for i in range(0, len(s), cfg.ep)]
    g["edp"] = [[s[b * cfg.ep + j] for b in range(len(s) // cfg.ep)] for s in stages for j in range(cfg.ep)]
    g["cp"] = [[r(e, d, p, c, b * cfg.dcp + j) for c in C_ for j in range(cfg.dcp)]
               for e in E_ for d in D_ for p in P_ for b in range(T // cfg.dcp)]
    return g


def test_every_shape_up_to_16_ranks_matches_vllm_brute_force():
    # world 1..16, every tp x pp x pcp dividing it, every dp (so ext_dp > 1 too), dcp | tp, ep | stage
    def divisors(n):
        return [d for d in range(1, n + 1) if n % d == 0]
    shapes = 0
    for world in range(1, 17):
        for tp, pp, pcp in itertools.product(divisors(world), repeat=3):
            if world % (tp * pp * pcp):
                continue
            for dp in divisors(world // (tp * pp * pcp)):
                for dcp, ep in itertools.product(divisors(tp), divisors(dp * pcp * tp)):
                    cfg = ParallelConfig(world_size=world, tp=tp, pp=pp, pcp=pcp, dp=dp, dcp=dcp, ep=ep)
                    assert cfg.ext_dp * dp * pp * pcp * tp == world
                    got, want = rank_groups(cfg, derived=True), _vllm_groups(cfg)
                    assert got == want, cfg
                    for rank in range(world):
                        c = coords(cfg, rank)
                        for axis in AXES + ("cp",):
                            mine = next(grp for grp in want[axis] if rank in grp)
                            assert c[axis] == mine.index(rank), (cfg, rank, axis)
                    shapes += 1
    assert shapes > 1000


@pytest.mark.parametrize("value", ["false", "0", "no", "", 2, 0.5, [0]])
def test_sequence_parallel_must_be_a_bool(value):
    # bool("false") is True: a flag read from the command line or the environment turned SP on
    with pytest.raises(ValueError, match=r"sequence_parallel must be a bool, got "):
        ParallelConfig(world_size=2, sequence_parallel=value)
    for ok, want in ((True, True), (False, False), (1, True), (0, False), (None, False)):
        assert ParallelConfig(world_size=2, sequence_parallel=ok).sequence_parallel is want


def test_numpy_integer_sizes_are_ints():
    # np.int64(8) (np.prod of a mesh shape) was refused as "world_size must be a positive int";
    # every other config of the project takes numbers.Integral. Stored as plain ints.
    np = pytest.importorskip("numpy")
    cfg = ParallelConfig(world_size=np.int64(16), tp=np.int32(2), pp=np.int64(2), pcp=np.int64(2),
                         dcp=np.int64(2), dp=np.int64(2), ep=np.int64(4))
    plain = ParallelConfig(world_size=16, tp=2, pp=2, pcp=2, dcp=2, dp=2, ep=4)
    assert cfg == plain and rank_groups(cfg) == rank_groups(plain)
    assert all(type(v) is int for v in cfg.sizes().values()) and type(cfg.world_size) is int
    # EP: contiguous blocks of 4 over the (dp, pcp, tp) ranks of each pp stage; stage 0 = 0-3 and 8-11
    assert rank_groups(cfg)["ep"] == [[0, 1, 2, 3], [8, 9, 10, 11], [4, 5, 6, 7], [12, 13, 14, 15]]
    for bad in (np.float64(2.0), np.bool_(True)):
        with pytest.raises(ValueError, match=r"tp must be a positive int, got "):
            ParallelConfig(world_size=4, tp=bad)


def _peers(rank: int, size: int):
    from parallel.p2p import Peers
    return Peers(None, rank, size, tuple(range(size)))   # no process group: only local copies may run


def test_p2p_peer_must_be_a_group_rank():
    # A negative peer indexed `ranks` from the end: -1 on rank 0 of 2 went to rank 1, -2 to this
    # rank itself over the transport; size raised a bare IndexError. Refused before any op is posted.
    from parallel.p2p import P2PExchanger

    ex = P2PExchanger(_peers(0, 2), torch.device("cpu"))
    t, r = torch.ones(3), torch.zeros(3)
    for bad in (-1, -2, 2, 1.0, True):
        with pytest.raises(ValueError, match=rf"peer {bad!r} is not a group rank of this group of 2 \(valid: 0..1"):
            ex.post([(bad, t)], [(1, r)])
        with pytest.raises(ValueError, match=rf"recvs: peer {bad!r} is not a group rank"):
            ex.post([(1, t)], [(bad, r)])
    assert torch.equal(r, torch.zeros(3))


def test_p2p_messages_to_self_pair_up_exactly():
    # Sends to itself and receives from itself are copied in pairs: an extra receive kept its old
    # data (zip dropped it) and a mismatched buffer was broadcast or cast by copy_.
    from parallel.p2p import P2PExchanger

    ex = P2PExchanger(_peers(0, 1), torch.device("cpu"))
    a, b = torch.zeros(2), torch.zeros(2)
    with pytest.raises(ValueError, match=r"1 send\(s\) to itself but 2 receive\(s\) from itself"):
        ex.post([(0, torch.ones(2))], [(0, a), (0, b)])
    with pytest.raises(ValueError, match=r"2 send\(s\) to itself but 0 receive\(s\)"):
        ex.post([(0, torch.ones(2)), (0, torch.ones(2))], [])
    with pytest.raises(ValueError, match=r"message 0 to itself is \(1,\) torch.float32 but its receive buffer is "
                                         r"\(4,\) torch.float32"):
        ex.post([(0, torch.ones(1))], [(0, torch.zeros(4))])
    with pytest.raises(ValueError, match=r"is \(3,\) torch.float32 but its receive buffer is \(3,\) torch.int64"):
        ex.post([(0, torch.tensor([1.7, 2.2, 3.9]))], [(0, torch.zeros(3, dtype=torch.int64))])
    assert torch.equal(a, torch.zeros(2)) and torch.equal(b, torch.zeros(2))
    # matched pairs are copied in order; a size-1 ring shift is a copy
    ex.post([(0, torch.full((2,), 1.0)), (0, torch.full((2,), 2.0))], [(0, a), (0, b)]).wait()
    assert a.tolist() == [1.0, 1.0] and b.tolist() == [2.0, 2.0]
    c = torch.zeros(2, 2, dtype=torch.bfloat16)
    ex.shift([torch.full((2, 2), 3.0, dtype=torch.bfloat16)], [c], send_offset=5, recv_offset=-7).wait()
    assert c.float().tolist() == [[3.0, 3.0], [3.0, 3.0]]
