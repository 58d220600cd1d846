"""The W4A16 kernel's bf16 operand mode ("bf16asm": inline PTX expansion to bf16 pairs by one
multiply per pair, activations as they are, MXFP4 prescaled only).

On the CPU: the expansion's constants replayed with torch integer ops (`oct_bf16_reference`)
decode every nibble of every slot to its E2M1 value times 2^-126, both halves, and the modes that
cannot take bf16asm say so. On the GPU (`pytest -m gpu`): bf16asm against the reference and
against f16asm on the V3 decode shape (TMA and pointer loads, 1 / 8 / 32 tokens per expert, an
empty expert), NaN block scales, split-K, and a CUDA-graph replay.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from moe.kernels import expert_rows, grouped_gemm, prepare_weights
from moe.quant import quantize

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _e2m1(nib: torch.Tensor) -> torch.Tensor:
    v = E2M1[(nib & 7).long()]
    return torch.where((nib & 8) != 0, -v, v)


def _halves_as_float(reg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 register values in [0, 2^32) -> (low half, high half) read as bf16, in fp64."""
    def bf16(bits: torch.Tensor) -> torch.Tensor:
        return (bits.to(torch.int32) << 16).view(torch.float32).double()   # bf16 = the top half of an fp32
    return bf16(reg & 0xFFFF), bf16(reg >> 16)


def test_bf16_expansion_constants_decode_every_nibble_of_every_slot():
    from moe.kernels.triton_w4a16 import oct_bf16_reference

    g = torch.Generator().manual_seed(0)
    # all 16 x 16 (w0 nibble, w1 nibble) combinations in every slot i, plus random neighbours
    a = torch.arange(16).repeat_interleave(16)
    b = torch.arange(16).repeat(16)
    words = []
    for i in range(8):
        rnd0 = torch.randint(0, 2 ** 32, (256,), generator=g, dtype=torch.int64)
        rnd1 = torch.randint(0, 2 ** 32, (256,), generator=g, dtype=torch.int64)
        keep = ~(0xF << (4 * i)) & 0xFFFFFFFF
        w0 = (rnd0 & keep) | (a << (4 * i))
        w1 = (rnd1 & keep) | (b << (4 * i))
        words.append((w0, w1))
    w0 = torch.cat([w for w, _ in words])
    w1 = torch.cat([w for _, w in words])
    to_i32 = lambda t: (t - (t >= 2 ** 31).long() * 2 ** 32).to(torch.int32)   # noqa: E731
    regs = oct_bf16_reference(to_i32(w0), to_i32(w1))
    assert len(regs) == 8
    scale = 2.0 ** -126
    for i, reg in enumerate(regs):
        lo, hi = _halves_as_float(reg)
        want_lo = _e2m1((w0 >> (4 * i)) & 0xF).double() * scale
        want_hi = _e2m1((w1 >> (4 * i)) & 0xF).double() * scale
        assert torch.equal(lo, want_lo), i
        assert torch.equal(hi, want_hi), i
        # -0 for the negative zero code (sign bit kept), as the fp16 expansion does
        neg_zero = ((w0 >> (4 * i)) & 0xF) == 8
        assert (torch.signbit(lo[neg_zero])).all()


def test_bf16asm_is_refused_where_its_operands_would_be_out_of_range():
    from moe.kernels.triton_w4a16 import W4A16Config, launch_w4a16

    E, N, K = 2, 32, 256
    w = torch.randn(E, N, K)
    x = torch.randn(3, K)
    counts = torch.tensor([2, 1])
    rows = expert_rows(x, E, counts, None, "contiguous")
    cfg = W4A16Config(block_n=32, block_m=16, chunks=1, num_warps=4, num_stages=1, mode="bf16asm", packing="oct")
    pw = prepare_weights(quantize(w, "mxfp4"), packing="oct")
    with pytest.raises(ValueError, match=r"mode 'bf16asm' needs an MXFP4 weight in oct packing with prescale=True; "
                                         r"got fmt 'mxfp4', packing 'oct', prescale=False"):
        launch_w4a16(x, pw, rows, out_dtype=torch.float32, config=cfg)
    pn = prepare_weights(quantize(w, "nvfp4", global_scale="matrix"), packing="oct")
    with pytest.raises(ValueError, match=r"got fmt 'nvfp4'"):
        launch_w4a16(x, pn, rows, out_dtype=torch.float32, config=dataclasses.replace(cfg, prescale=True))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (conftest, CPU)")
