"""Weight-stream probe of the W4A16 decode GEMM (`gemm --probe --sections decode5`).

At 1 token per expert the fused W4A16 kernel (moe/kernels/triton_w4a16.py) runs at 0.41-0.46 of
the FP4 weight-byte floor, and its loads-only diagnostic is as slow as the whole kernel
(bench/gemm-notes.md, rounds 3 and 4). These kernels read the same packed weight (oct words,
rows in tiles of `tile_n`, `PreparedWeight.strides()`) and do nothing but sum the words, so
their times bound what any kernel with that access pattern can reach:

- "flat": the weight's storage as one flat int32 array; a persistent grid (a multiple of the
  SM count), each program one contiguous chunk, BLOCK words (16-byte vectors) per iteration.
  The best read rate of these bytes.
- "tiles": the W4A16 kernel's grid (n-tile, tile slot) and per-program order: one
  [block_n rows, BLOCK words] tile per packing unit (8 scale blocks), the units in K order,
  pipelined by `tl.range(num_stages=...)` (cp.async into shared memory, as the kernel's weight
  loads are); num_stages 1 = direct loads into registers. `split` S > 1: each program only
  1/S of the units (S times more programs, shorter contiguous runs); `scales`: also the
  kernel's int64 scale word per row and unit.
- "persistent": programs = a multiple of the SM count, each looping over (expert, n-tile)
  work items (in the kernel's launch order) in one flat loop over (item, unit) steps.

Every kernel keeps int32 accumulators (wrapping) and writes one int64 partial sum per program;
`checksum` of the partials mod 2^32 equals `reference_checksum` (torch's sum of the same words) only if each word is read
exactly once. Loop trip counts are constexprs (the interpreter cannot loop to a run-time bound).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import triton
import triton.language as tl

from megapar.moe.kernels.prepare import PreparedWeight

KINDS = ("flat", "tiles", "persistent")
MASK32 = 0xFFFFFFFF


# ---- kernels ------------------------------------------------------------------------------------

@triton.jit
def _stream_flat_kernel(w_ptr, out_ptr, n_words, ITERS: tl.constexpr, REM: tl.constexpr, BLOCK: tl.constexpr,
                        NS: tl.constexpr):
    """Program p sums words [p, p + 1) * ITERS * BLOCK (unmasked, contiguous), then its share of
    the remainder past P * ITERS * BLOCK (REM masked blocks, strided by P)."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    base = w_ptr + pid.to(tl.int64) * (ITERS * BLOCK)
    acc = tl.zeros((BLOCK,), tl.int32)
    for i in tl.range(0, ITERS, num_stages=NS):
        acc += tl.load(base + i * BLOCK + offs)
    main = P.to(tl.int64) * (ITERS * BLOCK)
    for j in tl.static_range(REM):
        o = main + (j * P + pid).to(tl.int64) * BLOCK + offs
        acc += tl.load(w_ptr + o, mask=o < n_words, other=0)
    tl.store(out_ptr + pid, tl.sum(acc.to(tl.int64), 0))


