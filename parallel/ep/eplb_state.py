"""EPLB state held by a model: placement maps, load tracking, periodic rebalancing.

`ExpertLoadTracker` counts tokens per physical slot for the current step (an in-place
`scatter_add_`, CUDA-graph safe) and, at `end_step`, folds them into a window of W steps kept
per LOGICAL expert, using the placement in force during that step; so a window that spans a
rebalance still sums correctly. When a rebalance is due (every N steps) the window is summed
and all-reduced over the EP group (and the expert-data-parallel group, so every EP replica of
the model computes the same placement and gradients stay aligned).

`Eplb` is the one object the MoE layers share (one per model, `num_layers` MoE layers):
the maps of every layer on the device (`phy2log`, fixed-width `log2phy`, `logcnt`, updated in
place so captured graphs stay valid), the tracker, the per-layer weight tensors to migrate,
and `step()` / `maybe_rebalance(step)` / `rebalance()`. How a layer uses it:

    eplb = Eplb(num_layers, num_logical=E, group=groups.ep, config=EplbConfig(num_redundant=32))
    dispatcher = make_dispatcher(groups.ep, num_experts=eplb.num_physical, ...)   # physical slots
    experts hold eplb.slots_per_rank experts: local slot j = logical eplb.local_experts(i)[j]
    eplb.register_weights(i, [w13, w13_scale, w2, w2_scale])                      # [S, ...] each
    forward: phys = eplb.route(i, topk_ids)   # logical -> physical, and counts the tokens
             res = dispatcher.dispatch(x, phys, topk_weights) ...
    once per step on every EP rank, after all layers: report = eplb.step()

Every method that communicates (`step` when due, `rebalance`, `window_load`) must be called on
all ranks of the EP group in the same order.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..comm import GroupLike, all_reduce, input_agreement, resolve_group
from .eplb_placement import (Balance, _as_int, _check_integer, _check_policy, balancedness, default_phy2log,
                             logical_to_physical, plan_from_phy2log, rebalance_experts)
from ..log import get_logger
from .eplb_migrate import MigrationError, MigrationStats, rearrange_weights

log = get_logger(__name__)

__all__ = ["EplbConfig", "ExpertLoadTracker", "Eplb", "EplbReport"]


@dataclass(kw_only=True, frozen=True)
class EplbConfig:
    """Options of the expert-parallel load balancer (the MoE layer's one `eplb=` option)."""

    num_redundant: int = 0
    """extra physical slots: num_physical = num_logical + num_redundant (divisible by EP size)"""
    window: int = 1000
    """steps of load history a rebalance looks at"""
    interval: int = 3000
    """rebalance every `interval` steps"""
    num_groups: int = 1
    """router expert groups (n_group); the hierarchical policy keeps a group on one node"""
    num_nodes: int = 1
    """nodes the EP group spans (ranks numbered node-major)"""
    log_balance: bool = False
    """log balancedness before/after and migration volume at each rebalance"""

    def __post_init__(self) -> None:
        for name in ("num_redundant", "window", "interval", "num_groups", "num_nodes"):
            _as_int(f"EplbConfig.{name}", getattr(self, name))
        for name in ("window", "interval", "num_groups", "num_nodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"EplbConfig.{name} ({getattr(self, name)}) must be >= 1")
        if self.num_redundant < 0:
            raise ValueError(f"EplbConfig.num_redundant ({self.num_redundant}) must be >= 0")


class ExpertLoadTracker:
    """Token counts per layer and physical slot, over a sliding window of steps."""

    def __init__(self, num_layers: int, num_logical: int, num_physical: int, *, window: int = 1000,
                 interval: int = 3000, device: torch.device | str | None = None) -> None:
        num_layers, num_logical = _as_int("num_layers", num_layers), _as_int("num_logical", num_logical)
        num_physical = _as_int("num_physical", num_physical)
        window, interval = _as_int("window", window), _as_int("interval", interval)
        if num_layers < 0:
            raise ValueError(f"num_layers ({num_layers}) must be >= 0")
        if num_logical < 1:
            raise ValueError(f"num_logical ({num_logical}) must be >= 1")
        if num_physical < num_logical:
            raise ValueError(f"num_physical ({num_physical}) must be >= num_logical ({num_logical})")
        if window < 1 or interval < 1:
            raise ValueError(f"window ({window}) and interval ({interval}) must be >= 1")
        self.num_layers, self.num_logical, self.num_physical = num_layers, num_logical, num_physical
        self.window, self.interval = window, interval
        # [L, P + 1] int64: tokens per slot in the current step; column P collects ids of -1
        self.step_counts = torch.zeros(num_layers, num_physical + 1, dtype=torch.int64, device=device)
        # [W, L, E] int32: per-step logical loads, a ring over steps
        self.window_counts = torch.zeros(window, num_layers, num_logical, dtype=torch.int32, device=device)
        self.num_steps = 0

    def record(self, layer: int, physical_ids: torch.Tensor) -> None:
        """Count the tokens routed to each slot. physical_ids: [T, K] int in [0, P), -1 = none.

        Other ids raise ValueError for CPU tensors. On CUDA (no host sync: graph-capturable) they
        are not checked: this runs in every MoE layer of a decode step, on ids that
        `logical_to_physical` makes, and each extra elementwise kernel there costs every step; an
        id below -1 or equal to P counts as none, one past P trips the device's bounds assertion.
        """
        _check_integer("physical_ids", physical_ids)
        num_physical = self.num_physical
        if physical_ids.device.type == "cpu":
            out_of_range = (physical_ids < -1) | (physical_ids >= num_physical)
            if bool(out_of_range.any()):
                where = out_of_range.nonzero()[0].tolist()
                index = ", ".join(map(str, where))
                raise ValueError(f"physical_ids[{index}] = {int(physical_ids[tuple(where)])} is not a physical slot: "
                                 f"valid ids are [0, {num_physical}) and -1 (no expert)")
        ids = physical_ids.reshape(-1).long()
        ids = torch.where(ids < 0, num_physical, ids)          # -1: column P (no expert)
        self.step_counts[layer].scatter_add_(0, ids, torch.ones_like(ids))

    def record_counts(self, layer: int, counts: torch.Tensor) -> None:
        """Add precomputed counts. counts: [P] int >= 0 (checked on CPU), tokens per physical slot."""
        if counts.shape != (self.num_physical,):
            raise ValueError(f"counts must be [num_physical] = [{self.num_physical}], got {tuple(counts.shape)}")
        _check_integer("counts", counts)
        if counts.device.type == "cpu" and bool((counts < 0).any()):
            slot = int((counts < 0).nonzero()[0, 0])
            raise ValueError(f"counts must be non-negative; counts[{slot}] = {int(counts[slot])}")
        self.step_counts[layer, : self.num_physical] += counts.to(self.step_counts.device, torch.int64)

    def end_step(self, phy2log: torch.Tensor) -> bool:
        """Close the step: fold its counts into the window with the placement used during it.

        phy2log: [L, P] int64, the maps in force during the step (values checked on CPU).
        Returns True when a rebalance is due (every `interval` steps).
        """
        want = (self.num_layers, self.num_physical)
        if tuple(phy2log.shape) != want:
            raise ValueError(f"phy2log has shape {tuple(phy2log.shape)}; expected [num_layers, num_physical] = "
                             f"{list(want)}")
        _check_integer("phy2log", phy2log)
        if phy2log.device.type == "cpu" and phy2log.numel() and (phy2log.min() < 0 or phy2log.max() >= self.num_logical):
            raise ValueError(f"phy2log values must lie in [0, {self.num_logical}); got min {phy2log.min().item()}, "
                             f"max {phy2log.max().item()}")
        logical = torch.zeros(self.num_layers, self.num_logical, dtype=torch.int64, device=self.step_counts.device)
        logical.scatter_add_(1, phy2log.to(logical.device), self.step_counts[:, : self.num_physical])
        self.window_counts[self.num_steps % self.window] = logical.to(torch.int32)
        self.step_counts.zero_()
        self.num_steps += 1
        return self.num_steps % self.interval == 0

    def window_load(self, group: GroupLike = None, extra_groups: tuple[GroupLike, ...] = ()) -> torch.Tensor:
        """[L, E] int64 tokens per logical expert over the window, summed over `group` and
        `extra_groups` (collective on each)."""
        load = self.window_counts.sum(dim=0, dtype=torch.int64)
        for g in (group, *extra_groups):
            all_reduce(load, g)
        return load

    def reset(self) -> None:
        self.step_counts.zero_()
        self.window_counts.zero_()


_REBALANCE_FIELDS = ("old phy2log checksum", "new phy2log checksum", "registered layers checksum")


def _checksum(t: torch.Tensor) -> int:
    return zlib.crc32(t.to(torch.int64).contiguous().numpy().tobytes())


@dataclass
class EplbReport:
    """What one rebalance did. Balancedness = mean / max per-rank load on the window's load."""

    step: int
    before: torch.Tensor
    """[L] float64 balancedness of the old placement"""
    after: torch.Tensor
    """[L] float64 balancedness of the placement now in force (old one where migration failed)"""
    overall_before: float
    overall_after: float
    layers_moved: list[int] = field(default_factory=list)
    layers_failed: list[int] = field(default_factory=list)
    migration: MigrationStats = field(default_factory=MigrationStats)
    seconds: float = 0.0

    def summary(self) -> str:
        mb = (self.migration.bytes_sent + self.migration.bytes_received) / 2**20
        text = (f"EPLB step {self.step}: balancedness {self.overall_before:.3f} -> {self.overall_after:.3f}, "
                f"{len(self.layers_moved)} layers moved, {mb:.1f} MiB sent+received, {self.seconds:.2f} s")
        if self.layers_failed:
            text += f", migration FAILED (old placement kept) on layers {self.layers_failed}"
        return text


class Eplb:
    """Placement maps, load tracker and migration for `num_layers` MoE layers over one EP group."""

    def __init__(self, num_layers: int, num_logical: int, *, group: GroupLike = None,
                 config: EplbConfig | None = None, edp_group: GroupLike = None,
                 device: torch.device | str | None = None, phy2log: torch.Tensor | None = None) -> None:
        self.config = config or EplbConfig()
        self.group, self.edp_group = group, edp_group
        _, self.rank, self.ep_size = resolve_group(group)
        num_layers, num_logical = _as_int("num_layers", num_layers), _as_int("num_logical", num_logical)
        if num_layers < 0 or num_logical < 1:
            raise ValueError(f"num_layers ({num_layers}) must be >= 0 and num_logical ({num_logical}) >= 1")
        self.num_layers, self.num_logical = num_layers, num_logical
        self.num_physical = num_logical + self.config.num_redundant
        if self.num_physical % self.ep_size != 0:
            valid = [r for r in range(0, 4 * self.ep_size) if (num_logical + r) % self.ep_size == 0][:4]
            raise ValueError(f"num_logical ({num_logical}) + num_redundant ({self.config.num_redundant}) = "
                             f"{self.num_physical} must be divisible by the EP size ({self.ep_size}); "
                             f"valid num_redundant: {', '.join(map(str, valid))}, ...")
        self.slots_per_rank = self.num_physical // self.ep_size
        # the policy's checks now, not at the first rebalance (`interval` steps into the run)
        _check_policy(num_logical, self.config.num_groups, self.config.num_nodes, self.ep_size)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.max_replicas = self.num_physical - num_logical + 1
        shape = (num_layers, self.num_physical)
        self.phy2log = torch.zeros(shape, dtype=torch.int64, device=self.device)
        self.log2phy = torch.full((num_layers, num_logical, self.max_replicas), -1, dtype=torch.int64,
                                  device=self.device)
        self.logcnt = torch.zeros(num_layers, num_logical, dtype=torch.int64, device=self.device)
        initial = default_phy2log(num_layers, num_logical, self.num_physical) if phy2log is None else phy2log
        self._set_maps(range(num_layers), initial)
        self.tracker = ExpertLoadTracker(num_layers, num_logical, self.num_physical, window=self.config.window,
                                         interval=self.config.interval, device=self.device)
        self.weights: dict[int, list[torch.Tensor]] = {}
        self.fault_hook: Callable[[str], None] | None = None
        """test hook passed to rearrange_weights (see eplb_migrate)"""
        self.reports: list[EplbReport] = []

    # ---- what a layer calls ------------------------------------------------------------

    def local_experts(self, layer: int) -> torch.Tensor:
        """[slots_per_rank] int64 logical expert of each local slot (which weights to load)."""
        start = self.rank * self.slots_per_rank
        return self.phy2log[layer, start : start + self.slots_per_rank]

    def register_weights(self, layer: int, tensors: list[torch.Tensor]) -> None:
        """The layer's per-slot tensors, each [slots_per_rank, ...] contiguous; moved on rebalance."""
        for i, t in enumerate(tensors):
            if t.dim() == 0 or t.shape[0] != self.slots_per_rank:
                raise ValueError(f"layer {layer} tensor {i} has shape {tuple(t.shape)}; dim 0 must be the "
                                 f"{self.slots_per_rank} local slots")
            if not t.is_contiguous():
                raise ValueError(f"layer {layer} tensor {i} must be contiguous (shape {tuple(t.shape)}, "
                                 f"stride {t.stride()}): migration moves its rows in place")
        if len({t.device for t in tensors}) > 1:
            raise ValueError(f"layer {layer} tensors must share one device; got "
                             f"{sorted({str(t.device) for t in tensors})}")
        self.weights[layer] = list(tensors)

    def route(self, layer: int, topk_ids: torch.Tensor, token_index: torch.Tensor | None = None, *,
              record: bool = True) -> torch.Tensor:
        """Logical expert ids [T, K] (-1 = none) -> physical slots [T, K]; counts them when `record`."""
        physical = logical_to_physical(topk_ids, self.log2phy[layer], self.logcnt[layer], token_index)
        if record:
            self.tracker.record(layer, physical)
        return physical

    # ---- what the training / serving loop calls ----------------------------------------

    def step(self) -> EplbReport | None:
        """End of one step (all layers ran): fold the counts; rebalance when due. Collective when due."""
        self.tracker.end_step(self.phy2log)
        return self.maybe_rebalance(self.tracker.num_steps)

    def maybe_rebalance(self, step: int) -> EplbReport | None:
        """Rebalance if `step` is a positive multiple of `config.interval`."""
        if step > 0 and step % self.config.interval == 0:
            return self.rebalance(step=step)
        return None

    def balance(self, load: torch.Tensor | None = None) -> Balance:
        """Balancedness of the current placement on `load` [L, E] (default: the all-reduced window)."""
        load = self.tracker.window_load(self.group, self._extra_groups()) if load is None else load
        return balancedness(load.cpu(), self.phy2log.cpu(), self.ep_size)

    def rebalance(self, load: torch.Tensor | None = None, *, step: int | None = None) -> EplbReport:
        """Compute a new placement from `load` [L, E] (default: the all-reduced window), migrate
        every layer's registered weights and switch its maps. A layer whose migration fails keeps
        its old weights and maps on every rank. A layer without registered weights only gets
        new maps (its owner moves the weights)."""
        start = time.perf_counter()
        if load is None:
            load = self.tracker.window_load(self.group, self._extra_groups())
        old = self.phy2log.cpu()
        error = agreed = None
        try:
            want = (self.num_layers, self.num_logical)
            if not isinstance(load, torch.Tensor) or tuple(load.shape) != want:
                got = tuple(load.shape) if isinstance(load, torch.Tensor) else type(load).__name__
                raise ValueError(f"load must be a tensor [num_layers, num_logical] = {list(want)}, got {got}")
            load = load.detach().cpu()
            if self.num_layers == 0:  # no MoE layer: nothing to place (rebalance_experts needs a layer)
                new = old
            else:
                new = rebalance_experts(load, self.num_physical, self.config.num_groups, self.config.num_nodes,
                                        self.ep_size, old_phy2log=old).phy2log
            agreed = [_checksum(old), _checksum(new), _checksum(torch.tensor(sorted(self.weights), dtype=torch.int64))]
        except ValueError as exc:
            error = str(exc)
        # Each layer's migration is collective, and a rank whose new map equals its old one skips it: ranks
        # given different loads (or holding different maps, or weights of other layers) would wait in a
        # migration their peers never join, or pair one layer's transfers with another's.
        message = input_agreement("EPLB rebalance", _REBALANCE_FIELDS, agreed, error, self.group,
                                  self.tracker.window_counts.device,
                                  hint="every rank must pass the same load (the default, the all-reduced window, "
                                       "is the same) and hold the same maps and registered layers")
        if message is not None:
            raise ValueError(message)
        before = balancedness(load, old, self.ep_size)
        report = EplbReport(step=self.tracker.num_steps if step is None else step, before=before.per_layer,
                            after=before.per_layer, overall_before=before.overall,
                            overall_after=before.overall)
        committed = old.clone()
        own_error: ValueError | None = None
        try:
            for layer in range(self.num_layers):
                if torch.equal(old[layer], new[layer]):
                    continue
                if layer in self.weights:
                    try:
                        report.migration += rearrange_weights(old[layer], new[layer], self.weights[layer],
                                                              self.group, fault_hook=self.fault_hook)
                    except MigrationError as exc:
                        if exc.transport_failed:  # the group is gone: keep the layers already moved, stop
                            raise
                        log.warning("EPLB: layer %d keeps its placement: %s", layer, exc)
                        report.layers_failed.append(layer)
                        continue
                    except ValueError as exc:  # this rank's own tensors: raised once every layer is done,
                        own_error = own_error or exc    # since its peers (a MigrationError) go on to the next
                        report.layers_failed.append(layer)
                        continue
                committed[layer] = new[layer]
                report.layers_moved.append(layer)
        finally:  # also when a layer's migration raised: the layers moved before it keep maps that match
            self._set_maps(report.layers_moved, committed)
        after = balancedness(load, committed, self.ep_size)
        report.after, report.overall_after = after.per_layer, after.overall
        report.seconds = time.perf_counter() - start
        self.reports.append(report)
        if self.config.log_balance:
            log.info("%s", report.summary())
        if own_error is not None:
            raise own_error
        return report

    # ---- persistence -------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"phy2log": self.phy2log.cpu().clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Adopt saved maps (the weights loaded alongside must follow them)."""
        self._set_maps(range(self.num_layers), state["phy2log"])

    # ---- internals ---------------------------------------------------------------------

    def _extra_groups(self) -> tuple[GroupLike, ...]:
        return () if self.edp_group is None else (self.edp_group,)

    def _set_maps(self, layers, phy2log: torch.Tensor) -> None:
        layers = list(layers)
        if not layers:
            return
        want = (self.num_layers, self.num_physical)
        if tuple(phy2log.shape) != want and not (phy2log.dim() == 1 and want == (1, phy2log.shape[0])):
            raise ValueError(f"phy2log has shape {tuple(phy2log.shape)}; expected [num_layers, num_physical] = "
                             f"{list(want)}")
        plan = plan_from_phy2log(phy2log, self.num_logical)  # validates: every expert has a slot
        idx = torch.tensor(layers)
        width = plan.log2phy.shape[2]
        self.phy2log[idx] = plan.phy2log[idx].to(self.device)
        self.logcnt[idx] = plan.logcnt[idx].to(self.device)
        self.log2phy[idx] = -1
        self.log2phy[idx, :, :width] = plan.log2phy[idx].to(self.device)
