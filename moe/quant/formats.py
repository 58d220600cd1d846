"""Compatibility alias: this module is `parallel.quant.formats` (same module object)."""

import sys

from megapar.parallel.quant import formats as _module

sys.modules[__name__] = _module
