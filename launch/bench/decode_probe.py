"""Tuning probe of the split-KV paged decode kernel (`parallel.cp.triton_decode.CONFIG`).

`python -m megapar.launch.bench.cp --probe --out DIR`. Problems (rank 0's 1/4 of a paged KV,
page 64, B = 32): GQA Hq = 32, Hkv = 4, D = 128 at L = 8K and 32K with bf16 and fp8 caches; MLA
(H = 128 over one 576-wide latent head, v = its first 512) at L = 8K and 32K, bf16 and fp8, and
H = 16 (TP 8, a head tile that is not full: family mla_narrow) at 8K and 32K, bf16 and fp8. Per
family a fixed list of launch settings - one factor at a time around the current CONFIG plus a
few combinations, for MLA also the kernel's structure options (latent in halves, TMA, lazy
rescale) and, as invalid rows timed for where the time goes, its subtraction diagnostics (diag 1
no softmax, 2 no P @ V, 3 scores only) - then the combination of the per-key winners. Every
setting is checked against the torch path (`backend="torch"`, the first few sequences: its
per-head KV copy is bounded) within the GPU tests' bound (max abs error of out and lse <= 2e-2)
and timed in CUDA graphs; the table gives µs and the fraction of the KV-read byte floor
at the copy ceiling. Timing: `common.step_time`, ten calls per CUDA graph over copies of the KV
taken in turn (the single replay, which it was before 2026-12-03 evening, moved by ~4 µs at 8K
between identical launches; it stays in each row as replay_us).

The best valid setting per family (least mean time relative to each problem's fastest) goes to
DIR/decode-tuning.json as {"gqa": {...}, "gqa_fp8": {...}, "mla": {...}, "mla_fp8": {...},
"mla_narrow": {...}} in the kernel's own key names: MLA's land on CONFIG's *_wide entries (key
dim > 256), MLA over fp8 on its *_wide_fp8 entries, narrow MLA tiles on *_wide_narrow (with a
register cap and fp16 operands among its options), GQA over an fp8 cache on its *_fp8 entries,
so none conflict. min_split is swept per family (min_split, min_split_fp8, min_split_wide,
min_split_wide_fp8, min_split_wide_narrow), and so is target_programs (target_programs,
target_programs_fp8, target_programs_wide, target_programs_wide_fp8; until 2026-12-03 night one
value served gqa and mla, and the probe timed each family's winner with the other's value). GQA has Hq / Hkv = 8 query rows per kv head, below the smallest row tile
(16), so block_m is not swept for it.
`triton_decode.apply_tuning` (or MEGAPAR_DECODE_TUNING=DIR/decode-tuning.json) installs the file.
MEGAPAR_DECODE_PROBE_FAMILIES (a comma list of gqa, gqa_fp8, mla, mla_fp8, mla_narrow) probes only
those families (and sets up only their problems); the file then holds only them.
After each family DIR/decode-tuning.partial.json holds what is measured so far (a call that runs
out of time keeps it).
On CPU under TRITON_INTERPRET=1 the probe is a dry run on tiny sizes with a few settings.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from megapar.launch.bench.common import BenchContext, copy_ceiling_gbps, input_copies, precompile, step_time

ATOL_GPU = 2e-2       # tests/test_cp_decode_kernel.py, full size on the GPU (bf16 queries)
ATOL_CPU = 1e-4       # float32 under the interpreter
REF_BUDGET = 8 << 30  # bytes of the torch path's per-head KV copy: sequences checked per problem

KEYS = {"gqa": ("block_n", "num_warps", "num_stages", "target_programs", "min_split", "lazy_rescale", "tma",
                "gluon_gqa"),
        "gqa_fp8": ("block_n", "num_warps", "num_stages", "target_programs", "f16", "maxnreg", "min_split", "tma",
                    "stage16", "even"),
        "mla": ("block_m", "block_n", "num_warps", "num_stages", "target_programs", "min_split", "lazy_rescale",
                "halves", "tma", "diag", "at_most", "gluon_wide"),
        "mla_fp8": ("block_m", "block_n", "num_warps", "num_stages", "lazy_rescale", "halves", "tma", "min_split", "f16",
                    "at_most", "target_programs", "gluon_wide"),
        "mla_narrow": ("block_n", "num_warps", "num_stages", "min_split", "at_most", "f16", "maxnreg", "stage16",
                       "block_n_fp8", "gluon_wide")}
FAMILY_MAP = {"gqa": {}, "mla": "_WIDE", "gqa_fp8": "_FP8", "mla_fp8": "_WIDE_FP8",   # family key -> CONFIG key
              "mla_narrow": "_WIDE_NARROW"}

VARIANTS = {   # overrides of the current settings, one factor at a time, then a few combinations
    # (the Triton kernel's settings: each runs with gluon_gqa 0 unless it says otherwise, `_install`;
    # the first row is the Gluon kernel, which takes none of them)
    "gqa": [{"gluon_gqa": 1}, {}, {"lazy_rescale": 1}, {"block_n": 32}, {"block_n": 128}, {"num_warps": 8}, {"num_stages": 1}, {"num_stages": 3},
            {"target_programs": 132}, {"target_programs": 528}, {"min_split": 128}, {"min_split": 256},
            {"min_split": 1024},
            {"block_n": 128, "num_warps": 8}, {"block_n": 128, "num_stages": 3}, {"block_n": 32, "num_stages": 3},
            {"target_programs": 528, "min_split": 128}, {"block_n": 128, "num_warps": 8, "num_stages": 3},
            # whole k / v tiles by TMA (the partial last one through the pointer loads)
            {"tma": 1}, {"tma": 1, "num_stages": 4}, {"tma": 1, "num_stages": 2}, {"tma": 1, "block_n": 128},
            {"tma": 1, "block_n": 128, "num_warps": 8},
            # more programs, and fewer warps a program over more splits: all lost (cp-probe14 / 15 / 16,
            # 1/4 of 8K / 32K, against ~41.7 / 131.0 µs: 396 programs 43.3 / 133.1, 2 warps x 528
            # programs 43.6 / 179.4, one warp x 12 splits 51.1 / 174.8); the closest stay for the sweep
            {"target_programs": 396}, {"num_warps": 2, "target_programs": 528},
            {"num_warps": 1, "block_n": 32, "target_programs": 1536, "min_split": 256}],
    # MLA: the kernel structure options (latent in halves, TMA, lazy rescale) and, on the halves
    # kernel, the subtraction diagnostics (diag 1 no softmax, 2 no P @ V, 3 scores only: invalid
    # rows, timed for where the time goes)
    # (the Triton kernel's settings: each runs with gluon_wide 0 unless it says otherwise, `_install`;
    # the first row is the Gluon kernel, which takes split settings only)
    "mla": [{"gluon_wide": 1}, {}, {"block_n": 32}, {"num_stages": 2}, {"target_programs": 528}, {"min_split": 256},
            {"min_split": 512}, {"min_split": 2048}, {"lazy_rescale": 1}, {"halves": 1}, {"halves": 1, "num_stages": 2},
            {"halves": 1, "tma": 1}, {"halves": 1, "tma": 1, "num_stages": 2},
            {"halves": 1, "tma": 1, "num_stages": 2, "lazy_rescale": 1}, {"halves": 1, "num_stages": 2, "lazy_rescale": 1},
            {"halves": 1, "tma": 1, "num_stages": 2, "target_programs": 528},
            {"halves": 1, "num_stages": 2, "diag": 1}, {"halves": 1, "num_stages": 2, "diag": 2},
            {"halves": 1, "num_stages": 2, "diag": 3}, {"halves": 1, "tma": 1, "num_stages": 2, "diag": 3},
            # splits rounded down to target_programs (one CTA per SM: no partial last wave)
            {"at_most": 0}, {"target_programs": 264}, {"at_most": 0, "target_programs": 264}],
    # GQA over fp8; f16: fp16 MMA operands (one conversion per fp8 pair instead of three steps)
    "gqa_fp8": [{}, {"even": 0}, {"block_n": 64}, {"block_n": 64, "num_stages": 3}, {"num_stages": 3},
                {"target_programs": 396}, {"min_split": 1024}, {"block_n": 32}, {"num_stages": 2}, {"num_stages": 4},
                {"block_n": 64, "num_stages": 2}, {"f16": 1}, {"f16": 1, "block_n": 64}, {"f16": 1, "num_stages": 2},
                {"f16": 1, "num_stages": 4}, {"f16": 1, "block_n": 64, "num_stages": 4},
                # f16 at 128 keys takes 234 registers (2 CTAs per SM), 168 under the cap with no spill
                {"f16": 1, "maxnreg": 168}, {"f16": 1, "maxnreg": 168, "num_stages": 2},
                {"f16": 1, "maxnreg": 168, "num_stages": 4}, {"f16": 1, "maxnreg": 160, "num_stages": 2},
                {"f16": 1, "maxnreg": 128, "num_stages": 2}, {"min_split": 256}, {"min_split": 1024},
                {"tma": 1}, {"tma": 1, "num_stages": 3}, {"tma": 1, "block_n": 64, "num_stages": 3},
                # stage16: the value (2: and key) tile converted where loaded, staged as 16-bit for the
                # MMA (no byte-wise operand loads); fewer registers, so the cap is swept off too
                {"stage16": 1}, {"stage16": 2}, {"stage16": 1, "maxnreg": 0}, {"stage16": 2, "maxnreg": 0},
                {"stage16": 1, "num_stages": 2, "maxnreg": 0}, {"stage16": 2, "num_stages": 2, "maxnreg": 0},
                {"stage16": 2, "block_n": 64, "num_stages": 2, "maxnreg": 0},
                {"stage16": 2, "block_n": 64, "num_stages": 3, "maxnreg": 0},
                {"stage16": 1, "block_n": 64, "num_stages": 2, "maxnreg": 0},
                # 8 warps, 256-key tiles, more programs and one / two warps a program, swept in
                # cp-probe14 / 15 / 16 (1/4 of 8K / 32K against 39.8 / 118.6 µs): 8 warps 55.7-80.1 /
                # 165.7-266.9, 528 programs 48.0 / 139.1, 2 warps x 528 programs 42.6 / 117.4, one warp x
                # 12 splits 43.4 / 110.1 (no cross-warp step; the only gain, at 32K only). The closest stay
                {"num_warps": 8, "maxnreg": 128}, {"target_programs": 528},
                {"num_warps": 2, "block_n": 64, "target_programs": 528},
                {"num_warps": 1, "block_n": 32, "maxnreg": 0, "target_programs": 1536, "min_split": 256},
                {"num_warps": 1, "block_n": 32, "maxnreg": 0, "num_stages": 3, "target_programs": 1536,
                 "min_split": 256}],
    # MLA over fp8 (today 32 heads x 64 keys, mma.sync; 64 heads spill 444 B with the plain loads,
    # 40 B in halves with TMA and 2 stages: bench/debug/kernel_sass.py decode)
    "mla_fp8": [{"gluon_wide": 1}, {}, {"num_stages": 2}, {"block_n": 32}, {"halves": 1}, {"halves": 1, "tma": 1},
                {"halves": 1, "tma": 1, "num_stages": 2}, {"block_m": 64, "num_stages": 2},
                {"block_m": 64, "halves": 1, "tma": 1, "num_stages": 2},
                {"block_m": 64, "halves": 1, "num_stages": 2}, {"lazy_rescale": 1}, {"min_split": 512},
                {"min_split": 2048},
                # fp16 operands in the halves kernel (sm_90a: the F2F.BF16.F16 gone, 1.6 KB of spills
                # with TMA), splits rounded down to target_programs (one wave: 132)
                {"f16": 0}, {"tma": 1}, {"at_most": 0}, {"target_programs": 132}, {"target_programs": 528},
                {"at_most": 0, "target_programs": 132}],
    # MLA with 16 heads: over fp8 it takes 172 registers (one CTA of 8 warps per SM) against 80
    # over bf16; a cap of 128 compiles with 48 B of spills (bench/debug/kernel_sass.py, --only narrow)
    # (its gluon_wide row is the Gluon kernel over bf16, gluon_wide_narrow; over fp8 it runs the Triton default)
    "mla_narrow": [{"gluon_wide": 1}, {}, {"maxnreg": 128}, {"maxnreg": 168}, {"f16": 1}, {"f16": 1, "maxnreg": 128},
                   {"num_warps": 4}, {"num_warps": 4, "maxnreg": 128}, {"num_stages": 3}, {"num_stages": 1},
                   {"block_n": 32}, {"block_n": 32, "num_stages": 3}, {"min_split": 128}, {"min_split": 512},
                   {"at_most": 0},
                   # over fp8 (f16, stage16 and block_n_fp8 leave the bf16 problems as they are): the
                   # latent tile converted once where loaded and staged as 16-bit for both MMAs, in
                   # 32-key tiles (probe of 2026-12-03 evening, cp-probe9: 54.4 -> 46.7 µs at 8K, 165.0
                   # -> 128.1 at 32K, against 52.5 / 150.3 with f16 alone)
                   {"stage16": 1}, {"stage16": 1, "f16": 1}, {"stage16": 1, "f16": 1, "num_warps": 8},
                   {"block_n_fp8": 32, "f16": 1, "stage16": 1}, {"block_n_fp8": 32, "f16": 1},
                   {"block_n_fp8": 32, "f16": 1, "stage16": 1, "num_stages": 3},
                   {"block_n_fp8": 32, "f16": 1, "stage16": 1, "num_stages": 4},
                   {"block_n_fp8": 32, "f16": 1, "stage16": 1, "maxnreg": 168},
                   {"block_n_fp8": 32, "f16": 1, "stage16": 1, "maxnreg": 128},
                   {"block_n_fp8": 16, "f16": 1, "stage16": 1}, {"block_n_fp8": 16, "f16": 1, "stage16": 1, "num_stages": 3},
                   {"block_n_fp8": 32, "f16": 1, "stage16": 1, "min_split": 128}],
}
TINY_VARIANTS = {
    "gqa": [{}, {"block_n": 16, "min_split": 32}, {"num_warps": 8, "num_stages": 1},
            {"tma": 1, "block_n": 16, "min_split": 32}],
    "mla": [{}, {"block_m": 16, "block_n": 16, "min_split": 32}, {"num_warps": 4}, {"halves": 1, "block_n": 16},
            {"halves": 1, "tma": 1, "block_n": 16, "lazy_rescale": 1}],
    "gqa_fp8": [{}, {"block_n": 16}, {"f16": 1, "block_n": 16}, {"stage16": 2, "block_n": 16}],
    "mla_fp8": [{"gluon_wide": 1}, {}, {"num_stages": 2}, {"f16": 1, "block_m": 16, "block_n": 16, "halves": 1}],
    "mla_narrow": [{}, {"num_stages": 1, "min_split": 32}, {"stage16": 1, "block_n_fp8": 16, "min_split": 32}],
}


@dataclass
class Problem:
    """One decode problem with its data on the device and the torch path's output to check against."""

    kind: str                   # "gqa" | "mla"
    tag: str                    # cache dtype
    label: str
    call: Callable[[], Any]     # the kernel over the whole batch
    ref: Any                    # AttnState of the torch path over the first `nref` sequences
    nref: int
    floor_us: float | None
    rows: int                   # query rows per kv head (Hq / Hkv)
    batch_programs: int         # sequences x kv heads
    capacity: int               # tokens per sequence the grid covers
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    calls: list[Callable[[], Any]] = field(default_factory=list)   # `call` over each copy of the KV (`step_time`)


