"""The JSON the bench/debug timing scripts write (their command, the GPU and their rows), and the
decode scripts' check row of a kernel setting against the torch path."""

from __future__ import annotations

import json

import torch


def dump_rows(path: str, script: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump({"command": f"python bench/debug/{script}", "device": torch.cuda.get_device_name(), "rows": rows},
                  f, indent=1)


def check_row(check: str, kernel: str, call, ref, table, bad_block: int) -> dict:
    """`call(table)` (a decode over `table`) against the torch path's `ref`: max errors of out and of
    the finite lse, whether exactly the empty rows are -inf, and whether sequence 5 comes out NaN
    (and sequence 6 finite) when its first block id is `bad_block`, past the cache."""
    got = call(table)
    torch.cuda.synchronize()
    fin = torch.isfinite(ref.lse)
    bad_table = table.clone()
    bad_table[5, 0] = bad_block
    bad = call(bad_table)
    row = {"check": check, "kernel": kernel, "max_err_out": (got.out - ref.out).abs().max().item(),
           "max_err_lse": (got.lse[fin] - ref.lse[fin]).abs().max().item(),
           "empty_rows_ok": bool(torch.equal(torch.isfinite(got.lse), fin)),
           "bad_row_nan": bool(torch.isnan(bad.lse[5]).all()) and bool(torch.isfinite(bad.lse[6]).all())}
    print(row, flush=True)
    return row


HEADS = {"mla16": 16, "mla128": 128}
"""Query heads of the MLA families the decode scripts time (16: TP 8; 128: TP 1, DCP's `-dcp 8`)."""


def family_case(family: str, cache_dtype: torch.dtype, batch: int, context: int, block: int, n: int,
                device: torch.device):
    """(cache, block table, q, scale) of one decode family as bench cp builds it, rank 0 of n: "gqa" (Hq 32,
    Hkv 4, D 128) or "mla16" / "mla128" (the latent cache, bf16 queries of that many heads)."""
    from megapar.launch.bench.cp import _decode_setup, _mla_decode_setup
    from megapar.parallel.cp.mla import MLADims

    if family == "gqa":
        cache, table, q, _ = _decode_setup(batch, context, 32, 4, 128, block, n, device, cache_dtype)
        return cache, table, q, 128 ** -0.5
    dims = MLADims()
    latent, table = _mla_decode_setup(batch, context, dims, block, n, device, cache_dtype)
    q = torch.randn(batch, HEADS[family], dims.latent_dim, device=device, dtype=torch.bfloat16)
    return latent.paged, table, q, dims.scale

