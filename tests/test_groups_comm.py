"""Process groups and thin collectives on real gloo processes."""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

from launch.local import RankError, launch_local
from parallel import ParallelConfig, destroy_parallel, get_groups, init_parallel
from parallel import comm
from parallel.layout import AXES, rank_groups


def _groups_and_collectives(rank: int, cfg_kwargs: dict) -> dict:
    from torch.distributed import distributed_c10d as c10d

    dist.init_process_group("gloo")  # the caller's: init_parallel reuses it and must leave it up
    baseline = len(c10d._world.pg_map)
    cfg = ParallelConfig(**cfg_kwargs)
    groups = init_parallel(cfg, timeout=123)   # not the default: the mesh must take this one
    assert get_groups() is groups
    layout = rank_groups(cfg)
    out = {}
    for axis in AXES:
        g = groups.axis(axis)
        mine = [grp for grp in layout[axis] if rank in grp][0]
        assert list(g.ranks) == mine and g.rank == mine.index(rank) and g.size == len(mine), (axis, g)
        # sum of (global rank + 1) over the group, and each group rank's position agrees
        t = torch.tensor([float(rank + 1)])
        comm.all_reduce(t, g)
        out[axis] = t.item()
        if g.size > 1:
            who = torch.zeros(g.size)
            who[g.rank] = rank
            dist.all_reduce(who, group=g.group)
            assert who.tolist() == [float(r) for r in g.ranks], (axis, who, g.ranks)
    mesh = groups.device_mesh()
    assert mesh.mesh_dim_names == ("dp", "pp", "pcp", "tp")
    # tp coordinate of the mesh group equals our layout's tp group
    assert sorted(mesh.get_group("tp").__class__.__name__ for _ in range(1)) == ["ProcessGroup"]
    tp_ranks = dist.get_process_group_ranks(mesh.get_group("tp"))
    assert tp_ranks == list(groups.tp.ranks)
    pcp_ranks = dist.get_process_group_ranks(mesh.get_group("pcp"))
    assert pcp_ranks == list(groups.pcp.ranks)
    for dim in mesh.mesh_dim_names:     # the mesh's groups take the job's timeout, not torch's default
        backend = mesh.get_group(dim)._get_backend(torch.device("cpu"))
        assert backend.options._timeout == groups.timeout == datetime.timedelta(seconds=123), dim

    # comm: uneven all-gather / reduce-scatter / all-to-all on the world and on the tp group
    res = {}
    w = groups.world
    n = rank + 1 if rank % 3 else 0                      # rank 0, 3, 6 send nothing
    x = torch.full((n, 3), float(rank)) + torch.arange(3.0)
    gathered = comm.all_gather_uneven(x, w, dim=0)
    res["ag"] = gathered
    gathered_d1 = comm.all_gather_uneven(x.t().contiguous(), w, dim=1)
    res["ag_dim1"] = gathered_d1
    h = comm.all_gather_uneven(x, w, dim=0, async_op=True)
    res["ag_async_equal"] = torch.equal(h.wait(), gathered)
    # fp8 through the uint8 wire
    f8 = (torch.randn(2, 4, generator=torch.Generator().manual_seed(rank)) ).to(torch.float8_e4m3fn)
    g8 = comm.all_gather_uneven(f8, w, dim=0)
    res["fp8"] = (g8.dtype, g8.view(torch.uint8))
    # dtypes gloo lacks (int16 / uint16 / uint32 / uint64) move as bytes; bool too; 1-D and dim=1
    # (values carried as int64 lists: the pickle back to the parent knows no uint16 storages)
    res["wide"] = {}
    for dt in (torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.bool):
        v = (torch.arange(4 * (n + w.size)) * 7 + 1000 * rank).reshape(n + w.size, 4) % 60000
        v = v % 2 == 1 if dt == torch.bool else v.to(dt)
        ag1 = comm.all_gather_uneven(v[:n, 0], w)
        ag2 = comm.all_gather_uneven(v.t(), w, dim=1)
        a2a, _ = comm.all_to_all_uneven(v[:w.size], [1] * w.size, w)
        res["wide"][str(dt)] = [(t.dtype == dt, t.to(torch.int64)) for t in (ag1, ag2, a2a)]
    try:  # sizes that disagree with this rank's x: refused before any collective
        comm.all_gather_uneven(x, w, sizes=[s + 1 for s in comm.gather_sizes(n, w)])
        res["bad_sizes"] = "no error"
    except ValueError as e:
        res["bad_sizes"] = str(e)
    # reduce-scatter with uneven sizes
    sizes = [(i % 3) + 1 for i in range(w.size)]
    full = torch.arange(sum(sizes) * 2, dtype=torch.float32).reshape(-1, 2) * (rank + 1)
    res["rs"] = comm.reduce_scatter_uneven(full, sizes, w, dim=0)
    # all-to-all: send (j + 1) rows to rank j, row value = 100 * src + dst
    send = [j + 1 if (rank + j) % 4 else 0 for j in range(w.size)]
    rows = torch.cat([torch.full((send[j], 2), 100.0 * rank + j) for j in range(w.size)])
    recv, rsplits = comm.all_to_all_uneven(rows, send, w)
    res["a2a"] = (recv, rsplits)
    h = comm.all_to_all_uneven(rows, send, w, recv_splits=rsplits, async_op=True)
    res["a2a_async_equal"] = torch.equal(h.wait()[0], recv)
    out["comm"] = res
    destroy_parallel()
    # destroy drops the groups it made (the mesh's too) and leaves the caller's world up; a
    # second layout then works on the same world
    out["pgs_after_destroy"] = len(c10d._world.pg_map) - baseline
    groups = init_parallel(ParallelConfig(world_size=8, tp=4, dcp=2, pp=2))
    t = torch.tensor([float(rank)])
    comm.all_reduce(t, groups.tp)
    out["second_tp_sum"] = t.item()
    destroy_parallel()
    out["pgs_after_second"] = len(c10d._world.pg_map) - baseline
    dist.destroy_process_group()
    return out