def _family_view(kind: str, config: dict[str, int]) -> dict[str, int]:
    from megapar.parallel.cp import triton_decode as td

    names = getattr(td, FAMILY_MAP[kind]) if FAMILY_MAP[kind] else {}
    return {k: config[names.get(k, k)] for k in KEYS[kind]}


def _install(kind: str, settings: dict[str, int], default: dict[str, int]) -> None:
    from megapar.parallel.cp import triton_decode as td

    td.CONFIG.clear()
    td.CONFIG.update(default)
    if kind in ("mla", "mla_fp8", "mla_narrow"):      # the Triton kernel's settings, on the Triton kernel
        settings = {"gluon_wide": 0, **settings}
    elif kind == "gqa":
        settings = {"gluon_gqa": 0, **settings}
    td.apply_tuning({kind: settings})


def _families() -> tuple[str, ...]:
    """The families to probe: MEGAPAR_DECODE_PROBE_FAMILIES (comma list), default all of KEYS."""
    raw = os.environ.get("MEGAPAR_DECODE_PROBE_FAMILIES", "")
    picked = tuple(f.strip() for f in raw.split(",") if f.strip()) or tuple(KEYS)
    bad = [f for f in picked if f not in KEYS]
    if bad:
        raise ValueError(f"MEGAPAR_DECODE_PROBE_FAMILIES names unknown families {bad}; valid: {', '.join(KEYS)}")
    return picked