def test_interp_probe_decode7_dry_run(tmp_path, capsys, monkeypatch):
    """The probe section that times bf16asm against the default, on the interpreter's tiny
    problems (Triton-arithmetic f16 against f32 operands there: no inline PTX, and the
    interpreter's tl.dot of bf16 operands is wrong), every row checked."""
    from launch.bench import gemm

    monkeypatch.setattr(gemm, "graph_time", lambda ctx, fn, iters=None: (fn(), (1.0, "stub"))[1])
    gemm.probe(str(tmp_path), ["decode7"])
    rows = json.loads((tmp_path / "gemm-probe.json").read_text())["results"]
    assert rows and all(r["section"] == "decode7" for r in rows)
    assert not [r for r in rows if "error" in r]
    assert {r["cfg"]["mode"] for r in rows} == {"f16", "f32"}
    assert all(r["rel_err"] < 1e-2 for r in rows)
    out = capsys.readouterr().out
    assert out.count("decode7 ") >= 2 and ("bf16 wins" in out or "default wins" in out)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (conftest, CPU)")
def test_interp_probe_decode8_dry_run(tmp_path, capsys, monkeypatch):
    """The register-cap section (maxnreg 128 beside the default) and decode9 (bf16rot_ps beside
    bf16rot: on the interpreter only the section's own code) on the interpreter's tiny problems."""
    from launch.bench import gemm

    monkeypatch.setattr(gemm, "graph_time", lambda ctx, fn, iters=None: (fn(), (1.0, "stub"))[1])
    gemm.probe(str(tmp_path), ["decode8", "decode9"])
    rows = json.loads((tmp_path / "gemm-probe.json").read_text())["results"]
    assert rows and {r["section"] for r in rows} == {"decode8", "decode9"} and not [r for r in rows if "error" in r]
    assert {r["cfg"]["maxnreg"] for r in rows if r["section"] == "decode8"} == {0, 128}
    assert all(r["rel_err"] < 1e-2 for r in rows)
    out = capsys.readouterr().out
    assert out.count("decode8 ") >= 2 and out.count("decode9 ") >= 2


def test_maxnreg_is_validated():
    from moe.kernels.triton_w4a16 import W4A16Config

    assert W4A16Config().maxnreg == 0 and W4A16Config(maxnreg=128).maxnreg == 128
    for bad in (32, 256, 128.0, True):
        with pytest.raises(ValueError, match=r"maxnreg must be 0 \(the compiler's choice\) or a register cap in "
                                             r"\[64, 255\], got"):
            W4A16Config(maxnreg=bad)


# ---- GPU ------------------------------------------------------------------------------------------

def _weight(E: int, N: int, K: int, seed: int, tile_n: int = 64):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(E, N, K, generator=g) * torch.exp2(torch.randint(-3, 3, (E, N, 1), generator=g).float())
    return prepare_weights(quantize(w.cuda(), "mxfp4"), packing="oct", tile_n=tile_n)


def _v3_decode(tok: int):
    """V3 L1 (N 4096, K 7168) over 4 experts, `tok` rows each but expert 1 (empty), on the GPU:
    (counts, x, rows, MXFP4 weight)."""
    E, N, K = 4, 4096, 7168
    counts = torch.full((E,), tok, device="cuda", dtype=torch.int32)
    counts[1] = 0
    x = torch.randn(int(counts.sum()), K, device="cuda", dtype=torch.bfloat16)
    return counts, x, expert_rows(x, E, counts, None, "contiguous"), _weight(E, N, K, seed=tok)