def test_eight_rank_groups_match_layout_and_collectives_sum_right():
    cfg_kwargs = dict(world_size=8, tp=2, pcp=2, dcp=2, ep=4)
    results = launch_local(_groups_and_collectives, 8, args=(cfg_kwargs,), timeout=180)
    # written out from docs/design.md's rule, not from parallel.layout (which the ranks compare
    # their groups with): rank = 4 * dp + 2 * pcp + tp; DCP = TP here (dcp = tp = 2); EP cuts the
    # 8 ranks of the one PP stage into blocks of 4; EDP joins equal positions of those blocks
    expected = {"tp": [[0, 1], [2, 3], [4, 5], [6, 7]], "dcp": [[0, 1], [2, 3], [4, 5], [6, 7]],
                "pcp": [[0, 2], [1, 3], [4, 6], [5, 7]], "pp": [[r] for r in range(8)],
                "dp": [[0, 4], [1, 5], [2, 6], [3, 7]], "ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
                "edp": [[0, 4], [1, 5], [2, 6], [3, 7]]}
    assert {axis: sorted(groups) for axis, groups in rank_groups(ParallelConfig(**cfg_kwargs)).items()} == expected
    world = 8
    for rank, out in enumerate(results):
        for axis in AXES:
            mine = [g for g in expected[axis] if rank in g][0]
            assert out[axis] == sum(r + 1 for r in mine), axis
        res = out["comm"]
        sizes = [(r + 1 if r % 3 else 0) for r in range(world)]
        expect = torch.cat([torch.full((sizes[r], 3), float(r)) + torch.arange(3.0) for r in range(world)])
        assert torch.equal(res["ag"], expect)
        assert torch.equal(res["ag_dim1"], expect.t())
        assert res["ag_async_equal"] and res["a2a_async_equal"]
        dtype, u8 = res["fp8"]
        assert dtype == torch.float8_e4m3fn
        exp8 = torch.cat([torch.randn(2, 4, generator=torch.Generator().manual_seed(r)).to(torch.float8_e4m3fn)
                          .view(torch.uint8) for r in range(world)])
        assert torch.equal(u8, exp8)
        for dt in (torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.bool):
            v = [(torch.arange(4 * (sizes[r] + world)) * 7 + 1000 * r).reshape(sizes[r] + world, 4) % 60000
                 for r in range(world)]
            if dt == torch.bool:
                v = [(t % 2 == 1).long() for t in v]
            (ok1, ag1), (ok2, ag2), (ok3, a2a) = res["wide"][str(dt)]
            assert ok1 and ok2 and ok3, dt
            assert torch.equal(ag1, torch.cat([t[:sizes[r], 0] for r, t in enumerate(v)])), dt
            assert torch.equal(ag2, torch.cat([t.t() for t in v], dim=1)), dt
            assert torch.equal(a2a, torch.stack([v[src][rank] for src in range(world)])), dt
        assert res["bad_sizes"].startswith(f"sizes[{rank}] ({sizes[rank] + 1}) != this rank's x.shape[0]"), res
        rs_sizes = [(i % 3) + 1 for i in range(world)]
        total = sum(range(1, world + 1))
        full = torch.arange(sum(rs_sizes) * 2, dtype=torch.float32).reshape(-1, 2) * total
        off = sum(rs_sizes[:rank])
        assert torch.equal(res["rs"], full[off:off + rs_sizes[rank]])
        recv, rsplits = res["a2a"]
        exp_rows, exp_splits = [], []
        for src in range(world):
            k = rank + 1 if (src + rank) % 4 else 0
            exp_splits.append(k)
            exp_rows.append(torch.full((k, 2), 100.0 * src + rank))
        assert rsplits == exp_splits
        assert torch.equal(recv, torch.cat(exp_rows))
        assert out["pgs_after_destroy"] == 0 and out["pgs_after_second"] == 0, out
        assert out["second_tp_sum"] == sum(range(rank - rank % 4, rank - rank % 4 + 4))


