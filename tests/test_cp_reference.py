"""Checks of the independent full-attention reference (`tests.helpers.reference_attention`) that
the context-parallel tests compare against: written differently from `parallel.cp` on purpose
(float64, one head at a time, torch.softmax and torch.logsumexp, masks from explicit position
vectors), and checked here against PyTorch's scaled_dot_product_attention.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tests.helpers import reference_attention


def test_reference_matches_torch_sdpa_with_gqa_and_causal_mask():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(7, 6, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(7, 2, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(7, 2, 5, generator=gen, dtype=torch.float64)
    for causal in (False, True):
        out, lse = reference_attention(q, k, v, causal=causal)
        expect = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(3, 1).transpose(0, 1),
                                                v.repeat_interleave(3, 1).transpose(0, 1), is_causal=causal)
        torch.testing.assert_close(out, expect.transpose(0, 1), rtol=1e-12, atol=1e-12)
        scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(3, 1)) * 8 ** -0.5
        if causal:
            scores = scores + torch.full((7, 7), -math.inf, dtype=torch.float64).triu(1)
        torch.testing.assert_close(lse, scores.exp().sum(-1).log().T, rtol=1e-12, atol=1e-12)


def test_reference_rows_without_keys_are_zero_with_minus_inf_lse():
    q, k, v = torch.randn(3, 1, 4), torch.randn(2, 1, 4), torch.randn(2, 1, 4)
    out, lse = reference_attention(q, k, v, causal=True, q_pos=torch.tensor([0, 5, 10]), k_pos=torch.tensor([3, 6]))
    assert torch.equal(out[0], torch.zeros(1, 4, dtype=torch.float64)) and lse[0, 0] == -math.inf
    assert torch.isfinite(lse[1:]).all()
