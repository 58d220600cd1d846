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


def kv_bytes_per_page(cache) -> int:
    """Bytes of one page of `cache` over its distinct storages (MLA's values are a view of its keys, its
    two scale tensors one tensor)."""
    seen: dict[int, int] = {}
    for t in (cache.k, cache.v, cache.k_scale, cache.v_scale):
        if t is not None:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values()) // cache.k.shape[0]


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


def mla_awkward_cache(lens: list[int], layout, fp8: bool, gen: torch.Generator):
    """(cache, ref_cache, table, blocks) for the decode scripts' checks: an MLA latent cache on the GPU in a DCP
    rank's layout (`layout`) holding `lens` tokens of random bf16 latents, its unheld slots NaN (over fp8 NaN
    bytes and NaN scales: anything may be there), tokens quantized per token over fp8; and a copy with zeros
    there (unit scales) that the torch path reads."""
    from megapar.parallel.cp.mla import MLADims
    from megapar.parallel.cp.paged import PagedKVCache

    dims, block = MLADims(), layout.block_size
    per_seq = -(-max(lens) // (block * layout.size)) + 1
    nb = len(lens) * per_seq + 5
    kv = torch.full((nb, block, 1, dims.latent_dim), float("nan"), device="cuda", dtype=torch.bfloat16)
    clean = torch.zeros_like(kv)
    sc = torch.full((nb, block, 1), float("nan"), device="cuda")
    sc_clean = torch.ones_like(sc)
    table = torch.randperm(nb, device="cuda", generator=gen)[: len(lens) * per_seq].view(len(lens), per_seq).int()
    for s, n in enumerate(lens):
        if n:
            slots = layout.slot_mapping(torch.arange(n, device="cuda"), table[s])
            x = torch.randn(n, 1, dims.latent_dim, device="cuda", generator=gen).to(torch.bfloat16)
            mine = slots >= 0
            kv.view(-1, 1, dims.latent_dim)[slots[mine]] = x[mine]
            clean.view(-1, 1, dims.latent_dim)[slots[mine]] = x[mine]
            amax = x[mine].float().abs().amax(-1)
            sc.view(-1, 1)[slots[mine]] = amax / 448.0
            sc_clean.view(-1, 1)[slots[mine]] = amax / 448.0
    if not fp8:
        return (PagedKVCache(kv, kv[..., :dims.kv_lora_rank]), PagedKVCache(clean, clean[..., :dims.kv_lora_rank]),
                table, nb)
    q8 = (kv.float() / sc[..., None]).to(torch.float8_e4m3fn)
    q8_clean = (clean.float() / sc_clean[..., None]).to(torch.float8_e4m3fn)
    return (PagedKVCache(q8, q8[..., :dims.kv_lora_rank], sc, sc),
            PagedKVCache(q8_clean, q8_clean[..., :dims.kv_lora_rank], sc_clean, sc_clean), table, nb)