def _callers_world_then_restarts(rank: int) -> dict:
    out: dict = {}
    # the caller's torch.distributed, started without a backend (torch picks one per tensor
    # device: get_backend() says "undefined") and with its own timeout
    dist.init_process_group(timeout=datetime.timedelta(seconds=600))
    try:  # another backend than the running one was ignored: refused, before any group is made
        init_parallel(ParallelConfig(world_size=2), backend="nccl")
    except ValueError as e:
        out["refused"] = str(e)
    groups = init_parallel(ParallelConfig(world_size=2), backend="GLOO", timeout=9)  # dp = ep = every rank
    out["backend"] = groups.backend
    out["timeouts"] = {name: groups.axis(name).group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                       for name in ("world", "dp", "ep")}
    destroy_parallel()
    dist.destroy_process_group()
    # then init_parallel's own torch.distributed, rebuilt three times while the previous groups are
    # still referenced (as layers and dispatchers hold them), a mesh among them (its dp group is
    # a new group of both ranks): the rendezvous store and those groups' connections live on
    sums = []
    for _ in range(3):
        previous = groups  # noqa: F841
        groups = init_parallel(ParallelConfig(world_size=2), timeout=10)
        groups.device_mesh()
        t = torch.tensor([rank + 1.0])
        comm.all_reduce(t, groups.ep)
        sums.append(t.item())
        destroy_parallel()
    out["sums"] = sums
    out["initialized_after"] = dist.is_initialized()
    return out


def test_callers_world_without_backend_and_restarts_after_destroy():
    # A caller's init_process_group() without a backend made groups.backend "undefined" (not
    # "nccl" on a GPU job: the probe, device_mesh and the benchmarks chose the CPU); an explicit
    # timeout did not reach the axes over every rank (they were the caller's WORLD: 600 s here);
    # init_parallel after destroy_parallel hung (or paired with the old connections) while the old
    # groups were alive: group names restart, and the new generation read the old one's keys in
    # the rendezvous store, which lives on.
    results = launch_local(_callers_world_then_restarts, 2, timeout=90)
    for out in results:
        assert out["backend"] == "gloo", out
        assert "backend='nccl', but the caller's torch.distributed already runs on 'gloo'" in out["refused"], out
        assert out["timeouts"] == {"world": 9.0, "dp": 9.0, "ep": 9.0}, out
        assert out["sums"] == [3.0, 3.0, 3.0] and out["initialized_after"] is False, out


