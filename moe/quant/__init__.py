"""FP4/FP8 formats for MoE weights and activations (compatibility re-export of `parallel.quant`).

The formats live in `parallel.quant`, at the bottom of the dependency graph, so that sp, cp
and ep payloads share them with the MoE layer. Every name here is the same object as there
(`moe.quant.quantize is parallel.quant.quantize`); the submodules `moe.quant.formats`,
`.reference`, `.fold`, `.checkpoint` and `.triton_quant` are the `parallel.quant` modules.

    q = quantize(w, "mxfp4")            # QuantizedTensor(data uint8 [..., K/2], scale uint8 [..., K/32])
    w_hat = dequantize(q, torch.bfloat16)
"""

from __future__ import annotations

from megapar.parallel.quant import *  # noqa: F401,F403
from megapar.parallel.quant import BACKENDS, QUANT, TRITON_FORMATS, __all__, _pick_backend  # noqa: F401
from megapar.parallel.quant import checkpoint, fold, formats, reference  # noqa: F401
