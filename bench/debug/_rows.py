"""The JSON the bench/debug timing scripts write: their command, the GPU and their rows."""

from __future__ import annotations

import json

import torch


def dump_rows(path: str, script: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump({"command": f"python bench/debug/{script}", "device": torch.cuda.get_device_name(), "rows": rows},
                  f, indent=1)