def _single_rank(rank: int) -> tuple:
    g = init_parallel(ParallelConfig(world_size=1))
    x = torch.randn(3, 2)
    same = comm.all_gather_uneven(x, g.world) is x
    y, s = comm.all_to_all_uneven(x, [3], g.ep)
    destroy_parallel()
    return same, torch.equal(y, x), s, g.tp.size, g.ep.ranks


def test_one_rank_needs_no_communication():
    assert launch_local(_single_rank, 1) == [(True, True, [3], 1, (0,))]
    # and in-process too, without torch.distributed at all
    for k in ("RANK", "WORLD_SIZE"):
        os.environ.pop(k, None)
    g = init_parallel()
    assert g.world.size == 1 and g.ep.group is None
    destroy_parallel()


def _misbehave(rank: int, mode: str):
    init_parallel(ParallelConfig(world_size=3))
    if rank == 1:
        if mode == "raise":
            raise KeyError("boom on purpose")
        if mode == "exit":
            os._exit(7)
        if mode == "hang":
            time.sleep(1000)
    # the others block in a collective that rank 1 never joins
    t = torch.ones(1)
    dist.all_reduce(t)
    return rank


@pytest.mark.parametrize("mode,needle", [("raise", "rank 1 failed"), ("exit", "rank 1 exited with code 7"),
                                         ("hang", "timed out")])
def test_launch_local_fails_fast_and_leaves_no_process(mode, needle):
    import multiprocessing as mp

    t0 = time.monotonic()
    with pytest.raises(RankError) as err:
        launch_local(_misbehave, 3, args=(mode,), timeout=6 if mode == "hang" else 60)
    elapsed = time.monotonic() - t0
    assert needle in str(err.value)
    if mode == "raise":
        assert "boom on purpose" in str(err.value) and err.value.rank == 1
    assert elapsed < 25, elapsed
    time.sleep(0.2)
    assert [p for p in mp.active_children() if p.name.startswith("megapar-rank")] == []


def test_bad_group_arguments_raise_clearly():
    with pytest.raises(ValueError, match="send_splits"):
        comm.all_to_all_uneven(torch.zeros(3, 2), [1, 1], None)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        launch_local(_single_rank, 0)


# ---- shared pieces: the P2P exchanger, the autograd region pair, even_split --------------------------


