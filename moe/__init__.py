"""FP4 MoE: router, experts and the MoE layer (formats in `moe.quant`, kernels in `moe.kernels`).

    from moe import MoEConfig, MoELayer
    layer = MoELayer(MoEConfig.deepseek_v4_flash(expert_format="mxfp4"), ep_group=groups.ep)
    y = layer(x)            # x: [T, H] -> [T, H]

Importing `moe` needs torch only; Triton kernels load when first used on CUDA.
"""

from moe.experts import Experts, SharedExpert
from moe.layer import MoEConfig, MoELayer
from moe.router import RouteResult, Router, route

__all__ = ["Router", "route", "RouteResult", "Experts", "SharedExpert", "MoELayer", "MoEConfig"]
