"""Triton quantize/dequantize kernels: bit-identical to the torch reference.

CPU: the kernels run under the Triton interpreter on small fp32 inputs (a private copy of
moe.quant.triton_quant is loaded with TRITON_INTERPRET=1, so the rest of the test session is
unaffected). GPU (`-m gpu`): the real kernels through the public API, fp32/bf16/fp16 inputs,
poisoned allocator, empty and odd shapes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from moe.quant import QuantizedTensor, dequantize, pack_fp4, quantize, unpack_fp4
from moe.quant.formats import FORMATS

_PATH = os.path.join(os.path.dirname(__file__), "..", "moe", "quant", "triton_quant.py")


# The interpreter only works when TRITON_INTERPRET=1 was set before triton was first imported
# (triton.language's own helpers are jitted at import), so without it the interpreter cases
# run in one subprocess that has it (test_interpreter_cases_in_subprocess).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERPRET, reason="runs in the TRITON_INTERPRET=1 subprocess")
# the interpreter evaluates masked-off lanes too (x / 0 there): numpy warns, the result is unused
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

if INTERPRET:
    # The interpreter's fma rounds twice (x * y in fp32, then + z); the kernels' division needs
    # a real fma (its remainder must be exact). fp64 gives that for fp32 operands (the rare
    # double rounding of the final correction aside, which these small inputs do not hit).
    # The `tq` fixture installs it per test.
    import numpy as np
    from triton.runtime import interpreter as _interp

    def _fma_fp64(self, x, y, z):
        out = x.data.astype(np.float64) * y.data.astype(np.float64) + z.data.astype(np.float64)
        return _interp.TensorHandle(out.astype(z.data.dtype), z.dtype.scalar)

    import triton
    import triton.language as tl

    from moe.quant import triton_quant as _tqk

    @triton.jit
    def _helpers_kernel(y_ptr, d_ptr, e2m1_ptr, e4m3_ptr, div_ptr, val_ptr, N: tl.constexpr):
        """The device helpers applied elementwise."""
        i = tl.arange(0, N)
        y = tl.load(y_ptr + i)
        d = tl.load(d_ptr + i)
        tl.store(e2m1_ptr + i, _tqk.e2m1_code(y))
        tl.store(e4m3_ptr + i, _tqk.e4m3_byte(y).to(tl.int32))
        tl.store(div_ptr + i, _tqk._div_abs_fast(y, d, tl.div_rn(1.0, d)))
        tl.store(val_ptr + i, _tqk.e2m1_value(i % 16))


def _pin_blocks(tq, monkeypatch) -> None:
    """The FP4 quantize "blocks" kernel (the default until 2026-12-03, now opt-in; `CONFIG["fp4_quant"]`
    sizes its tiles) for a test written for it: the "lines" default has its own tests."""
    for op in ("mxfp4_quant", "nvfp4_quant"):
        monkeypatch.setitem(tq.VARIANTS, op, "blocks")


@pytest.fixture
def tq(monkeypatch):
    """moe.quant.triton_quant; under the interpreter with an exact fma and the fma division on
    (as on GPU), for this test only."""
    pytest.importorskip("triton")
    from moe.quant import triton_quant
    if INTERPRET:
        monkeypatch.setattr(_interp.InterpreterBuilder, "create_fma", _fma_fp64)
        monkeypatch.setattr(triton_quant, "FMA_DIVISION", triton_quant.tl.constexpr(True))
    return triton_quant


if not INTERPRET:   # (interpreting, this process runs the same cases itself: nothing to start)
    def test_interpreter_cases_in_subprocess():
        """Without TRITON_INTERPRET (a GPU machine), the interpreter cases in a child process."""
        pytest.importorskip("triton")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "TRITON_INTERPRET": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                               os.path.abspath(__file__), "-m", "not gpu", "-k", "not subprocess"],
                              cwd=root, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
        assert " passed" in proc.stdout and " skipped" not in proc.stdout.split("\n")[-2], proc.stdout[-2000:]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns; for floats NaN must sit at the same places (its payload may differ:
    CUDA makes canonical NaNs)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point and a.element_size() > 1:
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(nan_a, nan_b) and torch.equal(a.view(ints)[~nan_a], b.view(ints)[~nan_b])
    if a.element_size() == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def _assert_same_q(a: QuantizedTensor, b: QuantizedTensor) -> None:
    assert a.fmt == b.fmt and a.shape == b.shape
    assert _same_bits(a.data, b.data), f"{a.fmt} data differs at {(a.data.view(torch.uint8) != b.data.view(torch.uint8)).nonzero()[:5].tolist()}"
    assert _same_bits(a.scale, b.scale), f"{a.fmt} scale differs"
    if a.global_scale is not None or b.global_scale is not None:
        assert _same_bits(a.global_scale, b.global_scale)


def _awkward(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random fp32 with per-row magnitudes over a wide range, plus the cases the rules care about."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 20, (*shape[:-1], 1), generator=g).float())
    flat = x.view(-1, shape[-1])
    flat[0, :32] = 0.0                                               # all-zero block
    if shape[-1] >= 64:
        flat[0, 32] = -0.0
        flat[0, 33] = 6.0                                            # exactly at 6 * 2^0
        flat[0, 34] = torch.nextafter(torch.tensor(6.0), torch.tensor(7.0))
    if flat.shape[0] > 1:
        flat[-1, :16] = torch.tensor([3 * 2.0**-128, 2.0**-149, -(2.0**-130), 1e-40] * 4)   # subnormals
    if flat.shape[0] > 2:
        flat[1, 5] = 2.0**120                                        # very large values
        flat[2, :] *= 2.0**-100                                      # tiny row
    return x


def _e4m3_probe_row() -> torch.Tensor:
    """448 (so ue8m0 gives scale 1), every E4M3 value and every midpoint, both signs."""
    vals = torch.arange(127, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (vals[1:] + vals[:-1]) / 2
    row = torch.cat([torch.tensor([448.0]), vals, mids, -vals, -mids, torch.tensor([1e-5, 2.0**-10 * 0.75])])
    return torch.nn.functional.pad(row, (0, -row.numel() % 128)).reshape(1, -1)


# ------------------------------------------------------------------ interpreter (CPU)


@interp
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_fp4_quantize_matches_reference_bits(tq, fmt):
    x = _awkward((5, 96), 0)
    _assert_same_q(tq.quantize(x, fmt), quantize(x, fmt, backend="torch"))
    empty = torch.empty(0, 64)
    _assert_same_q(tq.quantize(empty, fmt), quantize(empty, fmt, backend="torch"))
    assert tq.dequantize(tq.quantize(empty, fmt)).shape == (0, 64)
    y = x.clone()
    y[3, 40] = float("nan")
    _assert_same_q(tq.quantize(y, fmt), quantize(y, fmt, backend="torch"))
    if fmt == "nvfp4":
        w = _awkward((3, 4, 64), 1)
        for gs in ("matrix", torch.tensor([1e-3, 1e-38, 2.0]), 1e-30):
            _assert_same_q(tq.quantize(w, fmt, global_scale=gs), quantize(w, fmt, backend="torch", global_scale=gs))
        z = torch.zeros(2, 32)
        _assert_same_q(tq.quantize(z, fmt), quantize(z, fmt, backend="torch"))
        w = _awkward((2, 64, 128), 13)                                 # amax kernel: whole chunks (EVEN)
        w[1, 3, 5] = -(2.0**100)
        for gs in (None, "matrix"):
            _assert_same_q(tq.quantize(w, fmt, global_scale=gs), quantize(w, fmt, backend="torch", global_scale=gs))
        w[0, 7, 9] = float("nan")                                      # NaN tensor / matrix scale
        for gs in (None, "matrix"):
            _assert_same_q(tq.quantize(w, fmt, global_scale=gs), quantize(w, fmt, backend="torch", global_scale=gs))


@interp
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_fp4_dequantize_matches_reference_bits_for_every_scale_byte(tq, fmt):
    g = torch.Generator().manual_seed(2)
    bs = FORMATS[fmt].block[1]
    codes = torch.randint(0, 16, (256, bs), generator=g, dtype=torch.uint8)
    scale = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(256, 1)
    gs = torch.tensor(0.37) if fmt == "nvfp4" else None
    q = QuantizedTensor(pack_fp4(codes), scale, fmt, torch.Size((256, bs)), gs)
    for dtype in (torch.float32, torch.float16, torch.float64):
        assert _same_bits(tq.dequantize(q, dtype), dequantize(q, dtype, backend="torch")), dtype
    if fmt == "nvfp4":
        qm = quantize(_awkward((3, 4, 64), 3), fmt, global_scale="matrix")
        assert _same_bits(tq.dequantize(qm), dequantize(qm, backend="torch"))


@interp
@pytest.mark.parametrize("variant", ["lines", "blocks"])
def test_mxfp4_tiny_blocks_clamp_to_e8m0_byte_0_and_dequantize_to_2_pow_minus_127(tq, monkeypatch, variant):
    """Blocks whose amax is 0, subnormal, 2^-126 or up to 6 * 2^-127 get scale byte 0 (2^-127, the
    bottom of E8M0) as in the reference, the next fp32 up byte 1; the kernel's dequantize reads
    byte 0 as 2^-127 (math.ldexp), not 0, so on-grid values come back exactly."""
    import math
    monkeypatch.setitem(tq.VARIANTS, "mxfp4_quant", variant)
    g = torch.Generator().manual_seed(31)
    amaxes = [0.0, 2.0**-149, 2.0**-133, 2.0**-127, 2.0**-126, 6 * 2.0**-127,
              float(torch.nextafter(torch.tensor(6 * 2.0**-127), torch.tensor(1.0))), 2.0**-124]
    x = (torch.rand(8, 32, generator=g) * 2 - 1) * torch.tensor(amaxes)[:, None]
    x[torch.arange(8), torch.arange(8)] = torch.tensor(amaxes) * torch.tensor([1.0, -1.0] * 4)
    q = tq.quantize(x, "mxfp4")
    _assert_same_q(q, quantize(x, "mxfp4", backend="torch"))
    assert q.scale.reshape(-1).tolist() == [0, 0, 0, 0, 0, 0, 1, 1]
    codes = unpack_fp4(q.data)
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    want = torch.tensor([[(-1 if c & 8 else 1) * math.ldexp(e2m1[c & 7], s - 127) for c in row]
                         for row, s in zip(codes.tolist(), q.scale.reshape(-1).tolist())], dtype=torch.float64)
    assert torch.equal(tq.dequantize(q, torch.float64), want)
    assert tq.dequantize(q)[5, 5].item() == -6 * 2.0**-127
    on_grid = torch.tensor([2.0**-128, -(2.0**-127), 1.5 * 2.0**-127, 3 * 2.0**-127, 6 * 2.0**-127] + [0.0] * 27)
    assert torch.equal(tq.dequantize(tq.quantize(on_grid.reshape(1, 32), "mxfp4")), on_grid.reshape(1, 32))


@interp
@pytest.mark.parametrize("ue8m0", [False, True])
def test_fp8_quantize_matches_reference_bits(tq, ue8m0):
    x = _awkward((4, 200), 4)
    x[1, 7] = float("nan")
    for fmt in ("fp8_token", "fp8_group"):
        _assert_same_q(tq.quantize(x, fmt, ue8m0=ue8m0), quantize(x, fmt, backend="torch", ue8m0=ue8m0))
    w = _awkward((2, 130, 260), 5)
    _assert_same_q(tq.quantize(w, "fp8_block", ue8m0=ue8m0), quantize(w, "fp8_block", backend="torch", ue8m0=ue8m0))
    long_rows = _awkward((2, 9000), 6)                               # the two-pass row kernel
    _assert_same_q(tq.quantize(long_rows, "fp8_token", ue8m0=ue8m0),
                   quantize(long_rows, "fp8_token", backend="torch", ue8m0=ue8m0))
    probe = _e4m3_probe_row()                                        # every rounding case of E4M3
    for fmt in ("fp8_token", "fp8_group"):
        _assert_same_q(tq.quantize(probe, fmt, ue8m0=True), quantize(probe, fmt, backend="torch", ue8m0=True))


@interp
def test_device_helpers_match_reference_on_every_bf16_and_random_fp32(tq):
    """e2m1_code / e4m3_byte on all 65536 bf16 patterns (every exponent, ties, inf, NaN) and
    random fp32 bits near the grids; _div_abs_fast against IEEE fp32 division; e2m1_value on all codes."""
    from moe.quant.formats import e2m1_to_float
    from moe.quant.reference import _to_e4m3

    n = 1 << 17
    g = torch.Generator().manual_seed(8)
    bf16 = (torch.arange(1 << 16, dtype=torch.int32) << 16).view(torch.float32)
    near = (torch.randint(0, 1 << 23, (n // 2,), generator=g, dtype=torch.int32)
            | ((torch.randint(100, 140, (n // 2,), generator=g, dtype=torch.int32)) << 23)
            | (torch.randint(0, 2, (n // 2,), generator=g, dtype=torch.int32) << 31)).view(torch.float32)
    y = torch.cat([bf16, near])
    d = torch.exp2(torch.randint(-64, 64, (n,), generator=g).float()) * (1 + torch.rand(n, generator=g))
    d = d.clamp(2.0**-64, 2.0**64)
    e2m1, e4m3, val = (torch.empty(n, dtype=torch.int32) for _ in range(3))
    val = torch.empty(n)
    div = torch.empty(n)
    _helpers_kernel[(1,)](y, d, e2m1, e4m3, div, val, N=n)
    assert torch.equal(e2m1, quantize_ref_e2m1(y)), (y[e2m1 != quantize_ref_e2m1(y)][:5])
    ref8 = _to_e4m3(y).view(torch.uint8).int()
    assert torch.equal(e4m3, ref8), y[e4m3 != ref8][:5]
    ok = torch.isfinite(y) & (y.abs() >= 2.0**-90) & ((y.abs() / d) <= 2.0**64)
    # (for |x| < 2^-90 the remainder may underflow and the quotient differ in its last bits;
    # with d >= 2^-64 such quotients are below 2^-26, and no E4M3 / E2M1 code depends on
    # those bits: the kernel tests cover tiny inputs through the codes)
    want = torch.from_numpy(y.abs().numpy() / d.numpy())            # IEEE fp32 division
    assert ok.sum() > n // 2
    assert _same_bits(div[ok], want[ok]), y[ok][div[ok].view(torch.int32) != want[ok].view(torch.int32)][:5]
    assert _same_bits(val[:16], e2m1_to_float(torch.arange(16, dtype=torch.uint8)))


def quantize_ref_e2m1(y: torch.Tensor) -> torch.Tensor:
    from moe.quant.reference import round_to_e2m1
    return round_to_e2m1(y).int()


@interp
def test_full_partial_clean_and_nonfinite_tiles_match_reference(tq, monkeypatch):
    """Tiny tiles, so one launch mixes unmasked (EVEN) and masked launches, fast tiles and the
    per-program fallbacks (NaN, inf, scales beyond 2^+-64, zero / tiny nvfp4 scales)."""
    _pin_blocks(tq, monkeypatch)
    for name, cfg in (("fp4_quant", (4, 4)), ("fp4_dequant", (4, 4)), ("fp8_group", (2, 4)), ("fp8_dequant", (2, 4))):
        monkeypatch.setitem(tq.CONFIG, name, cfg)
    g = torch.Generator().manual_seed(9)
    clean = [torch.randn(8, 256, generator=g) * 3, torch.randn(5, 96, generator=g), torch.randn(3, 2, 64, generator=g)]
    dirty = torch.randn(6, 128, generator=g)
    dirty[0, 3] = float("nan")
    dirty[2, 40] = float("inf")
    dirty[3, 70] = -(2.0**120)
    dirty[4, :] *= 2.0**-90
    dirty[5, 100:] = 0.0
    cases = [(x, {}) for x in (*clean, clean[0].to(torch.bfloat16), clean[1].to(torch.float16), dirty)]
    for x, _ in list(cases):
        if x.dim() == 3:
            cases += [(x, {"global_scale": "matrix"})]
    for fmt in ("mxfp4", "nvfp4", "fp8_token", "fp8_group", "fp8_block"):
        for x, opts in cases:
            if fmt != "nvfp4" and opts or fmt == "fp8_block" and x.dim() < 2:
                continue
            optsets = [opts]
            if fmt == "nvfp4" and not opts:
                optsets += [{"global_scale": 0.01}, {"global_scale": 1e-30}, {"global_scale": 1e-40}]
            if fmt.startswith("fp8"):
                optsets += [{"ue8m0": True}]
            for o in optsets:
                got = tq.quantize(x, fmt, **o)
                ref = quantize(x, fmt, backend="torch", **o)
                _assert_same_q(got, ref)
                assert _same_bits(tq.dequantize(got, torch.float16), dequantize(ref, torch.float16, backend="torch")), (fmt, o)


@interp
def test_nvfp4_bf16_weights_with_exact_ties_match_reference_bits(tq, monkeypatch):
    """bf16 weights: elements sharing the global amax's mantissa give quotients within a few
    fp32 ulp of an E2M1 boundary (3.5, 1.75, ...) in most blocks, and a power-of-two global scale
    puts them exactly on it (ties), so the kernel's fp32 exact tie-break (no float64 tile)
    decides many codes; every bit must match the reference, and the data must really hold
    both kinds."""
    monkeypatch.setitem(tq.CONFIG, "fp4_quant", (256, 4))
    _pin_blocks(tq, monkeypatch)
    g = torch.Generator().manual_seed(31)
    w = (torch.randn(4, 16, 7168, generator=g) * 0.02).to(torch.bfloat16)     # near / tie counts 307, 86, 1870
    from parallel.quant.reference import _E2M1_BOUNDS_GE, _E2M1_BOUNDS_GT
    bounds = torch.tensor([*_E2M1_BOUNDS_GT, *_E2M1_BOUNDS_GE], dtype=torch.float64)
    for gs, kind in ((None, "near"), ("matrix", "near"), (2.0**-12, "tie")):
        ref = quantize(w, "nvfp4", backend="torch", global_scale=gs)
        d = (ref.scale.float().double() * ref.global_scale.double().reshape(-1, 1, 1)).unsqueeze(-1)
        q = w.double().abs().reshape(*ref.scale.shape, 16) / d                   # exact quotients
        rel = (q.unsqueeze(-1) / bounds - 1).abs().amin(-1)
        count = int((rel == 0).sum()) if kind == "tie" else int(((rel > 0) & (rel < 2.0**-20)).sum())
        assert count > 10, (gs, kind, count)
        _assert_same_q(tq.quantize(w, "nvfp4", global_scale=gs), ref)
    monkeypatch.setitem(tq.VARIANTS, "nvfp4_quant", "lines")           # the default kernel on the exact ties
    _assert_same_q(tq.quantize(w, "nvfp4", global_scale=2.0**-12), ref)


@interp
def test_nvfp4_midpoints_match_reference_bits(tq, monkeypatch):
    """Exact E2M1 midpoints x = m * s * g (where fp32 rounds s * g or the quotient to the other
    side) and their neighbours one ulp away, in fast and fallback tiles alike."""
    monkeypatch.setitem(tq.CONFIG, "fp4_quant", (4, 4))
    x = torch.tensor([6.0, 1.75, 3.5] + [0.0] * 13)
    _pin_blocks(tq, monkeypatch)
    q = tq.quantize(x, "nvfp4")
    assert unpack_fp4(q.data)[:3].tolist() == [7, 3, 5]                # exact quotients 6, 0.75, 1.5
    _assert_same_q(q, quantize(x, "nvfp4", backend="torch"))
    g = torch.Generator().manual_seed(21)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    gs = torch.rand(8, generator=g) * 0.01 + 1e-3                      # awkward tensor scales
    rows = []
    for gv in gs.tolist():
        d = torch.tensor(448.0, dtype=torch.float64) * torch.tensor(gv, dtype=torch.float32).double()
        blk = torch.zeros(16, dtype=torch.float64)
        blk[0] = 6 * d                                                  # amax: s = 448 exactly
        blk[1:8] = mids.double() * d
        row = blk.float()
        rows += [row, torch.nextafter(row, torch.full_like(row, 1e9)), -torch.nextafter(row, torch.zeros_like(row))]
    x = torch.stack(rows)                                               # [24, 16]
    for variant in ("blocks", "lines"):                                  # (lines: the default kernel)
        monkeypatch.setitem(tq.VARIANTS, "nvfp4_quant", variant)
        for gv in gs.tolist():
            got = tq.quantize(x, "nvfp4", global_scale=gv)
            _assert_same_q(got, quantize(x, "nvfp4", backend="torch", global_scale=gv))


def _nvfp4_boundary_blocks(mats: int, blocks: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x fp32 [mats, blocks, 16], per-matrix global scales [mats]): each block's amax sets a
    random E4M3 scale s, the other elements sit at b * s * g (b: the seven E2M1 boundaries and
    the code points) rounded to fp32 and moved by -3..3 ulp, with zeros, -0.0, subnormals and
    sign flips mixed in; global scales from 2^-110 to 2^60, so some s * g leave [2^-96, 2^96]."""
    from parallel.quant.reference import _nvfp4_gs, quantize_nvfp4

    g = torch.Generator().manual_seed(seed)
    gs = torch.exp2(torch.randint(-110, 60, (mats,), generator=g).float()) * (1 + torch.rand(mats, generator=g))
    gs[:4] = torch.tensor([2.0**-12, 1.0 / 3, 2.0**-100, 2.0**90])          # powers of two: exact ties (fast, fallback)
    s_target = torch.exp2(torch.randint(-9, 9, (mats, blocks), generator=g).float())
    s_target = (s_target * torch.randint(8, 16, (mats, blocks), generator=g) / 8)
    x = torch.zeros(mats, blocks, 16)
    x[..., 0] = (6 * s_target.double() * gs.double()[:, None]).float()       # amax: s near s_target
    s = quantize_nvfp4(x, global_scale=gs).scale.view(torch.float8_e4m3fn).float()[..., 0]   # [mats, blocks]
    d = s.double() * _nvfp4_gs(x, gs).double()[:, None]                        # exact s * g
    b = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 3.0], dtype=torch.float64)
    pick = b[torch.randint(0, len(b), (mats, blocks, 15), generator=g)]
    vals = (pick * d[..., None]).float()                                       # nearest fp32
    steps = torch.randint(-3, 4, vals.shape, generator=g, dtype=torch.int32)
    vals = torch.where(vals > 0, (vals.view(torch.int32) + steps).view(torch.float32), vals)
    u = torch.rand(vals.shape, generator=g)
    vals = torch.where(u < 0.03, 0.0, vals)
    vals = torch.where((u >= 0.03) & (u < 0.05), -0.0, vals)
    vals = torch.where((u >= 0.05) & (u < 0.06), 2.0**-140, vals)
    vals = torch.where(torch.rand(vals.shape, generator=g) < 0.5, -vals, vals)
    x[..., 1:] = vals
    return x, gs