def _p2p_and_regions(rank: int, world: int) -> dict:
    from parallel.p2p import P2PExchanger, Peers
    from parallel.sp.ring import ring_all_gather

    g = init_parallel(ParallelConfig(world_size=world))
    peers = Peers.of(g.world)
    ex = P2PExchanger(peers, torch.device("cpu"))
    out: dict = {}
    # ring shifts by +1 and +2, two tensors (one bf16) in one step
    for offset in (1, 2):
        send = [torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * rank,
                torch.full((4,), rank + 0.5, dtype=torch.bfloat16)]
        recv = [torch.empty_like(t) for t in send]
        ex.shift(send, recv, send_offset=offset, recv_offset=-offset).wait()
        out[f"shift{offset}"] = [t.float() for t in recv]
    # all-pairs exchange with per-pair sizes, uint8 payload (how EPLB moves raw bytes)
    sends = [(dst, torch.full((dst + 1, 2), 16 * rank + dst, dtype=torch.uint8)) for dst in range(world)]
    recvs = [(src, torch.empty((rank + 1, 2), dtype=torch.uint8)) for src in range(world)]
    ex.post(sends, recvs).wait()
    out["pairs"] = [t.clone() for _, t in recvs]
    # two steps in flight, waited for in reverse order
    a_recv, b_recv = torch.empty(3), torch.empty(5)
    a = ex.shift([torch.full((3,), float(rank))], [a_recv])
    b = ex.shift([torch.full((5,), float(-rank))], [b_recv], send_offset=-1, recv_offset=1)
    b.wait()
    a.wait()
    out["two"] = (a_recv.clone(), b_recv.clone())
    # the sp ring engine on top of it: consume order and the gathered tensor
    seen: list[int] = []
    (gathered,) = ring_all_gather([torch.full((2, 3), float(rank))], peers, lambda src, blocks: seen.append(src))
    out["ring"] = (seen, gathered)
    # copy_to_region / reduce_from_region: z = sum_r (r + 1) * x, gradients against the closed form
    x = torch.linspace(-1, 1, 6).view(2, 3).requires_grad_()
    c = torch.arange(6.0).view(2, 3)
    y = comm.copy_to_region(x, g.world) * (rank + 1)
    z = comm.reduce_from_region(y, g.world)
    (z * c).sum().backward()
    out["region"] = (z.detach(), x.grad.clone(), y.detach())
    destroy_parallel()
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_p2p_exchanger_and_region_pair_match_references_on_gloo(world):
    results = launch_local(_p2p_and_regions, world, args=(world,), timeout=180)
    total = sum(r + 1 for r in range(world))
    x = torch.linspace(-1, 1, 6).view(2, 3)
    for rank, res in enumerate(results):
        for offset in (1, 2):
            src = (rank - offset) % world
            assert torch.equal(res[f"shift{offset}"][0], torch.arange(6.0).view(2, 3) + 10 * src)
            assert torch.equal(res[f"shift{offset}"][1], torch.full((4,), src + 0.5))
        for src, got in enumerate(res["pairs"]):
            assert torch.equal(got, torch.full((rank + 1, 2), 16 * src + rank, dtype=torch.uint8)), (rank, src)
        a_recv, b_recv = res["two"]
        assert torch.equal(a_recv, torch.full((3,), float((rank - 1) % world)))
        assert torch.equal(b_recv, torch.full((5,), float(-((rank + 1) % world))))
        seen, gathered = res["ring"]
        assert seen == [(rank - s) % world for s in range(world)]
        assert torch.equal(gathered, torch.cat([torch.full((2, 3), float(r)) for r in range(world)]))
        z, grad, y = res["region"]
        torch.testing.assert_close(z, x * total)
        torch.testing.assert_close(y, x * (rank + 1))        # reduce_from_region left its input alone
        torch.testing.assert_close(grad, torch.arange(6.0).view(2, 3) * total)


def _peers_of_a_group_without_this_process(rank: int) -> dict:
    from parallel.groups import Group
    from parallel.p2p import Peers

    dist.init_process_group("gloo")
    pair = dist.new_group([0, 1])   # every rank calls it; rank 2 gets torch's NON_GROUP_MEMBER
    other = Group(name="tp", group=None, rank=min(rank, 1), size=2, ranks=(0, 1))  # rank 2: rank 1's copy
    wrong = Group(name="tp", group=None, rank=0, size=2, ranks=(0, 1))   # rank 1: says group rank 0
    out: dict = {}
    for name, group in (("pg", pair), ("group", other), ("wrong", wrong)):
        try:
            peers = Peers.of(group)
            out[name] = (peers.rank, peers.size, peers.ranks)
        except ValueError as e:
            out[name] = str(e)
    # (no rank leaves before every rank is through init_process_group and new_group: rank 2, which new_group
    # leaves out, could otherwise close its gloo pairs while rank 0 was still connecting them, under load)
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_peers_of_a_group_this_process_is_not_in_raise_value_error():
    """Peers.of on a group that excludes this process gave Peers(rank=-1, size=-1, ranks=()) for
    the NON_GROUP_MEMBER that new_group returns to it (its first step then failed on a confusing
    "group of -1" or an IndexError of the empty ranks), and a Group of other ranks (or one whose rank is not this process's
    place in its ranks) was taken as is: ValueErrors naming the global rank and the group's ranks."""
    results = launch_local(_peers_of_a_group_without_this_process, 3, timeout=60)
    for rank in (0, 1):
        assert results[rank]["pg"] == (rank, 2, (0, 1))
        assert results[rank]["group"] == (rank, 2, (0, 1))
    assert results[0]["wrong"] == (0, 2, (0, 1))
    assert "(global rank 1) is group rank 1 of the group of global ranks [0, 1], but the group says rank 0 of 2" \
        in results[1]["wrong"]
    assert "(global rank 2) is not a member of the group given (rank -1 of -1" in results[2]["pg"]
    assert "NON_GROUP_MEMBER" in results[2]["pg"]
    for name in ("group", "wrong"):
        assert "(global rank 2) is not a member of the group of global ranks [0, 1]" in results[2][name]


