"""FP4 MoE: router, experts and the MoE layer (formats in `moe.quant`, kernels in `moe.kernels`).

    from megapar.moe import MoEConfig, MoELayer
    layer = MoELayer(MoEConfig.deepseek_v4_flash(expert_format="mxfp4"), ep_group=groups.ep)
    y = layer(x)            # x: [T, H] -> [T, H]

Importing `moe` needs torch only; Triton kernels load when first used on CUDA.
"""


import megapar as _megapar

_megapar.alias_short_name(__name__)  # `import moe` is `megapar.moe` (see megapar/__init__.py)
from megapar.moe.experts import Experts, SharedExpert
from megapar.moe.layer import MoEConfig, MoELayer
from megapar.moe.router import RouteResult, Router, route

__all__ = ["Router", "route", "RouteResult", "Experts", "SharedExpert", "MoELayer", "MoEConfig"]
