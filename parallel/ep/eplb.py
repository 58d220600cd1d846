"""Expert-parallel load balancer (EPLB): every public name in one place.

Hot experts make one EP rank the straggler of every MoE layer; EPLB replicates them into
redundant physical slots and packs the replicas so the busiest rank carries close to the mean.
Three modules, each building only on the ones before it:

- `eplb_placement`: the placement algorithm (`rebalance_experts`), replica routing
  (`logical_to_physical`) and balance metrics, pure torch;
- `eplb_migrate`: moving expert weights between EP ranks after a new placement;
- `eplb_state`: the load tracker and the `Eplb` object the MoE layer holds.
"""

from __future__ import annotations

from .eplb_migrate import MigrationError, MigrationStats, rearrange_weights
from .eplb_placement import (Balance, EplbPlan, balancedness, default_phy2log, logical_to_physical,
                             plan_from_phy2log, rank_loads, rebalance_experts)
from .eplb_state import Eplb, EplbConfig, EplbReport, ExpertLoadTracker

__all__ = [
    "EplbPlan", "Balance", "rebalance_experts", "plan_from_phy2log", "default_phy2log", "logical_to_physical",
    "balancedness", "rank_loads", "rearrange_weights", "MigrationError", "MigrationStats",
    "ExpertLoadTracker", "EplbConfig", "Eplb", "EplbReport",
]