def test_even_split_on_awkward_sizes():
    assert comm.even_split(7, 3) == [3, 2, 2]
    assert comm.even_split(0, 3) == [0, 0, 0]
    assert comm.even_split(2, 5) == [1, 1, 0, 0, 0]
    assert comm.even_split(5, 1) == [5]
    for total, parts in ((10**6 + 7, 16), (31, 8), (1, 7), (64, 64)):
        sizes = comm.even_split(total, parts)
        assert len(sizes) == parts and sum(sizes) == total
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    with pytest.raises(ValueError, match=r"total=5 and parts=0"):
        comm.even_split(5, 0)
    with pytest.raises(ValueError, match=r"total=-1"):
        comm.even_split(-1, 2)


def test_launch_env_reads_torchrun_and_slurm_names(monkeypatch):
    from parallel.groups import read_launch_env

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.setenv(k, "0")   # so that monkeypatch restores the original state, RANK copied below included
        monkeypatch.delenv(k)
    env = read_launch_env()
    assert (env.rank, env.world_size, env.local_rank) == (0, 1, None)
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("WORLD_SIZE", "16")      # torchrun's names win over Slurm's
    env = read_launch_env()
    assert (env.rank, env.world_size, env.local_rank) == (5, 16, 1)
    assert os.environ["RANK"] == "5"           # copied for torch.distributed's env:// init
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK='x'"):
        read_launch_env()


def test_megapar_pg_timeout_is_checked_naming_the_variable(monkeypatch):
    # 0 and -5 were taken: every store connect and collective then timed out at once ("timed out
    # after 0ms", nothing naming the variable); 'abc' failed the import with float()'s message
    import subprocess
    import sys

    from parallel.groups import _env_timeout

    needle = "environment variable MEGAPAR_PG_TIMEOUT='{}' must be a number of seconds > 0 ('inf' for none; unset: 300)"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", "import parallel"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=repo, MEGAPAR_PG_TIMEOUT="0"))
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == "ValueError: " + needle.format("0"), \
        proc.stderr[-2000:]
    for raw in ("-5", "abc", "nan", ""):
        monkeypatch.setenv("MEGAPAR_PG_TIMEOUT", raw)
        with pytest.raises(ValueError) as err:
            _env_timeout()
        assert str(err.value) == needle.format(raw)
    for raw, seconds in (("2.5", 2.5), ("inf", 1e9), ("90", 90.0)):
        monkeypatch.setenv("MEGAPAR_PG_TIMEOUT", raw)
        assert _env_timeout() == datetime.timedelta(seconds=seconds)
    monkeypatch.delenv("MEGAPAR_PG_TIMEOUT")
    assert _env_timeout() == datetime.timedelta(seconds=300)


def test_timeouts_configs_and_sizes_are_checked_naming_the_value(monkeypatch):
    import datetime

    from parallel import ParallelConfig, destroy_parallel, get_groups, init_parallel
    from parallel.groups import DEFAULT_TIMEOUT, group_timeout

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    for bad in (0, -1, "5", True, float("nan"), datetime.timedelta(0)):
        with pytest.raises(ValueError, match=r"timeout must be a datetime.timedelta or a number of seconds > 0.*got"):
            init_parallel(timeout=bad)
    with pytest.raises(ValueError, match=r"cfg must be a ParallelConfig or None, got dict .*ParallelConfig\(\*\*cfg\)"):
        init_parallel({"world_size": 1})
    for timeout, seconds in ((None, DEFAULT_TIMEOUT.total_seconds()), (7, 7.0),
                             (datetime.timedelta(seconds=2.5), 2.5)):
        init_parallel(timeout=timeout)
        try:  # kept, and what groups made later take
            assert get_groups().timeout.total_seconds() == seconds == group_timeout().total_seconds()
        finally:
            destroy_parallel()
    assert group_timeout() == DEFAULT_TIMEOUT
    for kw, needle in ((dict(world_size=True), "world_size must be a positive int, got True"),
                       (dict(world_size=2, dp=2.0), "dp must be a positive int (or None for the default), got 2.0"),
                       (dict(world_size=2, ep="2"), "ep must be a positive int (or None for the default), got '2'")):
        with pytest.raises(ValueError) as info:
            ParallelConfig(**kw)
        assert needle in str(info.value)
    assert ParallelConfig(world_size=4, dp=2, tp=2).dp == 2


