"""`AttnState`: a (partial) attention result, the currency of every attention function in `parallel.cp`.

Its own module so that the torch merge (`merge.py`) and the Triton kernels (`triton_merge.py`)
both build on it without importing each other.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class AttnState(NamedTuple):
    """A (partial) attention result: `out [..., T, H, D]` and `lse [..., T, H]` fp32."""

    out: Tensor
    lse: Tensor