@triton.jit
def _stream_tiles_kernel(w_ptr, s_ptr, out_ptr, N, num_experts,
                         stride_we, stride_wtile, stride_wn, stride_wchunk, stride_se, stride_sn,
                         UNITS: tl.constexpr, SPLIT: tl.constexpr, TILE: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK: tl.constexpr, NS: tl.constexpr, SCALES: tl.constexpr):
    """grid (cdiv(N, BLOCK_N) * SPLIT, slots): program (n-tile, split part s, slot e) sums the
    [BLOCK_N, BLOCK] oct-word tiles of units s * UC .. s * UC + UC - 1 of expert e's rows
    (the W4A16 kernel's addressing); slots past the experts do nothing, as the kernel's."""
    pid0 = tl.program_id(0)
    e = tl.program_id(1)
    pid_n = pid0 // SPLIT
    s = pid0 % SPLIT
    UC: tl.constexpr = (UNITS + SPLIT - 1) // SPLIT
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_b = tl.arange(0, BLOCK)
    e64 = e.to(tl.int64)
    n64 = offs_n.to(tl.int64)
    w_rows = w_ptr + e64 * stride_we + (n64 // TILE) * stride_wtile + (n64 % TILE) * stride_wn
    s_rows = s_ptr + e64 * stride_se + n64 * stride_sn
    acc = tl.zeros((BLOCK_N, BLOCK), tl.int32)
    acc_s = tl.zeros((BLOCK_N,), tl.int32)
    if e < num_experts:
        for i in tl.range(0, UC, num_stages=NS):
            u = s * UC + i
            if UNITS % SPLIT == 0:
                m = n_mask
            else:   # the last part is short
                m = n_mask & (u < UNITS)
            acc += tl.load(w_rows[:, None] + (u * stride_wchunk + offs_b)[None, :], mask=m[:, None], other=0)
            if SCALES:   # the unit's 8 scale bytes of a row: one int64, summed as two int32 halves
                s8 = tl.load(s_rows + u, mask=m, other=0)
                acc_s += s8.to(tl.int32) + (s8 >> 32).to(tl.int32)
    tot = tl.sum(tl.sum(acc.to(tl.int64), 1) + acc_s.to(tl.int64), 0)
    tl.store(out_ptr + e * tl.num_programs(0) + pid0, tot)


@triton.jit
def _stream_persistent_kernel(w_ptr, out_ptr, N, n_tiles, n_items, stride_we, stride_wtile, stride_wn, stride_wchunk,
                              UNITS: tl.constexpr, ITEMS: tl.constexpr, TILE: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK: tl.constexpr, NS: tl.constexpr):
    """Program p takes work items p, p + P, ... (item = expert * n_tiles + n-tile, at most ITEMS
    of them) and sums each item's tiles unit by unit, in one pipelined loop over (item, unit)."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    offs_b = tl.arange(0, BLOCK)
    rows_in = tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK), tl.int32)
    for i in tl.range(0, ITEMS * UNITS, num_stages=NS):
        j = i // UNITS
        u = i - j * UNITS
        item = pid + j * P
        e = item // n_tiles
        offs_n = (item - e * n_tiles) * BLOCK_N + rows_in
        n64 = offs_n.to(tl.int64)
        m = (offs_n < N) & (item < n_items)
        ptrs = (w_ptr + e.to(tl.int64) * stride_we + (n64 // TILE) * stride_wtile + (n64 % TILE) * stride_wn
                + u * stride_wchunk)
        acc += tl.load(ptrs[:, None] + offs_b[None, :], mask=m[:, None], other=0)
    tl.store(out_ptr + pid, tl.sum(tl.sum(acc.to(tl.int64), 1), 0))


# ---- host side ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class StreamConfig:
    """One stream kernel launch. kind: 'flat' | 'tiles' | 'persistent'; block_n: weight rows
    per tile (tiles, persistent); num_warps; num_stages: the loop's tl.range depth (1: direct
    loads); split: K parts per tile (tiles); programs: grid size (flat, persistent); block:
    int32 words per iteration (flat); scales: tiles also read the int64 scale words."""

    kind: str
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3
    split: int = 1
    programs: int = 0
    block: int = 4096
    scales: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"StreamConfig.kind {self.kind!r} is not one of {KINDS}")
        for name in ("block_n", "block"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"StreamConfig.{name} must be a power of two, got {v}")
        if self.split < 1 or self.num_stages < 1 or self.num_warps < 1:
            raise ValueError(f"StreamConfig split, num_stages, num_warps must be >= 1, got {self.split}, "
                             f"{self.num_stages}, {self.num_warps}")
        if self.kind in ("flat", "persistent") and self.programs < 1:
            raise ValueError(f"StreamConfig(kind={self.kind!r}) needs programs >= 1, got {self.programs}")
        if self.scales and self.kind != "tiles":
            raise ValueError(f"StreamConfig.scales is for kind 'tiles', got kind {self.kind!r}")

    def label(self) -> str:
        if self.kind == "flat":
            return f"stream flat P{self.programs} blk{self.block} w{self.num_warps} s{self.num_stages}"
        tile = f"bn{self.block_n} s{self.num_stages} w{self.num_warps}"
        if self.kind == "persistent":
            return f"stream persistent P{self.programs} {tile}"
        if self.split > 1:
            return f"stream split-K S{self.split} {tile}"
        return f"stream tiles {tile}" + (" +scales" if self.scales else "")


def _oct(w: PreparedWeight):
    if not w.is_fp4 or w.packing != "oct":
        raise ValueError(f"the stream kernels read an FP4 weight in oct packing, got {w.fmt} {w.packing}")
    return w.strides()


def stream_bytes(w: PreparedWeight, cfg: StreamConfig) -> int:
    """Bytes the launch reads: the FP4 data (+ the scale bytes with cfg.scales)."""
    return w.data.numel() * w.data.element_size() + (w.scale.numel() if cfg.scales else 0)


def stream(w: PreparedWeight, cfg: StreamConfig, slots: int | None = None) -> torch.Tensor:
    """int64 partial sums (one per program) of the weight words, read as cfg says. slots
    (tiles): the second grid axis; default E + cdiv(E, 16), the W4A16 kernel's at 1 token per
    expert (16-token tiles), whose extra slots have no rows."""
    st = _oct(w)
    E, N, K = w.shape
    units = K // (8 * w.block)
    BLOCK = w.block                     # int32 words per row and unit
    nw, ns = cfg.num_warps, cfg.num_stages
    if cfg.kind == "flat":
        if not w.data.is_contiguous():
            raise ValueError("stream flat reads the weight's storage: it must be contiguous")
        flat = w.data.view(torch.int32).reshape(-1)
        W, P = flat.numel(), cfg.programs
        iters = W // (cfg.block * P)
        rem = triton.cdiv(W - iters * cfg.block * P, cfg.block * P)
        out = torch.empty(P, dtype=torch.int64, device=flat.device)
        _stream_flat_kernel[(P,)](flat, out, W, ITERS=iters, REM=rem, BLOCK=cfg.block, NS=ns, num_warps=nw,
                                  num_stages=ns)
        return out
    n_tiles = triton.cdiv(N, cfg.block_n)
    if cfg.kind == "tiles":
        slots = E + triton.cdiv(E, 16) if slots is None else slots
        sdata = w.scale.view(torch.int64)   # [E, N, units]: 8 scale bytes per row and unit
        grid = (n_tiles * cfg.split, slots)
        out = torch.empty(grid[0] * grid[1], dtype=torch.int64, device=st.data.device)
        _stream_tiles_kernel[grid](st.data, sdata, out, N, E, st.expert, st.tile, st.row, st.chunk,
                                   sdata.stride(0), sdata.stride(1), UNITS=units, SPLIT=cfg.split, TILE=st.tile_n,
                                   BLOCK_N=cfg.block_n, BLOCK=BLOCK, NS=ns, SCALES=cfg.scales, num_warps=nw,
                                   num_stages=ns)
        return out
    P = cfg.programs
    items = E * n_tiles
    out = torch.empty(P, dtype=torch.int64, device=st.data.device)
    _stream_persistent_kernel[(P,)](st.data, out, N, n_tiles, items, st.expert, st.tile, st.row, st.chunk,
                                    UNITS=units, ITEMS=triton.cdiv(items, P), TILE=st.tile_n, BLOCK_N=cfg.block_n,
                                    BLOCK=BLOCK, NS=ns, num_warps=nw, num_stages=ns)
    return out


def checksum(partials: torch.Tensor) -> int:
    """The partial sums' total mod 2^32."""
    return int(partials.to(torch.int64).sum()) & MASK32