def _problems(ctx: BenchContext, families: tuple[str, ...] = tuple(KEYS)) -> list[Problem]:
    from megapar.launch.bench.cp import _decode_setup, _floor, _mla_decode_setup, kv_read_bytes_of
    from megapar.parallel.cp.dcp import DCPLayout
    from megapar.parallel.cp.mla import MLADims
    from megapar.parallel.cp.paged import paged_decode_attention

    if ctx.is_cuda:
        batch, block, n, contexts = 32, 64, 4, (8192, 32768)
        gqa, dims, mla_heads = (32, 4, 128), MLADims(), 128
        gqa_dtypes = (torch.bfloat16, torch.float8_e4m3fn)
        mla_dtype, qdtype = torch.bfloat16, torch.bfloat16
    else:   # dry run: tiny, and an MLA key dim > 256 so the *_wide settings are the ones used
        batch, block, n, contexts = 2, 16, 4, (256,)
        gqa, mla_heads = (8, 2, 32), 4
        dims = MLADims(kv_lora_rank=256, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32)
        gqa_dtypes, mla_dtype, qdtype = (torch.float32,), torch.float32, torch.float32
    ceiling = copy_ceiling_gbps(ctx.device)
    layout = DCPLayout(size=n, rank=0, block_size=block)
    out: list[Problem] = []
    # (kind, context, cache dtype, MLA heads): MLA with 128 heads on the rank (TP 1), and with 16
    # (TP 8) as the family mla_narrow (CONFIG's *_wide_narrow entries) over bf16 and fp8
    specs = [("gqa_fp8" if dt == torch.float8_e4m3fn else "gqa", c, dt, 0) for c in contexts for dt in gqa_dtypes]
    specs += [("mla", c, mla_dtype, mla_heads) for c in contexts]
    if ctx.is_cuda:
        specs += [("mla_fp8", c, torch.float8_e4m3fn, mla_heads) for c in contexts]
        # 16 heads (TP 8): a head tile that is not full, its own family over both cache dtypes
        specs += [("mla_narrow", c, dt, 16) for c in contexts for dt in (mla_dtype, torch.float8_e4m3fn)]
    else:   # (the dry run's MLA heads, 4, are a narrow tile too)
        specs += [("mla_narrow", contexts[-1], mla_dtype, mla_heads)]
    for kind, context, cache_dtype, heads_here in specs:
        if kind not in families:
            continue
        local = int(layout.local_lengths(context))
        if not kind.startswith("mla"):
            heads, kv_heads, d = gqa
            dv, v_from_k, scale = d, False, d ** -0.5

            def make(context=context, cache_dtype=cache_dtype):
                return _decode_setup(batch, context, heads, kv_heads, d, block, n, ctx.device, cache_dtype)[:3]
            what = f"Hq={heads} Hkv={kv_heads} D={d}"
        else:
            heads, kv_heads, d, dv, v_from_k, scale = heads_here, 1, dims.latent_dim, dims.kv_lora_rank, True, dims.scale

            def make(context=context, cache_dtype=cache_dtype, heads=heads, d=d):
                latent, table = _mla_decode_setup(batch, context, dims, block, n, ctx.device, cache_dtype)
                return latent.paged, table, torch.randn(batch, heads, d, device=ctx.device, dtype=qdtype)
            what = f"H={heads} D={d} Dv={dv}"
        seq = torch.full((batch,), context, device=ctx.device)
        # copies of the cache taken in turn by the timing (`step_time`), so no call reads its KV from L2
        sets = input_copies(ctx, make, lambda c: kv_read_bytes_of(c[0], batch * local, kv_heads, d, dv, v_from_k))
        nbytes = kv_read_bytes_of(sets[0][0], batch * local, kv_heads, d, dv, v_from_k)
        calls = [lambda c=c, t=t, q=q, scale=scale, context=context, seq=seq: paged_decode_attention(
            q, c, t, seq, layout=layout, scale=scale, backend="triton", max_seq_len=context) for c, t, q in sets]
        call = calls[0]
        cache, table, q = sets[0]

        nref = max(1, min(batch, REF_BUDGET // max(1, local * heads * (d + dv) * 4)))
        ref = paged_decode_attention(q[:nref], cache, table[:nref], seq[:nref], layout=layout, scale=scale,
                                     backend="torch")
        tag = str(cache_dtype).replace("torch.", "")
        out.append(Problem(kind, tag, f"{kind} {tag} B={batch} L={context} (1/{n}: {local}) {what}", call, ref, nref,
                           _floor(nbytes, ceiling), heads // kv_heads, batch * kv_heads, local, calls=calls))
    return out


def _max_err(got, ref, nref: int) -> float:
    """Max abs error of out and (finite) lse against the torch path; inf where -inf patterns differ."""
    o, lse = got.out[:nref].float(), got.lse[:nref].float()
    finite = torch.isfinite(ref.lse)
    if not torch.equal(finite, torch.isfinite(lse)) or not torch.isfinite(o).all():
        return float("inf")
    err = (o - ref.out.float()).abs().max()
    if finite.any():
        err = torch.maximum(err, (lse[finite] - ref.lse.float()[finite]).abs().max())
    return float(err)


def _splits(p: Problem, view: dict[str, int]) -> int:
    import triton

    from megapar.parallel.cp.triton_decode import plan_splits

    block_m = max(16, min(triton.next_power_of_2(p.rows), view.get("block_m", 64)))
    return plan_splits(p.capacity, p.batch_programs * -(-p.rows // block_m), view["block_n"], view["min_split"],
                       bool(view.get("at_most", 0)), view.get("target_programs"))[0]


def _measure(ctx: BenchContext, problems: list[Problem], kind: str, settings: list[dict[str, int]],
             default: dict[str, int], iters: int, why: str) -> None:
    """Time every (new) family setting on every problem of the family; results land in problem.results."""
    fam = [p for p in problems if p.kind == kind]
    todo = [s for s in settings if any(json.dumps(s, sort_keys=True) not in p.results for p in fam)]
    todo = list({json.dumps(s, sort_keys=True): s for s in todo}.values())
    if not todo:
        return
    if ctx.is_cuda:    # compile every launch configuration in parallel first
        t = time.time()
        with precompile():
            for s in todo:
                for p in {q.tag: q for q in fam}.values():      # one problem per cache dtype
                    _install(kind, s, default)
                    with contextlib.suppress(Exception):
                        p.call()
        print(f"  {kind}: compiled {len(todo)} settings in {time.time() - t:.1f} s", flush=True)
    atol = ATOL_GPU if ctx.is_cuda else ATOL_CPU
    for p in fam:
        for s in todo:
            key = json.dumps(s, sort_keys=True)
            if key in p.results:
                continue
            row: dict[str, Any] = {"kind": kind, "problem": p.label, "settings": s, "stage": why}
            try:
                _install(kind, s, default)
                row["splits"] = _splits(p, s)
                row["max_err"] = _max_err(p.call(), p.ref, p.nref)
                row["valid"] = row["max_err"] <= atol
                row["us"], cols = step_time(ctx, p.calls or [p.call], iters=iters)
                row["timing"], row["input_sets"] = cols["timing"], cols["input_sets"]
                if "replay_us" in cols:
                    row["replay_us"] = round(cols["replay_us"], 2)
                if p.floor_us is not None:
                    row["floor_us"] = round(p.floor_us, 2)
                    row["floor_frac"] = round(p.floor_us / row["us"], 3)
                row["us"] = round(row["us"], 2)
            except Exception as e:  # noqa: BLE001 - a setting that does not compile or run is recorded, not fatal
                row["valid"] = False
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                if ctx.is_cuda:
                    torch.cuda.synchronize()
            p.results[key] = row
            print("  " + "  ".join(f"{k}={v}" for k, v in row.items() if k != "kind"), flush=True)


def _score(problems: list[Problem], kind: str, settings: dict[str, int]) -> float:
    """Mean over the family's problems of time / that problem's fastest valid time; inf if invalid anywhere."""
    key, total, fam = json.dumps(settings, sort_keys=True), 0.0, [p for p in problems if p.kind == kind]
    for p in fam:
        row = p.results.get(key)
        if row is None or not row.get("valid"):
            return float("inf")
        total += row["us"] / min(r["us"] for r in p.results.values() if r.get("valid"))
    return total / len(fam)


def _best(problems: list[Problem], kind: str) -> dict[str, int] | None:
    """The best-scoring measured setting of a family; None if none valid."""
    measured = {k: json.loads(k) for p in problems if p.kind == kind for k in p.results}
    scored = sorted(measured.values(), key=lambda s: _score(problems, kind, s))
    return scored[0] if scored and _score(problems, kind, scored[0]) < float("inf") else None


def _per_key_winners(problems: list[Problem], kind: str, base: dict[str, int]) -> dict[str, int]:
    """The base setting with each key at the value that scored best among settings differing only there."""
    out = dict(base)
    measured = [json.loads(k) for k in {k for p in problems if p.kind == kind for k in p.results}]
    for key in KEYS[kind]:
        alone = [s for s in measured if all(s[k] == base[k] for k in KEYS[kind] if k != key)]
        if alone:
            out[key] = min(alone, key=lambda s: _score(problems, kind, s))[key]
    return out


def probe(out_dir: str | os.PathLike, *, device: str | None = None, iters: int = 20) -> dict:
    """Run the probe (module docstring); returns what it writes to out_dir/decode-tuning.json."""
    from megapar.parallel import impl
    from megapar.parallel.cp import triton_decode as td

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type != "cuda" and not impl.interpreting():
        raise ValueError("the decode probe needs CUDA, or TRITON_INTERPRET=1 for a CPU dry run")
    ctx = BenchContext(suite="cp", device=dev, quick=dev.type != "cuda")
    iters = iters if ctx.is_cuda else 1
    t0 = time.time()
    default = dict(td.CONFIG)
    notes: list[str] = []
    out = Path(out_dir)
    try:
        with torch.no_grad():
            families = _families()
            problems = _problems(ctx, families)
            print(f"  set up {len(problems)} problems in {time.time() - t0:.1f} s", flush=True)
            variants = VARIANTS if ctx.is_cuda else TINY_VARIANTS
            best: dict[str, dict[str, int]] = {}
            for kind in families:
                if not any(p.kind == kind for p in problems):
                    continue
                base = _family_view(kind, default)
                settings = [{**base, **v} for v in variants[kind]]
                _measure(ctx, problems, kind, settings, default, iters, "sweep")
                _measure(ctx, problems, kind, [_per_key_winners(problems, kind, base)], default, iters, "combined")
                found = _best(problems, kind)
                if found is None:
                    notes.append(f"{kind}: no valid setting; the current CONFIG stays")
                    found = base
                best[kind] = found
                # what is measured so far, in case the call runs out of time (a GPU call has a limit)
                out.mkdir(parents=True, exist_ok=True)
                (out / "decode-tuning.partial.json").write_text(json.dumps(
                    {"done": list(best), "best": best, "results": [r for p in problems for r in p.results.values()],
                     "seconds": round(time.time() - t0, 1)}, indent=1) + "\n")
    finally:
        td.CONFIG.clear()
        td.CONFIG.update(default)
    results = [r for p in problems for r in p.results.values()]
    tuning = {**best,
              "device": torch.cuda.get_device_name(dev) if ctx.is_cuda else "cpu (interpreter dry run)",
              "problems": [p.label for p in problems], "notes": notes,
              "seconds": round(time.time() - t0, 1), "results": results}
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode-tuning.json").write_text(json.dumps(tuning, indent=1) + "\n")
    _print_table(results, best, default)
    for n in notes:
        print(f"note: {n}")
    print(f"wrote {out / 'decode-tuning.json'} ({tuning['seconds']} s): "
          + ", ".join(f"{k} {v}" for k, v in best.items()), flush=True)
    return tuning


def _print_table(results: list[dict[str, Any]], best: dict[str, dict[str, int]], default: dict[str, int]) -> None:
    print("\n| problem | settings | splits | µs | floor frac | max err | valid | |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        kind, s = r["kind"], r["settings"]
        base = _family_view(kind, default)
        diff = ", ".join(f"{k}={v}" for k, v in s.items() if base.get(k) != v) or "current CONFIG"
        mark = ("best" if s == best.get(kind) else "") + (" default" if s == base else "")
        print(f"| {r['problem']} | {diff} | {r.get('splits', '')} | {r.get('us', r.get('error', '')[:60])} | "
              f"{r.get('floor_frac', '')} | {r.get('max_err', '')} | {r.get('valid')} | {mark.strip()} |")
