"""Compatibility alias: this module is `parallel.quant.fold` (same module object)."""

import sys

from megapar.parallel.quant import fold as _module

sys.modules[__name__] = _module
