"""Compatibility alias: this module is `parallel.quant.checkpoint` (same module object)."""

import sys

from megapar.parallel.quant import checkpoint as _module

sys.modules[__name__] = _module