@interp
def test_nvfp4_values_next_to_every_boundary_match_reference_bits(tq, monkeypatch):
    """Seeded: values within 3 fp32 ulp of b * s * g for every E2M1 boundary b, over random E4M3
    block scales and global scales 2^-110 .. 2^60 (the threshold tiles and the float64 tiles
    that extreme s * g send to the fallback), per matrix, with a partial last program; then the
    same blocks in bf16 (ties where g is a power of two)."""
    monkeypatch.setitem(tq.CONFIG, "fp4_quant", (8, 4))                 # 16 blocks per program
    _pin_blocks(tq, monkeypatch)
    x, gs = _nvfp4_boundary_blocks(6, 37, 41)                          # 222 blocks: 13 full programs + 1 partial
    _assert_same_q(tq.quantize(x, "nvfp4", global_scale=gs), quantize(x, "nvfp4", backend="torch", global_scale=gs))
    for i in range(4):                                                  # one tensor scale
        _assert_same_q(tq.quantize(x[i], "nvfp4", global_scale=gs[i].item()),
                       quantize(x[i], "nvfp4", backend="torch", global_scale=gs[i].item()))
    xb = x.to(torch.bfloat16)
    for opts in ({"global_scale": gs}, {"global_scale": "matrix"}, {}):
        _assert_same_q(tq.quantize(xb, "nvfp4", **opts), quantize(xb, "nvfp4", backend="torch", **opts))