# ---- the thin collectives against plain single-process formulas, awkward cases ---------------------


def _rank_rows(r: int) -> torch.Tensor:
    """Rank r's [4, n_r, 5] block (n_r = 0, 3, 1, ...: uneven, one rank empty)."""
    n = (0, 3, 1)[r % 3]
    return torch.arange(n * 20, dtype=torch.float32).reshape(4, n, 5) + 100 * r


def _cast(t: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    return (t.long() % 3 == 0) if dt == torch.bool else t.to(dt)


def _bits(t: torch.Tensor) -> torch.Tensor:   # comparable (and picklable) form of any dtype
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


def _plain_vs_comm(rank: int, world: int) -> dict:
    import threading

    g = init_parallel(ParallelConfig(world_size=world)).world
    out: dict = {}
    for dt in (torch.bfloat16, torch.float8_e4m3fn, torch.bool, torch.int64):
        x = _cast(_rank_rows(rank), dt)
        out[f"ag {dt}"] = [_bits(comm.all_gather_uneven(x.transpose(0, 2), g, dim=1)).clone(),   # non-contiguous
                           _bits(comm.all_gather_uneven(x.permute(0, 2, 1), g, dim=-1)).clone(),
                           _bits(comm.all_gather_uneven(x.permute(1, 0, 2), g, dim=0)).clone()]
        send = [(rank + j) % 3 for j in range(world)]
        rows = _cast(torch.cat([torch.full((send[j], 2), 10.0 * rank + j) for j in range(world)]), dt)[:, ::2]
        out[f"a2a {dt}"] = _bits(comm.all_to_all_uneven(rows, send, g)[0]).clone()
    sizes = [(0, 3, 1)[i % 3] for i in range(world)]
    for dt in (torch.bfloat16, torch.int64):
        full = (torch.arange(5 * sum(sizes)).reshape(5, sum(sizes)) * (rank + 1)).to(dt)
        out[f"rs {dt}"] = [comm.reduce_scatter_uneven(full, sizes, g, dim=1).clone(),
                           comm.reduce_scatter_uneven(full.t().contiguous().t(), sizes, g, dim=-1,
                                                      async_op=True).wait().clone()]
    h = comm.all_gather_uneven(_rank_rows(rank)[0], g, async_op=True)
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(h.wait()))
    waiter.start()
    waiter.join()
    out["handle"] = (got[0], h.wait() is got[0])
    out["all_reduce"] = comm.all_reduce(torch.full((3, 2), rank + 1.0, dtype=torch.bfloat16).t(), g).clone()
    out["sizes"] = comm.gather_sizes(rank * 2, g)
    # the region pair: z = sum_r sin(x^T) * (r + 1) on every rank; gradient of x against plain autograd
    x = torch.linspace(-1, 1, 6).view(2, 3).requires_grad_()
    z = comm.reduce_from_region(torch.sin(comm.copy_to_region(x, g).t()) * (rank + 1), g)
    (z * torch.arange(6.0).view(3, 2)).sum().backward()
    out["region"] = (z.detach(), x.grad)
    # arguments that cannot be right, the same on every rank: ValueError naming them, no collective
    # (the all-gather after them still pairs up)
    x = torch.zeros(2, 3)
    bad = {"ag sizes": lambda: comm.all_gather_uneven(x, g, sizes=[5] * world),
           "ag negative": lambda: comm.all_gather_uneven(x, g, sizes=[2] + [-2] * (world - 1)),
           "rs negative": lambda: comm.reduce_scatter_uneven(x, [3, -1] + [0] * (world - 2), g) if world > 1 else
           comm.reduce_scatter_uneven(x, [2, 0], g),
           "a2a negative": lambda: comm.all_to_all_uneven(x, [3] + [-1] * (world - 1), g) if world > 1 else
           comm.all_to_all_uneven(x, [-1], g),
           "a2a recv_splits": lambda: comm.all_to_all_uneven(x, [2] + [0] * (world - 1), g, recv_splits=[2] * (world + 1))}
    for name, call in bad.items():
        try:
            call()
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    out["after"] = comm.all_gather_uneven(torch.full((1,), rank), g)
    destroy_parallel()
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_thin_collectives_match_plain_formulas_on_awkward_inputs(world):
    # negative sizes / splits summing right were taken: reduce_scatter_uneven returned a zero-padded
    # slice longer than its size on one rank and zeros on the other, silently; all_to_all_uneven failed
    # inside gloo; a recv_splits of the wrong length raised gloo's RuntimeError; on one rank,
    # all_gather_uneven returned x for sizes that disagreed with it
    results = launch_local(_plain_vs_comm, world, args=(world,), timeout=120)
    sizes = [(0, 3, 1)[i % 3] for i in range(world)]
    offs = [sum(sizes[:i]) for i in range(world + 1)]
    total = sum(r + 1 for r in range(world))
    for rank, out in enumerate(results):
        for dt in (torch.bfloat16, torch.float8_e4m3fn, torch.bool, torch.int64):
            xs = [_cast(_rank_rows(r), dt) for r in range(world)]
            expect = [torch.cat([t.transpose(0, 2) for t in xs], 1), torch.cat([t.permute(0, 2, 1) for t in xs], -1),
                      torch.cat([t.permute(1, 0, 2) for t in xs], 0)]
            for got, exp in zip(out[f"ag {dt}"], expect):
                assert torch.equal(got, _bits(exp)), dt
            rows = torch.cat([torch.full(((src + rank) % 3, 1), 10.0 * src + rank) for src in range(world)])
            assert torch.equal(out[f"a2a {dt}"], _bits(_cast(rows, dt))), dt
        for dt in (torch.bfloat16, torch.int64):
            full = (torch.arange(5 * offs[-1]).reshape(5, offs[-1]) * total).to(dt)
            for got in out[f"rs {dt}"]:
                assert got.dtype == dt and torch.equal(got, full[:, offs[rank]:offs[rank + 1]]), dt
        got, same = out["handle"]
        assert same and torch.equal(got, torch.cat([_rank_rows(r)[0] for r in range(world)]))
        assert torch.equal(out["all_reduce"], torch.full((2, 3), float(total), dtype=torch.bfloat16))
        assert out["sizes"] == [2 * r for r in range(world)]
        x = torch.linspace(-1, 1, 6).view(2, 3).requires_grad_()
        z = sum(torch.sin(x.t()) * (r + 1) for r in range(world))
        (z * torch.arange(6.0).view(3, 2)).sum().backward()
        torch.testing.assert_close(out["region"][0], z.detach())
        torch.testing.assert_close(out["region"][1], x.grad)
        assert out["ag sizes"].startswith(f"sizes[{rank}] (5) != this rank's x.shape[0] (2)"), out["ag sizes"]
        if world > 1:   # every rank refuses (rank 0, whose own entry is right, too)
            assert out["ag negative"].startswith("sizes") and str([2] + [-2] * (world - 1)) in out["ag negative"], \
                out["ag negative"]
        assert "sizes [" in out["rs negative"] and ">= 0" in out["rs negative"], out["rs negative"]
        assert out["a2a negative"].startswith("send_splits [") and ">= 0" in out["a2a negative"], out["a2a negative"]
        assert out["a2a recv_splits"].startswith(f"recv_splits {[2] * (world + 1)} must have {world} entries"), \
            out["a2a recv_splits"]
        assert torch.equal(out["after"], torch.arange(world)), out["after"]
