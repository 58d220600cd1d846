"""Compatibility alias: this module is `parallel.quant.triton_quant` (same module object)."""

import sys

from megapar.parallel.quant import triton_quant as _module

sys.modules[__name__] = _module