@interp
@pytest.mark.parametrize("variant", ["tile", "chunks"])
def test_fp8_dequantize_matches_reference_bits(tq, monkeypatch, variant):
    monkeypatch.setitem(tq.VARIANTS, "fp8_dequant", variant)
    monkeypatch.setitem(tq.CONFIG, "fp8_dequant_chunks", (16, 4))       # (partial programs)
    g = torch.Generator().manual_seed(7)
    for fmt, shape in (("fp8_token", (3, 5, 70)), ("fp8_group", (4, 300)), ("fp8_block", (2, 130, 260))):
        q = quantize(torch.randn(shape, generator=g), fmt)
        q.data = torch.randint(0, 256, shape, generator=g, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
        for dtype in (torch.float32, torch.float16):
            assert _same_bits(tq.dequantize(q, dtype), dequantize(q, dtype, backend="torch")), (fmt, dtype)


@interp
@pytest.mark.parametrize("fmt,opts", [("mxfp4", {"global_scale": 0.5}), ("mxfp4", {"global_scale": "matrix"}),
                                      ("nvfp4", {"scale_rule": "floor"}), ("nvfp4", {"scale_rule": "bogus"})])
def test_fp4_quantize_refuses_the_other_fp4_formats_option_as_the_reference_does(tq, fmt, opts):
    """Same contract on both backends: an option of the other FP4 format is a TypeError (it was
    silently ignored by the Triton path: an mxfp4 global scale or an nvfp4 floor rule on CUDA
    quantized without it, where the torch path refused it)."""
    x = torch.randn(2, 3, 64)
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        quantize(x, fmt, backend="torch", **opts)
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        tq.quantize(x, fmt, **opts)
    own = {"mxfp4": {"scale_rule": "floor"}, "nvfp4": {"global_scale": 0.5}}[fmt]   # its own option still works
    _assert_same_q(tq.quantize(x, fmt, **own), quantize(x, fmt, backend="torch", **own))


def test_backend_choice():
    x = torch.randn(4, 64)
    ref = quantize(x, "mxfp4", backend="torch")
    assert _same_bits(quantize(x, "mxfp4").data, ref.data)          # auto on CPU: torch
    if INTERPRET:                                                    # triton on CPU tensors only when interpreting
        assert _same_bits(quantize(x, "mxfp4", backend="triton").data, ref.data)
    else:
        with pytest.raises(ValueError, match="CUDA tensor"):
            quantize(x, "mxfp4", backend="triton")


# ------------------------------------------------------------------ GPU


def _poison_allocator(nbytes: int = 1 << 28) -> None:
    """Leave NaN-filled blocks in the CUDA caching allocator so unwritten outputs show up."""
    junk = torch.full((nbytes // 4,), float("nan"), device="cuda")
    del junk


GPU_CASES = [
    ("mxfp4", (7, 512)), ("mxfp4", (4, 256, 7168)), ("mxfp4", (3, 32)),
    ("nvfp4", (5, 48)), ("nvfp4", (4, 256, 7168)),
    ("fp8_token", (33, 7168)), ("fp8_token", (5, 20000)), ("fp8_token", (3, 100)),
    ("fp8_group", (33, 7168)), ("fp8_group", (17, 300)),
    ("fp8_block", (2, 1024, 7168)), ("fp8_block", (3, 130, 260)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt,shape", GPU_CASES)
def test_gpu_quantize_and_dequantize_bit_identical(fmt, shape, dtype):
    x = _awkward(shape, GPU_CASES.index((fmt, shape))).to(dtype)
    x = torch.where(torch.isfinite(x), x, 0).to(dtype)
    if fmt != "nvfp4":                                               # (a NaN makes the nvfp4 tensor scale NaN)
        x.view(-1)[x.numel() // 2] = float("nan")
    ref = quantize(x, fmt, backend="torch")
    _poison_allocator()
    got = quantize(x.cuda(), fmt)                                    # auto -> triton on CUDA
    _assert_same_q(got.to("cpu"), ref)
    for out_dtype in (torch.float32, torch.bfloat16):
        _poison_allocator()
        deq = dequantize(got, out_dtype)
        assert deq.is_cuda
        assert _same_bits(deq.cpu(), dequantize(ref, out_dtype, backend="torch")), out_dtype


_LINES = {"mxfp4_quant": "lines", "nvfp4_quant": "lines"}
GPU_VARIANTS = [   # apply_tuning entries: the opt-in kernels and nvfp4 second-read options
    ("lines", {"variants": _LINES}),
    ("lines-2-tiles-reverse", {"variants": _LINES, "loops": {"mxfp4_lines": 2, "nvfp4_lines": 2}, "nvfp4_reverse": True}),
    ("lines-small-tiles", {"variants": _LINES, "config": {"mxfp4_lines": [32, 1], "nvfp4_lines": [64, 2]}}),
    ("blocks-reverse-by-matrix", {"nvfp4_reverse": True, "nvfp4_group_bytes": 1}),
    ("lines-by-matrix", {"variants": _LINES, "nvfp4_group_bytes": 1}),
    ("dequant-chunks", {"variants": {"fp4_dequant": "chunks"}}),
    ("fp8-token-rows", {"variants": {"fp8_token": "rows"}, "config": {"fp8_token_rows": [2048, 8]}}),
    ("fp8-token-rows-default", {"variants": {"fp8_token": "rows"}}),
    ("fp8-block-unrolled", {"variants": {"fp8_block": "unrolled"}}),
    ("fp8-dequant-chunks", {"variants": {"fp8_dequant": "chunks"}}),
]
GPU_VARIANT_CASES = [("mxfp4", (7, 512)), ("mxfp4", (4, 256, 7168)), ("mxfp4", (3, 32)), ("nvfp4", (5, 48)),
                     ("nvfp4", (3, 5, 48)), ("nvfp4", (4, 256, 7168)), ("fp8_token", (33, 7168)), ("fp8_token", (3, 100)),
                     ("fp8_token", (5, 1000)), ("fp8_block", (2, 256, 384)), ("fp8_block", (3, 130, 260)),
                     ("fp8_group", (33, 7168)), ("fp8_group", (17, 300))]


@pytest.mark.gpu
@pytest.mark.parametrize("label,tuning", GPU_VARIANTS, ids=[v[0] for v in GPU_VARIANTS])
def test_gpu_opt_in_variants_bit_identical(label, tuning):
    """The opt-in kernels on the GPU (the probe times them; this checks them whole): odd block
    counts, partial tiles, lines across matrices, inf / NaN, fp32 and bf16 inputs, tensor and
    per-matrix nvfp4 scales, quantize and dequantize against the CPU reference."""
    from moe.quant import triton_quant as tq

    saved = (dict(tq.CONFIG), dict(tq.VARIANTS), dict(tq.LOOPS), tq.NVFP4_REVERSE, tq.NVFP4_GROUP_BYTES)
    tq.apply_tuning(tuning)
    try:
        for i, (fmt, shape) in enumerate(GPU_VARIANT_CASES):
            for dtype in (torch.float32, torch.bfloat16):
                x = _awkward(shape, 70 + i)
                x = torch.where(torch.isfinite(x), x, 0)
                if fmt != "nvfp4":
                    x.view(-1)[x.numel() // 2] = float("nan")
                    x.view(-1)[x.numel() // 3] = -float("inf")
                x = x.to(dtype)
                for opts in ({}, {"global_scale": "matrix"}) if fmt == "nvfp4" and len(shape) == 3 else ({},):
                    ref = quantize(x, fmt, backend="torch", **opts)
                    _poison_allocator()
                    got = quantize(x.cuda(), fmt, **opts)
                    _assert_same_q(got.to("cpu"), ref)
                    for out_dtype in (torch.float32, torch.bfloat16):
                        _poison_allocator()
                        deq = dequantize(got, out_dtype)
                        assert _same_bits(deq.cpu(), dequantize(ref, out_dtype, backend="torch")), (fmt, shape, out_dtype)
        if tq.VARIANTS["nvfp4_quant"] != "blocks" or tq.NVFP4_GROUP_BYTES:     # the threshold path near every boundary
            x, gs = _nvfp4_boundary_blocks(16, 4099, 52)
            for xx, opts in ((x, {"global_scale": gs}), (x.to(torch.bfloat16), {"global_scale": gs}),
                             (x.to(torch.bfloat16), {"global_scale": "matrix"})):
                _assert_same_q(quantize(xx.cuda(), "nvfp4", **opts).to("cpu"), quantize(xx, "nvfp4", backend="torch", **opts))
    finally:
        tq.CONFIG.update(saved[0])
        tq.VARIANTS.update(saved[1])
        tq.LOOPS.update(saved[2])
        tq.NVFP4_REVERSE, tq.NVFP4_GROUP_BYTES = saved[3], saved[4]


@pytest.mark.gpu
def test_gpu_options_and_empty_tensors():
    x = _awkward((4, 64, 256), 11).to(torch.bfloat16)
    for fmt, opts in (("nvfp4", {"global_scale": "matrix"}), ("nvfp4", {"global_scale": 0.01}),
                      ("fp8_group", {"ue8m0": True}), ("fp8_token", {"ue8m0": True, "amax_floor": 1e-4}),
                      ("fp8_block", {"ue8m0": True}), ("mxfp4", {"scale_rule": "floor"})):
        _assert_same_q(quantize(x.cuda(), fmt, **opts).to("cpu"), quantize(x, fmt, backend="torch", **opts))
    for fmt in ("mxfp4", "nvfp4", "fp8_token", "fp8_group", "fp8_block"):
        e = torch.empty(0, 128, device="cuda", dtype=torch.bfloat16)
        q = quantize(e, fmt)
        assert dequantize(q, torch.bfloat16).shape == (0, 128)


@pytest.mark.gpu
def test_gpu_large_weight_relative_error():
    """117M-element bf16 weight: bits equal the reference on a slice, error vs fp32 sane."""
    w = torch.randn(8, 4096, 3584, device="cuda", dtype=torch.bfloat16)
    for fmt, bound in (("mxfp4", 0.13), ("nvfp4", 0.11), ("fp8_block", 0.035)):  # CPU: 0.115, 0.095, 0.026
        q = quantize(w, fmt, **({"global_scale": "matrix"} if fmt == "nvfp4" else {}))
        deq = dequantize(q, torch.float32)
        rel = ((deq - w.float()).norm() / w.float().norm()).item()
        assert 0.01 < rel < bound, (fmt, rel)
        part = QuantizedTensor(q.data[:1].cpu(), q.scale[:1].cpu(), fmt, torch.Size((1, *w.shape[1:])),
                               None if q.global_scale is None else q.global_scale[:1].cpu())
        assert _same_bits(deq[:1].cpu(), dequantize(part, backend="torch"))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,opts", [("mxfp4", {}), ("nvfp4", {}), ("nvfp4", {"global_scale": "matrix"}),
                                      ("fp8_block", {}), ("fp8_token", {}), ("fp8_group", {}),
                                      ("fp8_group", {"ue8m0": True})])
def test_gpu_fast_path_bits_on_many_clean_values(fmt, opts):
    """7M finite bf16 values (mostly fast-path tiles: fma division, no NaN branch), from randn
    and from rows spread over 2^+-30, against the CPU reference."""
    g = torch.Generator().manual_seed(12)
    x = torch.randn(2, 512, 7168, generator=g)
    x[1] *= torch.exp2(torch.randint(-30, 30, (512, 1), generator=g).float())
    x = x.to(torch.bfloat16)
    ref = quantize(x, fmt, backend="torch", **opts)
    got = quantize(x.cuda(), fmt, **opts)
    _assert_same_q(got.to("cpu"), ref)
    assert _same_bits(dequantize(got, torch.bfloat16).cpu(), dequantize(ref, torch.bfloat16, backend="torch"))


@pytest.mark.gpu
def test_gpu_nvfp4_thresholds_bits_on_a_bf16_weight_and_boundary_blocks():
    """The nvfp4 threshold path on the GPU (real fma, FSET compares): a [4, 512, 7168] bf16
    weight with tensor, per-matrix and power-of-two (tie) global scales, and 1M fp32 / bf16
    values within 3 ulp of every boundary * s * g, against the CPU reference."""
    g = torch.Generator().manual_seed(51)
    w = (torch.randn(4, 512, 7168, generator=g) * 0.02).to(torch.bfloat16)
    for opts in ({}, {"global_scale": "matrix"}, {"global_scale": 2.0**-12}):
        _assert_same_q(quantize(w.cuda(), "nvfp4", **opts).to("cpu"), quantize(w, "nvfp4", backend="torch", **opts))
    x, gs = _nvfp4_boundary_blocks(16, 4099, 52)                       # odd block count: a partial program
    for xx, opts in ((x, {"global_scale": gs}), (x.to(torch.bfloat16), {"global_scale": gs}),
                     (x.to(torch.bfloat16), {"global_scale": "matrix"})):
        _assert_same_q(quantize(xx.cuda(), "nvfp4", **opts).to("cpu"), quantize(xx, "nvfp4", backend="torch", **opts))


@interp
def test_tuning_probe_dry_run_writes_loadable_tuning(tq, tmp_path):
    """`python -m megapar.launch.bench.quant --probe` on CPU under the interpreter: tiny sizes,
    every setting bit-identical, and the file it writes installs through apply_tuning."""
    import json

    from launch.bench.quant import PROBE_SETTINGS, main

    saved = (dict(tq.CONFIG), tq.FP8_HW_CAST, dict(tq.VARIANTS), dict(tq.LOOPS), tq.NVFP4_REVERSE, tq.NVFP4_GROUP_BYTES)
    try:
        assert main(["--probe", "--out", str(tmp_path)]) == 0
        tuning = json.loads((tmp_path / "quant-tuning.json").read_text())
        rows = [r for r in tuning["results"] if r["role"] == "tune"]
        assert {r["kernel"] for r in rows} == set(PROBE_SETTINGS) and all(r.get("bit_identical") for r in rows), \
            [r for r in rows if not r.get("bit_identical")][:3]
        assert {r["variant"] for r in rows} == {None, "blocks", "lines", "chunks", "tile", "rows", "loop", "unrolled"}
        assert any(r["loops"] > 1 for r in rows) and any(r["reverse"] for r in rows) and any(r["group_bytes"] for r in rows)
        diag = {(r["op"], r["kernel"], r.get("what")): r for r in tuning["results"] if r["role"] == "diag"}  # never chosen
        assert sum(what == "DIAG memory only" for *_, what in diag) == 4 and all(r["us"] > 0 for r in diag.values()), diag
        assert ("nvfp4_quant", "fp4_amax", "amax pass only") in diag and ("copy weight", "torch copy_", None) in diag
        assert all(r["bit_identical"] for (op, _, what), r in diag.items()
                   if op == "nvfp4_dequant" or what == "quantize only, given tensor scale")
        assert tq.FP4_QUANT_DIAG == 0 and tq.VARIANTS == saved[2]
        assert set(tuning["config"]) == set(PROBE_SETTINGS) and set(tuning["variants"]) == set(tq.VARIANTS)
        tq.apply_tuning(tuning)
        assert all(tq.CONFIG[k] == tuple(v) for k, v in tuning["config"].items())
        tq.apply_tuning({"variants": {"mxfp4_quant": "lines", "nvfp4_quant": "lines", "fp8_token": "rows",
                                      "fp4_dequant": "chunks", "fp8_block": "unrolled", "fp8_dequant": "chunks"}})
        x = _awkward((4, 4, 128), 30)
        for fmt in ("mxfp4", "nvfp4", "fp8_block", "fp8_token", "fp8_group"):   # the tuned launches, same bits
            q = tq.quantize(x, fmt)
            _assert_same_q(q, quantize(x, fmt, backend="torch"))
            assert _same_bits(tq.dequantize(q), dequantize(q, backend="torch"))
    finally:
        tq.CONFIG.update(saved[0])
        tq.FP8_HW_CAST = saved[1]
        tq.VARIANTS.update(saved[2])
        tq.LOOPS.update(saved[3])
        tq.NVFP4_REVERSE, tq.NVFP4_GROUP_BYTES = saved[4], saved[5]


@interp
@pytest.mark.parametrize("variant", ["blocks", "lines"])
def test_fp4_quant_diag_moves_the_same_bytes_but_is_no_quantization(tq, monkeypatch, variant):
    monkeypatch.setitem(tq.VARIANTS, "mxfp4_quant", variant)
    x = _awkward((2, 4, 128), 31)
    good = tq.quantize(x, "mxfp4")
    _assert_same_q(good, quantize(x, "mxfp4", backend="torch"))
    monkeypatch.setattr(tq, "FP4_QUANT_DIAG", 1)
    diag = tq.quantize(x, "mxfp4")
    assert diag.data.shape == good.data.shape and diag.scale.shape == good.scale.shape
    assert not (torch.equal(diag.data, good.data) and torch.equal(diag.scale, good.scale))


@interp
def test_lines_fp4_quantize_matches_reference_bits(tq, monkeypatch):
    """The opt-in lines kernel (a thread per 32 elements): unmasked programs plus a masked last
    program (rows not a multiple of the tile, an odd nvfp4 block count), tiles per program with
    prefetch (the last prefetch masked off), mxfp4 tiles with inf / NaN (the reload-and-overwrite
    path), nvfp4 per-matrix scales on matrices of an odd block count (a line's blocks in two
    matrices) and an even one, float64-threshold tiles (tiny given scale, NaN tensor scale),
    the backward walk after a computed scale and matrix-by-matrix computed scales."""
    for op in ("mxfp4_quant", "nvfp4_quant"):
        monkeypatch.setitem(tq.VARIANTS, op, "lines")
    mx = _awkward((6, 96), 62)                  # 18 lines
    mx_dirty = mx.clone()
    mx_dirty[2, 40] = float("inf")
    mx_dirty[4, 3] = float("nan")
    nv = _awkward((3, 5, 48), 63)               # 45 blocks; 15 per matrix
    nv_pair = _awkward((2, 4, 64), 64)          # 16 blocks per matrix
    nv_nan = nv.clone()
    nv_nan[1, 2, 7] = float("nan")
    cases = [("mxfp4", mx_dirty, {}), ("nvfp4", nv, {}), ("nvfp4", nv_nan, {"global_scale": "matrix"}),  # NaN: one matrix
             ("mxfp4", mx, {}), ("mxfp4", mx.to(torch.bfloat16), {}), ("nvfp4", nv_pair, {"global_scale": "matrix"}),
             ("nvfp4", nv, {"global_scale": 1e-30})]
    for lines, loops in ((8, 1), (4, 3)):                            # 8 lines per program, or 3 tiles of 4
        for fmt in ("mxfp4", "nvfp4"):
            monkeypatch.setitem(tq.CONFIG, f"{fmt}_lines", (lines, 4))
            monkeypatch.setitem(tq.LOOPS, f"{fmt}_lines", loops)
        for fmt, x, opts in cases if loops == 1 else cases[:3]:
            _assert_same_q(tq.quantize(x, fmt, **opts), quantize(x, fmt, backend="torch", **opts))
    monkeypatch.setitem(tq.CONFIG, "nvfp4_lines", (16, 4))
    monkeypatch.setitem(tq.LOOPS, "nvfp4_lines", 1)
    x, gs = _nvfp4_boundary_blocks(4, 21, 43)                      # values within 3 ulp of every boundary, ties
    _assert_same_q(tq.quantize(x, "nvfp4", global_scale=gs), quantize(x, "nvfp4", backend="torch", global_scale=gs))
    monkeypatch.setattr(tq, "NVFP4_REVERSE", True)                  # (the grouped launch walks backwards too)
    monkeypatch.setattr(tq, "NVFP4_GROUP_BYTES", 1)                  # one matrix at a time
    _assert_same_q(tq.quantize(nv, "nvfp4", global_scale="matrix"), quantize(nv, "nvfp4", backend="torch", global_scale="matrix"))


@interp
def test_blocks_fp4_quantize_backwards_and_matrix_by_matrix_match_reference_bits(tq, monkeypatch):
    """The blocks nvfp4 kernel (opt-in since 2026-12-03) with the opt-in second-read options: programs walking backwards
    (a partial last tile) and per-matrix scales computed and applied matrix by matrix, with a
    NaN matrix."""
    monkeypatch.setitem(tq.CONFIG, "fp4_quant", (8, 4))
    monkeypatch.setattr(tq, "NVFP4_REVERSE", True)
    _pin_blocks(tq, monkeypatch)
    w = _awkward((3, 5, 48), 65)
    w[2, 4, 40] = float("nan")
    for group in (0, 1, 2 * 5 * 48 * 4):                            # off, one matrix, two matrices per group
        monkeypatch.setattr(tq, "NVFP4_GROUP_BYTES", group)
        for opts in ({"global_scale": "matrix"},) if group else ({}, {"global_scale": "matrix"}):
            _assert_same_q(tq.quantize(w, "nvfp4", **opts), quantize(w, "nvfp4", backend="torch", **opts))


@interp
def test_fp8_token_rows_and_fp8_block_unrolled_variants_match_reference_bits(tq, monkeypatch):
    """fp8_token's opt-in per-row kernel (two unrolled passes over chunks): K a multiple of the
    chunk (no masks) and not, a NaN row, an inf, ue8m0 scales; fp8_block unrolled, with whole
    128 x 128 tiles (no masks) and partial ones."""
    monkeypatch.setitem(tq.VARIANTS, "fp8_token", "rows")
    monkeypatch.setitem(tq.CONFIG, "fp8_token_rows", (64, 4))
    monkeypatch.setitem(tq.VARIANTS, "fp8_block", "unrolled")
    monkeypatch.setitem(tq.CONFIG, "fp8_block_unrolled", (32, 4))
    for shape in ((3, 256), (4, 200)):
        x = _awkward(shape, 66)
        x[1, 7] = float("nan")
        x[2, 9] = -float("inf")
        for ue8m0 in (False, True):
            _assert_same_q(tq.quantize(x, "fp8_token", ue8m0=ue8m0), quantize(x, "fp8_token", backend="torch", ue8m0=ue8m0))
    for shape, ue8m0 in (((1, 128, 256), False), ((2, 130, 200), True)):
        w = _awkward(shape, 67)
        w[-1, 3, 5] = float("nan")
        _assert_same_q(tq.quantize(w, "fp8_block", ue8m0=ue8m0), quantize(w, "fp8_block", backend="torch", ue8m0=ue8m0))


@interp
def test_fp4_dequant_chunks_variant_matches_reference_bits(tq, monkeypatch):
    """The opt-in chunks dequantize: a partial last program, every scale byte, per-matrix nvfp4
    scales on matrices of an odd block count."""
    monkeypatch.setitem(tq.VARIANTS, "fp4_dequant", "chunks")
    monkeypatch.setitem(tq.CONFIG, "fp4_dequant_chunks", (32, 4))
    g = torch.Generator().manual_seed(67)
    for fmt in ("mxfp4", "nvfp4"):
        bs = FORMATS[fmt].block[1]
        codes = torch.randint(0, 16, (256, bs), generator=g, dtype=torch.uint8)
        scale = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(256, 1)
        q = QuantizedTensor(pack_fp4(codes), scale, fmt, torch.Size((256, bs)), torch.tensor(0.37) if fmt == "nvfp4" else None)
        qs = [q, quantize(_awkward((3, 96), 68), fmt)]                # 36 chunks: a partial program
        if fmt == "nvfp4":
            qs.append(quantize(_awkward((3, 5, 48), 69), fmt, global_scale="matrix"))
        for qq, dtype in zip(qs, (torch.float32, torch.float16, torch.float32)):
            assert _same_bits(tq.dequantize(qq, dtype), dequantize(qq, dtype, backend="torch")), (fmt, dtype)


def test_apply_tuning_installs_variants_loops_and_nvfp4_options():
    pytest.importorskip("triton")
    from moe.quant import triton_quant as tq

    saved = (dict(tq.VARIANTS), dict(tq.LOOPS), tq.NVFP4_REVERSE, tq.NVFP4_GROUP_BYTES, dict(tq.CONFIG))
    try:
        with pytest.raises(ValueError, match="unknown quant variant 'mxfp4_quant': 'rows'"):
            tq.apply_tuning({"config": {"mxfp4_lines": [64, 2]}, "variants": {"mxfp4_quant": "rows"}})
        assert tq.CONFIG["mxfp4_lines"] == saved[4]["mxfp4_lines"]       # nothing installed
        with pytest.raises(ValueError, match="loops for 'fp4_quant'"):
            tq.apply_tuning({"loops": {"fp4_quant": 2}})
        with pytest.raises(ValueError, match="nvfp4_group_bytes"):
            tq.apply_tuning({"nvfp4_group_bytes": -1})
        tq.apply_tuning({"config": {"mxfp4_lines": [64, 2]}, "variants": {"mxfp4_quant": "lines", "fp8_token": "rows"},
                         "loops": {"nvfp4_lines": 2}, "nvfp4_reverse": True, "nvfp4_group_bytes": 1 << 25})
        assert tq.CONFIG["mxfp4_lines"] == (64, 2) and tq.VARIANTS["mxfp4_quant"] == "lines"
        assert tq.VARIANTS["fp8_token"] == "rows" and tq.LOOPS["nvfp4_lines"] == 2
        assert tq.NVFP4_REVERSE is True and tq.NVFP4_GROUP_BYTES == 1 << 25
    finally:
        tq.VARIANTS.clear()
        tq.VARIANTS.update(saved[0])
        tq.LOOPS.clear()
        tq.LOOPS.update(saved[1])
        tq.NVFP4_REVERSE, tq.NVFP4_GROUP_BYTES = saved[2], saved[3]
        tq.CONFIG.clear()
        tq.CONFIG.update(saved[4])


@interp
def test_fp4_and_fp8_tiles_with_partial_rows_and_k_not_multiple_of_128(tq, monkeypatch):
    """Rows not a multiple of the tile (masked programs next to full ones), K % 128 != 0 (fp8
    partial groups), inf-only tiles (mxfp4 saturating path) and a NaN tile, for the new paths."""
    monkeypatch.setitem(tq.CONFIG, "fp4_quant", (8, 4))
    monkeypatch.setitem(tq.CONFIG, "fp8_group", (4, 4))
    _pin_blocks(tq, monkeypatch)
    monkeypatch.setitem(tq.CONFIG, "fp4_amax", (256, 4))            # several atomic programs per matrix
    g = torch.Generator().manual_seed(31)
    x = torch.randn(13, 192, generator=g) * 5                        # 78 mxfp4 blocks: 9 full programs + 1 partial
    x[3, 7] = float("inf")
    x[9, 100] = -float("inf")
    x[11, 50] = float("nan")
    for fmt in ("mxfp4", "fp8_group", "fp8_token"):
        _assert_same_q(tq.quantize(x, fmt), quantize(x, fmt, backend="torch"))
    w = torch.randn(3, 37, 200, generator=g)                         # K = 200: a partial 1x128 group / 128x128 tile
    for fmt in ("fp8_group", "fp8_token", "fp8_block"):
        for ue8m0 in (False, True):
            _assert_same_q(tq.quantize(w, fmt, ue8m0=ue8m0), quantize(w, fmt, backend="torch", ue8m0=ue8m0))
    w16 = torch.randn(3, 37, 208, generator=g)                       # nvfp4: amax over uneven chunks
    for gs in (None, "matrix"):
        _assert_same_q(tq.quantize(w16, "nvfp4", global_scale=gs), quantize(w16, "nvfp4", backend="torch", global_scale=gs))


def test_apply_tuning_rejects_bad_entries():
    pytest.importorskip("triton")
    from moe.quant import triton_quant as tq

    with pytest.raises(ValueError, match=r"unknown quant kernel 'fp9'.*valid: fp4_quant"):
        tq.apply_tuning({"config": {"fp9": [1, 4]}})
    with pytest.raises(ValueError, match=r"'fp4_quant' must be \[tile, warps\]"):
        tq.apply_tuning({"config": {"fp4_quant": [128]}})