def reference_checksum(w: PreparedWeight, scales: bool = False) -> int:
    """torch's sum of the weight's int32 words (+ its scale bytes read as int32) mod 2^32."""
    total = int(w.data.reshape(-1).view(torch.int32).to(torch.int64).sum())
    if scales:
        total += int(w.scale.reshape(-1).view(torch.int32).to(torch.int64).sum())
    return total & MASK32


# ---- the probe section ----------------------------------------------------------------------------

def configs(default: tuple[int, int, int], sms: int, units: int, tiny: bool) -> list[StreamConfig]:
    """decode5's launches for one problem. default: the W4A16 decode config's (block_n,
    num_stages, num_warps); sms: the SM count; units: packing units along K."""
    bn0, ns0, nw0 = default
    if tiny:   # the interpreter: a few small launches of every kind
        return [StreamConfig("flat", programs=3, block=256, num_warps=4, num_stages=1),
                StreamConfig("flat", programs=2, block=128, num_warps=4, num_stages=2),
                StreamConfig("tiles", bn0, nw0, ns0), StreamConfig("tiles", 32, 4, 1),
                StreamConfig("tiles", bn0, nw0, ns0, scales=True),
                StreamConfig("tiles", 32, 4, 2, split=2), StreamConfig("tiles", 32, 4, 2, split=3),
                StreamConfig("persistent", 32, 4, 2, programs=3), StreamConfig("persistent", bn0, 4, 1, programs=2)]
    cfgs = [StreamConfig("flat", programs=sms * m, block=blk, num_warps=nw, num_stages=ns)
            for m, blk, nw, ns in ((4, 4096, 8, 1), (8, 4096, 8, 1), (2, 8192, 8, 1), (4, 2048, 4, 1),
                                   (1, 8192, 16, 1), (4, 4096, 8, 3))]
    grid = [(bn, ns, nw) for bn in (64, 128, 256) for ns in (2, 3, 4) for nw in (4, 8)]
    grid = [default] + [g for g in grid if g != default] + [(128, 1, 4), (128, 1, 8)]
    cfgs += [StreamConfig("tiles", bn, nw, ns) for bn, ns, nw in grid]
    cfgs += [StreamConfig("tiles", bn0, nw0, ns0, scales=True)]
    cfgs += [StreamConfig("tiles", bn, nw0, ns0, split=s) for bn in dict.fromkeys((64, bn0)) for s in (2, 4, 8) if s <= units]
    cfgs += [StreamConfig("persistent", bn, nw, ns, programs=sms * m)
             for bn, ns, nw in ((bn0, ns0, nw0), (128, 4, 8)) for m in (1, 2, 3)]
    return cfgs


