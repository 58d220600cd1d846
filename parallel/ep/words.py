"""Rows as integer words: the byte view both EP data movers (torch and Triton) move rows with.

A permute does not care what a row holds (bf16, fp8, packed fp4): reinterpreting it as the
widest integer word that divides its bytes, strides and offset moves it with the fewest loads.
"""

from __future__ import annotations

import torch


def word_size(*tensors: torch.Tensor, widest: int = 4) -> int:
    """Widest word (8, 4, 2 or 1 bytes, at most `widest`) dividing the row bytes, row strides
    and storage offsets of every [N, C] tensor given (all with unit last stride)."""
    for size in (8, 4, 2):
        if size <= widest and all(
                t.shape[1] * t.element_size() % size == 0 and t.stride(0) * t.element_size() % size == 0
                and t.storage_offset() * t.element_size() % size == 0 for t in tensors):
            return size
    return 1


def as_words(t: torch.Tensor, size: int) -> torch.Tensor:
    """[N, C] with unit last stride -> the same bytes as [N, C'] integer words of `size` bytes."""
    word = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[size]
    return t if t.dtype == word else t.view(torch.uint8).view(word)
