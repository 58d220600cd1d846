"""ParallelConfig: the sizes of every parallel axis, validated before any group exists.

Ranks form the grid `ExtDP x DP x PP x PCP x TP` (TP fastest, vLLM's order). DCP is carved
out of the TP ranks (contiguous sub-blocks, `tp % dcp == 0`, as in vLLM) and adds no ranks; EP spans the DP x PCP x TP
ranks of one PP stage unless a smaller `ep` dividing it is given. Pure: no torch.distributed.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _fmt(values: list[int]) -> str:
    return ", ".join(str(v) for v in values)


@dataclass(kw_only=True, frozen=True)
class ParallelConfig:
    """Sizes of the parallel axes of one job."""

    world_size: int
    """Total number of ranks."""
    tp: int = 1
    """Tensor-parallel size (fastest-varying axis)."""
    pp: int = 1
    """Pipeline-parallel size."""
    pcp: int = 1
    """Prefill context-parallel size (ring attention over tokens)."""
    dcp: int = 1
    """Decode context-parallel size, carved out of the TP ranks (must divide tp); adds no ranks.
    With pcp > 1 the KV cache is sharded over pcp * dcp ranks."""
    dp: int | None = None
    """Data-parallel size; default world_size // (tp * pp * pcp)."""
    ep: int | None = None
    """Expert-parallel size; default dp * pcp * tp (every rank of a PP stage)."""
    sequence_parallel: bool = False
    """Shard activations over TP between the TP linears (a mode of the TP group)."""

    def __init__(self, world_size: int | None = None, tp: int = 1, pp: int = 1, pcp: int = 1, dcp: int = 1,
                 dp: int | None = None, ep: int | None = None, sequence_parallel: bool = False) -> None:
        if world_size is None:
            raise ValueError("ParallelConfig needs world_size")
        for name, value in (("world_size", world_size), ("tp", tp), ("pp", pp), ("pcp", pcp), ("dcp", dcp),
                            ("dp", 1 if dp is None else dp), ("ep", 1 if ep is None else ep)):
            # not True, 2.0, "2"; numpy integers are ints (np.prod of a mesh shape), as in every other config
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                none = " (or None for the default)" if name in ("dp", "ep") else ""
                raise ValueError(f"{name} must be a positive int{none}, got {value!r}")
        world_size, tp, pp, pcp, dcp = int(world_size), int(tp), int(pp), int(pcp), int(dcp)
        dp, ep = (None if v is None else int(v) for v in (dp, ep))
        # A flag, not a size: bool() of a string ("false", "0", "no") is True, which turned SP on
        # silently. bool / 0 / 1 (numpy bools too) and None (the default, off) are taken.
        if sequence_parallel is not None and sequence_parallel not in (True, False):
            raise ValueError(f"sequence_parallel must be a bool, got {sequence_parallel!r}")
        model = tp * pp * pcp
        if world_size % model != 0:
            valid = [d for d in _divisors(world_size)]
            raise ValueError(
                f"tp ({tp}) x pp ({pp}) x pcp ({pcp}) = {model} must divide world_size ({world_size}); "
                f"products that divide {world_size}: {_fmt(valid)}")
        inferred_dp = world_size // model
        if dp is None:
            dp = inferred_dp
        elif dp < 1 or world_size % (dp * model) != 0:
            valid = [d for d in _divisors(inferred_dp)]
            raise ValueError(
                f"dp ({dp}) x tp ({tp}) x pp ({pp}) x pcp ({pcp}) = {dp * model} must divide world_size "
                f"({world_size}); valid dp: {_fmt(valid)}")
        if tp % dcp != 0:   # vLLM's rule, whatever pcp is: DCP groups are sub-blocks of a TP group
            raise ValueError(f"dcp ({dcp}) must divide tp ({tp}) (DCP groups are carved out of TP groups; "
                             f"pcp {pcp} adds KV shards, not DCP ranks); valid dcp: {_fmt(_divisors(tp))}")
        stage = dp * pcp * tp
        if ep is None:
            ep = stage
        elif ep < 1 or stage % ep != 0:
            raise ValueError(
                f"ep ({ep}) must divide dp ({dp}) x pcp ({pcp}) x tp ({tp}) = {stage}; valid ep: {_fmt(_divisors(stage))}")
        set_ = object.__setattr__
        for name, value in (("world_size", world_size), ("tp", tp), ("pp", pp), ("pcp", pcp), ("dcp", dcp),
                            ("dp", dp), ("ep", ep), ("sequence_parallel", bool(sequence_parallel))):
            set_(self, name, value)

    @property
    def ext_dp(self) -> int:
        """Outer data-parallel replicas beyond `dp` (1 unless dp was given smaller)."""
        return self.world_size // (self.dp * self.pp * self.pcp * self.tp)

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: ranks of one PP stage holding the same experts."""
        return self.dp * self.pcp * self.tp // self.ep

    def sizes(self) -> dict[str, int]:
        return {"ext_dp": self.ext_dp, "dp": self.dp, "pp": self.pp, "pcp": self.pcp, "tp": self.tp,
                "dcp": self.dcp, "ep": self.ep, "edp": self.edp}
