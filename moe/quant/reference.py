"""Compatibility alias: this module is `parallel.quant.reference` (same module object)."""

import sys

from megapar.parallel.quant import reference as _module

sys.modules[__name__] = _module