def _graph_replay(fn):
    """fn's output captured in a CUDA graph and replayed once."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all()
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.gpu
@pytest.mark.parametrize("tok", [1, 8, 32])
def test_gpu_bf16asm_matches_reference_and_f16asm_on_the_v3_decode_shape(tok):
    """V3 L1 (N 4096, K 7168), 4 experts (one empty): the default decode config with mode bf16asm,
    TMA and pointer loads, against the torch reference and against f16asm. The products are the
    same exact values in both modes (bf16 x times an E2M1 value, or x rounded to fp16 times it),
    so the two agree to fp32 rounding of the sums."""
    from moe.kernels.triton_w4a16 import launch_w4a16, pick_config

    counts, x, rows, pw = _v3_decode(tok)
    ref = grouped_gemm(x, pw, counts=counts, backend="torch", out_dtype=torch.float32)
    base = dataclasses.replace(pick_config(tok, torch.bfloat16, "oct"), prescale=True, mode="f16asm")
    for tma in (False, True):
        f16 = launch_w4a16(x, pw, rows, out_dtype=torch.float32, config=dataclasses.replace(base, tma=tma))
        bf16 = launch_w4a16(x, pw, rows, out_dtype=torch.float32,
                            config=dataclasses.replace(base, tma=tma, mode="bf16asm"))
        torch.cuda.synchronize()
        assert _rel(bf16, ref) < 1e-5, tma
        assert _rel(bf16, f16) < 1e-5, tma


def _check_nan_scale_row(x, pw, rows, cfg, N: int) -> None:
    """A NaN block scale (E8M0 255) in expert 0, row 5: that output column is NaN for expert 0's
    token only, every other column finite."""
    from moe.kernels.triton_w4a16 import launch_w4a16

    scale = pw.scale.clone()
    scale[0, 5, 3] = 255
    bad = dataclasses.replace(pw, scale=scale, cache={})
    y = launch_w4a16(x, bad, rows, out_dtype=torch.float32, config=cfg)
    assert torch.isnan(y[0, 5]) and not torch.isnan(y[1:, 5]).any()
    assert torch.isfinite(y[:, torch.arange(N) != 5]).all()


@pytest.mark.gpu
def test_gpu_bf16asm_wide_scale_range_nan_scale_split_k_and_graph_replay():
    """Rows whose blocks span 2^-60 .. 2^0 (beyond fp16's prescale range, within bf16's): exact
    against the reference; a NaN block scale (E8M0 255) turns its row NaN; split-K 4 and a
    CUDA-graph replay give the eager result."""
    from moe.kernels.triton_w4a16 import launch_w4a16, pick_config

    E, N, K = 2, 256, 2048
    g = torch.Generator().manual_seed(7)
    w = torch.randn(E, N, K, generator=g)
    w = w * torch.exp2(-torch.randint(0, 60, (E, N, K // 32, 1), generator=g).float()).repeat(1, 1, 1, 32).view(E, N, K)
    pw = prepare_weights(quantize(w.cuda(), "mxfp4"), packing="oct", tile_n=64)
    counts = torch.tensor([1, 2], device="cuda", dtype=torch.int32)
    x = torch.randn(3, K, device="cuda", dtype=torch.bfloat16)
    rows = expert_rows(x, E, counts, None, "contiguous")
    cfg = dataclasses.replace(pick_config(1, torch.bfloat16, "oct"), prescale=True, mode="bf16asm")
    ref = grouped_gemm(x, pw, counts=counts, backend="torch", out_dtype=torch.float32)
    got = launch_w4a16(x, pw, rows, out_dtype=torch.float32, config=cfg)
    assert _rel(got, ref) < 1e-5
    split = launch_w4a16(x, pw, rows, out_dtype=torch.float32, config=dataclasses.replace(cfg, split_k=4))
    assert _rel(split, ref) < 1e-5
    assert torch.equal(_graph_replay(lambda: launch_w4a16(x, pw, rows, out_dtype=torch.float32, config=cfg)), got)
    _check_nan_scale_row(x, pw, rows, cfg, N)


@pytest.mark.gpu
def test_gpu_bf16asm_under_a_register_cap_gives_the_same_bits():
    """maxnreg 128 (the decode8 probe's variant) changes the register allocation, not the results."""
    from moe.kernels.triton_w4a16 import launch_w4a16, pick_config

    E, N, K = 4, 4096, 7168
    counts = torch.tensor([1, 0, 1, 1], device="cuda", dtype=torch.int32)
    x = torch.randn(3, K, device="cuda", dtype=torch.bfloat16)
    rows = expert_rows(x, E, counts, None, "contiguous")
    pw = _weight(E, N, K, seed=11)
    cfg = pick_config(rows.rows_hint, torch.bfloat16, "oct")
    free = launch_w4a16(x, pw, rows, out_dtype=torch.bfloat16, config=cfg)
    capped = launch_w4a16(x, pw, rows, out_dtype=torch.bfloat16, config=dataclasses.replace(cfg, maxnreg=128))
    torch.cuda.synchronize()
    assert torch.equal(free, capped)


# ---- packing "octb" and mode bf16rot (one rotation and one mask per bf16 pair) ---------------------

@pytest.mark.parametrize("block", [32, 16])
def test_octb_round_trip_and_layout_changes(block):
    from moe.kernels import prepare

    g = torch.Generator().manual_seed(block)
    data = torch.randint(0, 256, (2, 6, 8 * block // 2 * 3), generator=g, dtype=torch.uint8)
    assert torch.equal(prepare.unoctb_fp4(prepare.octb_fp4(data, block), block), data)
    fmt = "mxfp4" if block == 32 else "nvfp4"
    w = torch.randn(2, 128, 8 * block * 2, generator=g)
    q = quantize(w, fmt, **({"global_scale": "matrix"} if fmt == "nvfp4" else {}))
    oct_w = prepare_weights(q, packing="oct", tile_n=64)
    octb_w = prepare_weights(q, packing="octb", tile_n=64)
    assert octb_w.packing == "octb" and octb_w.kernel_packing == "octb"
    assert torch.equal(prepare.natural_data(octb_w), prepare.natural_data(oct_w))
    assert torch.equal(oct_w.in_layout("octb").data, octb_w.data)
    assert torch.equal(octb_w.in_layout("oct", 0).data, oct_w.in_layout("oct", 0).data)
    st, so = octb_w.strides(), oct_w.strides()       # the same addressing: only the nibble order differs
    assert st.data.dtype == torch.int32 and st.data.shape == so.data.shape
    assert (st.expert, st.tile, st.row, st.chunk, st.tile_n) == (so.expert, so.tile, so.row, so.chunk, so.tile_n)
    assert not torch.equal(st.data, so.data)
    # the torch reference reads octb like any packing
    x = torch.randn(5, w.shape[-1], generator=g)
    counts = torch.tensor([2, 3])
    ref = grouped_gemm(x, oct_w, counts=counts, backend="torch", out_dtype=torch.float32)
    assert torch.equal(grouped_gemm(x, octb_w, counts=counts, backend="torch", out_dtype=torch.float32), ref)


def test_bf16rot_expansion_constants_decode_every_block_of_octb_words():
    """prepare.octb_fp4's words through the bf16rot replay: register i of the word pair (2p, 2p + 1)
    is block i's elements 2p and 2p + 1, each E2M1 value times 2^-126, every code in every slot."""
    from moe.kernels import prepare
    from moe.kernels.triton_w4a16 import octb_bf16_reference

    block, units = 32, 64
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (units, 8, block), generator=g)
    codes[0] = torch.arange(16).repeat(16)[: 8 * block].view(8, block)   # every code in every block
    natural = (codes.reshape(-1)[0::2] | (codes.reshape(-1)[1::2] << 4)).to(torch.uint8)
    words = prepare.octb_fp4(natural, block).view(torch.int32).view(units, block)      # word q of each unit
    regs = octb_bf16_reference(words[:, 0::2], words[:, 1::2])                          # [units, p] each
    assert len(regs) == 8
    for i, reg in enumerate(regs):
        lo, hi = _halves_as_float(reg)
        assert torch.equal(lo, _e2m1(codes[:, i, 0::2]).double() * 2.0 ** -126), i
        assert torch.equal(hi, _e2m1(codes[:, i, 1::2]).double() * 2.0 ** -126), i


def test_bf16rot_ps_replay_gives_each_block_relative_to_its_rows_largest_scale():
    """MODE 7's PTX replayed on the CPU (`octb_ps_reference`): the kernel adds C = 253 - min(r_max,
    253) to the four scale bytes of each word with one 32-bit add, then the PTX permutes byte j into
    both halves and shifts it into the bf16 exponent field. Every code of every block, block scales
    from 0 to r_max (d = r_max - s up to 253, where the block flushes to 0) and r_max up to 254
    (relative to 253 there): each operand is the E2M1 value times 2^(s - R), rounded to bf16 as
    the MMA operand is, and the word add never carries between bytes."""
    from moe.kernels import prepare
    from moe.kernels.triton_w4a16 import octb_ps_reference

    block, units = 32, 16
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (units, 8, block), generator=g)
    codes[0] = torch.arange(16).repeat(16)[: 8 * block].view(8, block)
    natural = (codes.reshape(-1)[0::2] | (codes.reshape(-1)[1::2] << 4)).to(torch.uint8)
    words = prepare.octb_fp4(natural, block).view(torch.int32).view(units, block)
    r_max = torch.tensor([254, 253, 252, 200, 127, 126, 3, 0] * (units // 8))[:, None]      # one row per unit
    s = (r_max - torch.randint(0, 254, (units, 8), generator=g)).clamp_min(0)                # block scales <= r_max
    s[:, 0] = r_max[:, 0]                                                                   # the row's largest
    s[1, 1], s[0, 2] = 0, 0                                                                 # d = 253 / 254
    c4 = (253 - r_max.clamp_max(253)) * 0x01010101                       # the kernel's one add per word
    packed = lambda b: sum(s[:, 4 * b + j:4 * b + j + 1] << (8 * j) for j in range(4))   # the scale word
    t_lo = ((packed(0) + c4) & 0xFFFFFFFF).expand(units, block // 2)
    t_hi = ((packed(1) + c4) & 0xFFFFFFFF).expand(units, block // 2)
    regs = octb_ps_reference(words[:, 0::2], words[:, 1::2], t_lo, t_hi)
    for i, reg in enumerate(regs):
        rel = torch.exp2((s[:, i:i + 1] - r_max.clamp_max(253)).double())
        for h in range(2):
            want = (_e2m1(codes[:, i, h::2]).double() * rel).to(torch.bfloat16)
            assert torch.equal(reg[..., h], want), (i, h)
    for i, unit in ((1, 1), (2, 0)):                                       # d = 253 and 254: exact zeros
        assert not regs[i][unit].float().abs().any()


def test_octb_modes_and_pick_config(monkeypatch):
    """The PTX modes read their own packing (bf16rot, bf16rot_ps: octb; the others: oct) and say so;
    the Triton-arithmetic modes read octb too; pick_config maps the oct settings onto octb."""
    from moe.kernels import triton_w4a16 as t

    E, N, K = 2, 64, 256
    w = torch.randn(E, N, K)
    x = torch.randn(3, K)
    rows = expert_rows(x, E, torch.tensor([2, 1]), None, "contiguous")
    octb = prepare_weights(quantize(w, "mxfp4"), packing="octb")
    oct_w = prepare_weights(quantize(w, "mxfp4"), packing="oct")
    base = dict(block_n=64, block_m=16, chunks=1, num_warps=4, num_stages=1, prescale=True)
    with pytest.raises(ValueError, match=r"mode 'f16asm' reads packing 'oct', got 'octb' \(the Triton-arithmetic "
                                         r"modes f16 / bf16 / f32 read any\)"):
        t.launch_w4a16(x, octb, rows, out_dtype=torch.float32,
                       config=t.W4A16Config(mode="f16asm", packing="octb", **base))
    with pytest.raises(ValueError, match=r"mode 'bf16rot' reads packing 'octb', got 'oct'"):
        t.launch_w4a16(x, oct_w, rows, out_dtype=torch.float32,
                       config=t.W4A16Config(mode="bf16rot", packing="oct", **base))
    cfg = t.pick_config(1, torch.bfloat16, "octb")                    # (interpreter: no inline PTX)
    assert (cfg.mode, cfg.packing) == ("f16", "octb")
    monkeypatch.setattr(t, "USE_ASM", True)
    monkeypatch.setattr(t.impl, "interpreting", lambda: False)
    for rows_hint, swiglu in ((1, False), (0.25, False), (1, True), (16, False)):
        cfg = t.pick_config(rows_hint, torch.bfloat16, "octb", swiglu)
        ref = t.pick_config(rows_hint, torch.bfloat16, "oct", swiglu)
        assert (cfg.mode, cfg.packing) == ("bf16rot_ps", "octb")
        assert cfg.num_stages == (ref.num_stages if swiglu else 3)     # (decode9: 3 stages, TMA or not)
        assert dataclasses.replace(cfg, mode=ref.mode, packing="oct", num_stages=ref.num_stages) == ref
    nv = t.pick_config(1, torch.bfloat16, "octb", fmt="nvfp4")      # f16asm reads oct: Triton arithmetic here
    assert (nv.mode, nv.packing) == ("f16", "octb")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (conftest, CPU)")
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_interp_octb_weights_give_the_oct_results(fmt):
    """The W4A16 kernel (Triton arithmetic; TMA loads and the fused SwiGLU for mxfp4, pointer loads
    for nvfp4) and the expansion kernel on an octb weight give the bits of the same weight in oct
    packing, and match the reference."""
    from moe.kernels.triton_w4a16 import W4A16Config, expand_fp4, launch_w4a16

    E, N, K = 2, 32, 256 if fmt == "mxfp4" else 128     # one packing unit per row
    g = torch.Generator().manual_seed(4)
    w = torch.randn(E, N, K, generator=g)
    q = quantize(w, fmt, **({"global_scale": "matrix"} if fmt == "nvfp4" else {}))
    oct_w, octb = (prepare_weights(q, packing=p, tile_n=16) for p in ("oct", "octb"))
    counts = torch.tensor([3, 0])
    x = torch.randn(int(counts.sum()), K, generator=g)
    rows = expert_rows(x, E, counts, None, "contiguous")
    ref = grouped_gemm(x, oct_w, counts=counts, backend="torch", out_dtype=torch.float32)
    cfg = W4A16Config(block_n=32, block_m=16, chunks=1, num_warps=4, num_stages=1, mode="f32", packing="oct",
                      tma=fmt == "mxfp4")                     # one load path per format
    swiglu = (None, 1.0, 0.0) if fmt == "mxfp4" else None  # and the fused SwiGLU once
    a = launch_w4a16(x, oct_w, rows, out_dtype=torch.float32, config=cfg, swiglu=swiglu)
    b = launch_w4a16(x, octb, rows, out_dtype=torch.float32, config=dataclasses.replace(cfg, packing="octb"),
                     swiglu=swiglu)
    assert torch.equal(a, b)
    if swiglu is None:
        assert _rel_cpu(b, ref) < 1e-5
    assert torch.equal(expand_fp4(octb, torch.float32), expand_fp4(oct_w, torch.float32))
    if fmt == "mxfp4":
        for got, want in zip(expand_fp4(octb, fold="row"), expand_fp4(oct_w, fold="row")):
            assert torch.equal(got.float(), want.float())


def _rel_cpu(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.gpu
@pytest.mark.parametrize("tok", [1, 8])
def test_gpu_bf16rot_gives_the_bits_of_bf16asm(tok):
    """V3 L1 (N 4096, K 7168), 4 experts (one empty): the octb weight under mode bf16rot against the
    oct weight under bf16asm, the same settings, TMA and pointer loads and the fused SwiGLU: the same
    operand values in the same MMA order, so the same bits; and a CUDA-graph replay."""
    from moe.kernels.triton_w4a16 import launch_w4a16, pick_config

    counts, x, rows, pw = _v3_decode(tok)
    pb = pw.in_layout("octb")
    for swiglu in (None, (None, 1.0, 0.0)):
        base = pick_config(rows.rows_hint, torch.bfloat16, "oct", swiglu is not None)
        for tma in (False, True):
            a = launch_w4a16(x, pw, rows, out_dtype=torch.bfloat16, swiglu=swiglu,
                             config=dataclasses.replace(base, tma=tma))
            b = launch_w4a16(x, pb, rows, out_dtype=torch.bfloat16, swiglu=swiglu,
                             config=dataclasses.replace(base, tma=tma, mode="bf16rot", packing="octb"))
            torch.cuda.synchronize()
            assert torch.equal(a, b), (swiglu, tma)
    cfg = pick_config(rows.rows_hint, torch.bfloat16, "octb")
    eager = launch_w4a16(x, pb, rows, out_dtype=torch.bfloat16, config=cfg)
    assert torch.equal(_graph_replay(lambda: launch_w4a16(x, pb, rows, out_dtype=torch.bfloat16, config=cfg)), eager)


@pytest.mark.gpu
@pytest.mark.parametrize("tok", [1, 8])
def test_gpu_bf16rot_ps_gives_the_bits_of_bf16rot(tok):
    """Mode bf16rot_ps (the prescale multiplier built in the expansion PTX) against bf16rot, the same
    settings, TMA and pointer loads, 2 and 3 stages, the fused SwiGLU: the same operand values in
    the same MMA order (every r_max <= 253 here), so the same bits; and a CUDA-graph replay."""
    from moe.kernels.triton_w4a16 import launch_w4a16, pick_config

    counts, x, rows, pw = _v3_decode(tok)
    pb = pw.in_layout("octb")
    for swiglu in (None, (None, 1.0, 0.0)):
        base = pick_config(rows.rows_hint, torch.bfloat16, "octb", swiglu is not None)
        for tma, stages in ((False, 4), (True, 2), (True, 3)):
            cfg = dataclasses.replace(base, tma=tma, num_stages=stages, mode="bf16rot", prescale=True)
            a = launch_w4a16(x, pb, rows, out_dtype=torch.bfloat16, swiglu=swiglu, config=cfg)
            b = launch_w4a16(x, pb, rows, out_dtype=torch.bfloat16, swiglu=swiglu,
                             config=dataclasses.replace(cfg, mode="bf16rot_ps"))
            torch.cuda.synchronize()
            assert torch.equal(a, b), (swiglu, tma, stages)
    cfg = dataclasses.replace(pick_config(rows.rows_hint, torch.bfloat16, "octb"), mode="bf16rot_ps", prescale=True)
    eager = launch_w4a16(x, pb, rows, out_dtype=torch.bfloat16, config=cfg)
    assert torch.equal(_graph_replay(lambda: launch_w4a16(x, pb, rows, out_dtype=torch.bfloat16, config=cfg)), eager)


@pytest.mark.gpu
def test_gpu_bf16rot_ps_wide_scales_largest_scale_nan_scale_and_split_k():
    """bf16rot_ps where the scales are extreme: blocks 2^-60 .. 2^0 below their row's largest, rows
    whose largest block exponent is 254 (2^127: operands relative to 253) or 253, a NaN block scale
    (its row NaN, no other), and split-K 4: exact against the reference (fp32 out)."""
    from moe.kernels.triton_w4a16 import launch_w4a16, pick_config

    E, N, K = 2, 256, 2048
    g = torch.Generator().manual_seed(8)
    w = torch.randn(E, N, K, generator=g)
    w = w * torch.exp2(-torch.randint(0, 60, (E, N, K // 32, 1), generator=g).float()).repeat(1, 1, 1, 32).view(E, N, K)
    q = quantize(w.cuda(), "mxfp4")
    scale = q.scale.clone()
    scale[:, :4] = (scale[:, :4].int() + (254 - scale[:, :4].int().amax(-1, keepdim=True))).to(torch.uint8)   # r_max 254
    scale[:, 4:8] = (scale[:, 4:8].int() + (253 - scale[:, 4:8].int().amax(-1, keepdim=True))).to(torch.uint8)
    q = dataclasses.replace(q, scale=scale)
    pw = prepare_weights(q, packing="octb", tile_n=64)
    counts = torch.tensor([1, 2], device="cuda", dtype=torch.int32)
    x = torch.randn(3, K, device="cuda", dtype=torch.bfloat16) * 2.0 ** -120        # keep the 2^127 rows finite
    rows = expert_rows(x, E, counts, None, "contiguous")
    cfg = dataclasses.replace(pick_config(1, torch.bfloat16, "octb"), mode="bf16rot_ps", prescale=True)
    # the reference in float64 (an fp32 dequantization of the 2^127 rows overflows)
    data = q.data.cpu().long()
    codes = torch.stack([data & 15, data >> 4], dim=-1).view(E, N, K)
    w64 = _e2m1(codes).double() * torch.exp2(q.scale.cpu().double() - 127).repeat_interleave(32, -1)
    ref = torch.cat([x[:1].cpu().double() @ w64[0].t(), x[1:].cpu().double() @ w64[1].t()]).float().cuda()
    got = launch_w4a16(x, pw, rows, out_dtype=torch.float32, config=cfg)
    assert torch.isfinite(ref).all()
    assert _rel(got[:, :8], ref[:, :8]) < 1e-5 and _rel(got[:, 8:], ref[:, 8:]) < 1e-5
    split = launch_w4a16(x, pw, rows, out_dtype=torch.float32, config=dataclasses.replace(cfg, split_k=4))
    assert _rel(split, ref) < 1e-5
    _check_nan_scale_row(x, pw, rows, cfg, N)
