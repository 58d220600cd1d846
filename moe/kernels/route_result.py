"""What routing returns, shared by the router (moe.router) and its fused kernel (moe.kernels.routing)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RouteResult:
    """Routing of T tokens to K experts each."""

    topk_ids: torch.Tensor  # [T, K] int64; -1 = padding token (no expert)
    topk_weights: torch.Tensor  # [T, K] float32; 0 for padding tokens
