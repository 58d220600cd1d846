"""Rank layout: which global ranks form each group of each axis (pure, no torch.distributed).

vLLM-compatible: `grid = arange(world).reshape(ext_dp, dp, pp, pcp, tp)`; the groups of one
axis come from swapping that axis with the last one and reshaping to `(-1, size)` (vLLM's
`transpose(axis, 4)`, which fixes the order in which groups are listed).
DCP (vLLM's rule, whatever PCP is): `grid.reshape(-1, dcp)`, contiguous sub-blocks of each TP
group (`tp % dcp == 0`). With PCP > 1 the KV cache is sharded over the `pcp * dcp` ranks of a
DCP group and its PCP peers ("cp" below), `total_cp_rank = pcp_rank * dcp + dcp_rank`
(docs/numerics.md §8; vLLM's meaning as PCP landed, PR #28718: its current main instead keeps a
full replica per PCP rank, sharded over DCP only); those ranks, in that order, are ascending, so
"cp" is a rank list too.
Every group's rank list is ascending, which is the order torch.distributed gives a new group's
ranks (older torch has no way to ask for another), so a rank's index in the list is its rank
in the communicator.
EP: the DP x PCP x TP ranks of one PP stage (`transpose(dp, pp)`), cut into contiguous blocks
of `ep`; EDP joins the ranks at the same position of those blocks (same experts).
"""

from __future__ import annotations

import torch

from .config import ParallelConfig

AXES = ("tp", "dcp", "pcp", "pp", "dp", "ep", "edp")
CP_AXES = ("cp",)
"""Derived rank lists `rank_groups(cfg, derived=True)` adds: "cp" = the ranks sharing one KV cache."""
_GRID_DIM = {"dp": 1, "pp": 2, "pcp": 3, "tp": 4}


def rank_grid(cfg: ParallelConfig) -> torch.Tensor:
    """[ext_dp, dp, pp, pcp, tp] int64 tensor of global ranks."""
    return torch.arange(cfg.world_size).reshape(-1, cfg.dp, cfg.pp, cfg.pcp, cfg.tp)


def _axis_groups(grid: torch.Tensor, dim: int) -> torch.Tensor:
    return grid.transpose(dim, 4).reshape(-1, grid.shape[dim])


def rank_groups(cfg: ParallelConfig, *, derived: bool = False) -> dict[str, list[list[int]]]:
    """Rank lists per axis: keys tp, dcp, pcp, pp, dp, ep, edp. Each axis partitions the world.

    derived: also "cp", the `pcp * dcp` ranks sharing one KV cache, listed in total_cp_rank order."""
    grid = rank_grid(cfg)
    out: dict[str, list[list[int]]] = {}
    for axis, dim in _GRID_DIM.items():
        out[axis] = _axis_groups(grid, dim).tolist()
    # DCP: contiguous dcp-sized pieces of every TP group (vLLM: all_ranks.reshape(-1, dcp)).
    out["dcp"] = grid.reshape(-1, cfg.dcp).tolist()
    # EP: the dp x pcp x tp ranks of one pp stage, in rank order, cut into contiguous ep blocks.
    stage = grid.transpose(1, 2).reshape(-1, cfg.dp * cfg.pcp * cfg.tp)
    ep_blocks = stage.reshape(stage.shape[0], -1, cfg.ep)          # [stages, edp, ep]
    out["ep"] = ep_blocks.reshape(-1, cfg.ep).tolist()
    out["edp"] = ep_blocks.transpose(1, 2).reshape(-1, cfg.edp).tolist()
    if derived:   # [.., pcp, tp/dcp, dcp] -> (tp/dcp) blocks of pcp x dcp ranks, pcp-major
        cp = grid.reshape(*grid.shape[:3], cfg.pcp, cfg.tp // cfg.dcp, cfg.dcp).transpose(3, 4)
        out["cp"] = cp.reshape(-1, cfg.pcp * cfg.dcp).tolist()
        return {axis: out[axis] for axis in AXES + CP_AXES}
    return {axis: out[axis] for axis in AXES}


def group_of(groups: list[list[int]], rank: int) -> list[int]:
    """The group (rank list) of one axis that holds `rank`."""
    for g in groups:
        if rank in g:
            return g
    raise ValueError(f"rank {rank} is in no group of {groups[:4]}...")


def coords(cfg: ParallelConfig, rank: int) -> dict[str, int]:
    """Position of `rank` on every axis: grid coordinates plus its index in its dcp/ep/edp group,
    and "cp" = total_cp_rank = pcp * dcp + dcp_rank, its shard of the KV cache."""
    if not 0 <= rank < cfg.world_size:
        raise ValueError(f"rank ({rank}) must be in [0, {cfg.world_size})")
    tp = rank % cfg.tp
    pcp = rank // cfg.tp % cfg.pcp
    pp = rank // (cfg.tp * cfg.pcp) % cfg.pp
    dp = rank // (cfg.tp * cfg.pcp * cfg.pp) % cfg.dp
    ext = rank // (cfg.tp * cfg.pcp * cfg.pp * cfg.dp)
    out = {"ext_dp": ext, "dp": dp, "pp": pp, "pcp": pcp, "tp": tp}
    # Position inside the pp stage in (dp, pcp, tp) order -> ep/edp indices.
    stage_pos = (dp * cfg.pcp + pcp) * cfg.tp + tp
    out["ep"] = stage_pos % cfg.ep
    out["edp"] = stage_pos // cfg.ep
    out["dcp"] = tp % cfg.dcp
    out["cp"] = pcp * cfg.dcp + out["dcp"]
    return out


def format_layout(cfg: ParallelConfig, max_groups: int = 16) -> str:
    """Human-readable table of the layout (used by `megapar groups`): the sizes, the groups of
    every axis, and (world <= 64) every rank's coordinates.

    The rank table has an `ext_dp` column only when `cfg.ext_dp > 1`: ranks that differ only in
    their ext_dp replica would otherwise print identical rows. At ext_dp = 1 (the usual case: dp
    defaults to filling the world) that column would be all zeros, so the table is left as it was.
    """
    groups = rank_groups(cfg)
    sizes = cfg.sizes()
    lines = ["sizes: " + "  ".join(f"{k}={v}" for k, v in sizes.items()) + f"  world={cfg.world_size}", ""]
    lines.append(f"{'axis':<5} {'size':>4} {'groups':>6}  ranks")
    for axis in AXES:
        gl = groups[axis]
        shown = "  ".join(str(g) for g in gl[:max_groups]) + ("  ..." if len(gl) > max_groups else "")
        lines.append(f"{axis:<5} {len(gl[0]):>4} {len(gl):>6}  {shown}")
    if cfg.world_size <= 64:
        columns = ("dp", "pp", "pcp", "tp", "dcp", "ep", "edp")
        widths = {a: 4 for a in columns}
        if cfg.ext_dp > 1:
            columns = ("ext_dp",) + columns
            widths["ext_dp"] = len("ext_dp")
        lines += ["", f"{'rank':>4}  " + " ".join(f"{a:>{widths[a]}}" for a in columns)]
        for r in range(cfg.world_size):
            c = coords(cfg, r)
            lines.append(f"{r:>4}  " + " ".join(f"{c[a]:>{widths[a]}}" for a in columns))
    return "\n".join(lines)
