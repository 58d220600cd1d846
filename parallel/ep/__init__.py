"""Expert parallelism: token dispatch/combine across EP ranks (and EPLB in `parallel.ep.eplb`).

    from megapar.parallel.ep import make_dispatcher
    d = make_dispatcher(groups.ep, num_experts=256, hidden=7168)        # backend="auto"
    res = d.dispatch(x, topk_ids, topk_weights)    # res.x grouped by local expert, res.counts
    y = d.combine(expert_out, res.handle)          # [T, H], sum_k w_k * y_k in fp32

Modules: `dispatch` (the Dispatcher, autograd), `backends` (transports and the census),
`layout` (local permute plan and the torch data movers), `triton_permute` (CUDA kernels),
`nvshmem` / `nvshmem_kernels` (device-initiated transfers over NVSHMEM: backend "nvshmem" and the
low-latency `NvshmemTransport`; options `NvshmemConfig`), `deepep` (DeepEP's Buffer: backend
"deepep" and `DeepEPLowLatency`; options `DeepEPConfig`). A transport's options reach the
dispatcher as ``make_dispatcher(..., backend="nvshmem", backend_config=NvshmemConfig(mode="normal"))``.

Errors: `DispatchInputError` (bad input found by a dispatch's census, raised on every EP rank
together), `CombineInputError` (a DispatchInputError: combine arguments refused or differing
between the ranks, raised on every EP rank together by the combine's agreement), `EPPoisonedError`
(this rank's EP collectives are out of step after an earlier failure). The two input errors
are ValueErrors and poison nothing.
"""

from megapar.parallel.ep.dispatch import (CombineHandle, CombineInputError, DispatcherConfig, DispatchInputError,
                                           DispatchResult, Dispatcher, EPPoisonedError, make_dispatcher)
from megapar.parallel.ep.eplb import (Eplb, EplbConfig, EplbPlan, balancedness, logical_to_physical, rearrange_weights,
                              rebalance_experts)
from megapar.parallel.ep.layout import LayoutPlan, gather_reduce, gather_rows, plan_layout

from megapar.parallel.ep import deepep as _deepep  # noqa: E402  (backends "deepep", "nvshmem": their packages load lazily)
from megapar.parallel.ep import nvshmem as _nvshmem  # noqa: E402
from megapar.parallel.ep.deepep import DeepEPConfig  # noqa: E402
from megapar.parallel.ep.nvshmem import NvshmemConfig  # noqa: E402

_nvshmem.register()
_deepep.register()

__all__ = ["make_dispatcher", "DispatcherConfig", "NvshmemConfig", "DeepEPConfig", "Dispatcher", "DispatchResult", "CombineHandle",
           "DispatchInputError", "CombineInputError", "EPPoisonedError", "LayoutPlan", "plan_layout",
           "gather_rows", "gather_reduce", "rebalance_experts", "EplbPlan", "logical_to_physical",
           "rearrange_weights", "balancedness", "Eplb", "EplbConfig"]
