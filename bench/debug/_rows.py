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
