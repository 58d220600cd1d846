"""GQA decode with swapped operands (CONFIG swap / swap_fp8, `_paged_decode_swap_kernel`) against
the installed kernel: the decode probe's GQA problems (B = 32, rank 0's 1/4 of L = 8K and 32K,
bf16 and fp8 caches), each whole call (kernel + merge) timed with `common.step_time` over copies
of the KV, with the largest difference from the torch reference. The installed setting runs
first and last (run-to-run noise).

    python bench/debug/decode_swap.py OUT.json        # on the GPU
"""

from __future__ import annotations

import json
import sys

import torch

from megapar.launch.bench.common import BenchContext, step_time
from megapar.launch.bench.decode_probe import _problems
from megapar.parallel.cp import triton_decode

VARIANTS = [{}] + [{"swap": 1, "block_n_swap": n, "num_warps_swap": w, "num_stages_swap": st, "maxnreg_swap": r}
                   for n, w, st, r in ((64, 4, 2, 0), (128, 4, 2, 0), (128, 4, 3, 0), (128, 4, 2, 168),
                                       (128, 4, 3, 168), (256, 4, 2, 0))] + [{}]


def main(path: str) -> None:
    ctx = BenchContext("cp", torch.device("cuda"))
    rows = []
    saved = dict(triton_decode.CONFIG)
    for p in _problems(ctx, ("gqa", "gqa_fp8")):
        tag = "_fp8" if p.kind == "gqa_fp8" else ""
        for i, variant in enumerate(VARIANTS):
            triton_decode.CONFIG.clear()
            triton_decode.CONFIG.update(saved)
            triton_decode.CONFIG.update({k + tag: v for k, v in variant.items()})
            try:
                got = p.call()
                n = p.nref
                err = float((got.out[:n].float() - p.ref.out.float()).abs().max())
                us, cols = step_time(ctx, p.calls or [p.call])
                row = {"problem": p.label, "variant": variant, "repeat": i == len(VARIANTS) - 1, "us": round(us, 2),
                       "max_err": err, "timing": cols["timing"]}
            except Exception as exc:      # (a variant that does not compile is a result too)
                row = {"problem": p.label, "variant": variant, "error": f"{type(exc).__name__}: {exc}"[:300]}
            rows.append(row)
            print(row, flush=True)
    triton_decode.CONFIG.clear()
    triton_decode.CONFIG.update(saved)
    with open(path, "w") as f:
        json.dump({"command": "python bench/debug/decode_swap.py", "device": torch.cuda.get_device_name(),
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "decode-swap.json")