def variants(w: PreparedWeight, default: tuple[int, int, int], sms: int, ceiling_gbps: float, tiny: bool
             ) -> list[tuple[str, Callable[[], Any], Callable[[Any], float], dict[str, Any]]]:
    """(name, launch, check, row info) per decode5 launch on weight w. The check gives 0.0 when
    the partials' checksum is torch's (every byte read once), else 1.0; info: floor_us (the
    bytes read at the copy ceiling), bytes, cfg."""
    E, N, K = w.shape
    refs = {s: reference_checksum(w, s) for s in (False, True)}
    out = []
    for cfg in configs(default, sms, K // (8 * w.block), tiny):
        nbytes = stream_bytes(w, cfg)
        what = "data + scales" if cfg.scales else "data only (scales excluded)"
        out.append((cfg.label(), (lambda cfg=cfg: stream(w, cfg)),
                    (lambda p, ref=refs[cfg.scales]: 0.0 if checksum(p) == ref else 1.0),
                    dict(floor_us=nbytes / (ceiling_gbps * 1e3), bytes=nbytes, reads=what, cfg=dict(cfg.__dict__))))
    return out


def verdict(results: list[dict[str, Any]]) -> list[str]:
    """decode5, per problem: the best correct row of each kind (floor fraction) and the W4A16
    kernel's default beside them, one line each."""
    rows = [r for r in results if r.get("section") == "decode5" and "us" in r]
    lines = []
    for prob in dict.fromkeys(r["problem"] for r in rows):
        mine = [r for r in rows if r["problem"] == prob and r.get("rel_err", 0.0) == 0.0]
        parts = []
        for tag, pick in (("flat", lambda c: c["kind"] == "flat"),
                          ("tiles", lambda c: c["kind"] == "tiles" and c["split"] == 1 and not c["scales"]),
                          ("split-K", lambda c: c["kind"] == "tiles" and c["split"] > 1),
                          ("persistent", lambda c: c["kind"] == "persistent")):
            cands = [r for r in mine if "cfg" in r and "kind" in r["cfg"] and pick(r["cfg"])]
            if cands:
                b = min(cands, key=lambda r: r["us"])
                parts.append(f"{tag} {b['us']:.1f} us ({b['floor_frac']:.2f})")
        kern = [r for r in rows if r["problem"] == prob and r["name"].endswith("w4a16 default")]
        if kern:
            parts.append(f"w4a16 default {kern[0]['us']:.1f} us ({kern[0]['floor_frac']:.2f} of its floor)")
        lines.append(f"decode5 {prob}: best " + ", ".join(parts))
    return lines


# ---- sm_90a compile check (bench/debug/kernel_sass.py's case format) -------------------------------

def sass_cases(E: int = 32, N: int = 4096, K: int = 7168, sms: int = 132) -> dict[str, tuple[str, dict, dict]]:
    """label -> (kernel, pointer dtypes, constexprs) of the decode5 launches on an [E, N, K]
    MXFP4 weight in 64-row tiles (V3 L1 by default), for `kernel_sass.report` (`sass_report`)."""
    units, words = K // 256, E * N * K // 8
    ptrs = dict(w_ptr="*i32", s_ptr="*i64", out_ptr="*i64")
    cases: dict[str, tuple[str, dict, dict]] = {}
    for cfg in [StreamConfig("flat", programs=sms * 4, block=4096, num_warps=8, num_stages=1),
                StreamConfig("flat", programs=sms * 4, block=4096, num_warps=8, num_stages=3),
                StreamConfig("tiles", 128, 4, 3), StreamConfig("tiles", 256, 8, 4), StreamConfig("tiles", 128, 4, 1),
                StreamConfig("tiles", 128, 4, 3, scales=True), StreamConfig("tiles", 128, 4, 3, split=8),
                StreamConfig("persistent", 128, 4, 3, programs=sms), StreamConfig("persistent", 128, 8, 4,
                                                                                  programs=sms * 2)]:
        opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        if cfg.kind == "flat":
            iters = words // (cfg.block * cfg.programs)
            rem = triton.cdiv(words - iters * cfg.block * cfg.programs, cfg.block * cfg.programs)
            cases[cfg.label()] = ("_stream_flat_kernel", ptrs, dict(ITERS=iters, REM=rem, BLOCK=cfg.block,
                                                                    NS=cfg.num_stages, **opts))
        elif cfg.kind == "tiles":
            cases[cfg.label()] = ("_stream_tiles_kernel", ptrs, dict(UNITS=units, SPLIT=cfg.split, TILE=64,
                                                                     BLOCK_N=cfg.block_n, BLOCK=32, NS=cfg.num_stages,
                                                                     SCALES=cfg.scales, **opts))
        else:
            items = E * triton.cdiv(N, cfg.block_n)
            cases[cfg.label()] = ("_stream_persistent_kernel", ptrs,
                                  dict(UNITS=units, ITEMS=triton.cdiv(items, cfg.programs), TILE=64,
                                       BLOCK_N=cfg.block_n, BLOCK=32, NS=cfg.num_stages, **opts))
    return cases


def sass_report(path: str | None = None) -> None:
    """Compile `sass_cases()` for sm_90a (no GPU needed) and print registers, spills, shared
    memory and the global-load instructions of each: `python -m megapar.launch.bench.stream_probe`."""
    import sys
    import types
    from pathlib import Path

    here = Path(__file__).resolve()
    sys.path.insert(0, str(here.parents[2] / "bench" / "debug"))
    import kernel_sass

    kernel_sass.PACKAGES.setdefault(here.name, "megapar.launch.bench")
    # kernel_sass runs the source as module "kernel_under_test"; dataclasses look their module up by name
    sys.modules.setdefault("kernel_under_test", types.ModuleType("kernel_under_test"))
    kernel_sass.report(sass_cases(), path or str(here))


if __name__ == "__main__":
    sass_report()
