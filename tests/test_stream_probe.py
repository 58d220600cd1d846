"""The weight-stream probe kernels (launch/bench/stream_probe.py, `gemm --probe --sections decode5`).

Under the interpreter (CPU, tests/conftest.py sets TRITON_INTERPRET=1): every stream kernel's
partial sums total (mod 2^32) the sum of the weight's int32 words computed by numpy from the raw
bytes, for both FP4 formats, row tiles smaller / larger than the program's rows and rows in
order, partial row tiles, uneven split-K and persistent grids that do not divide the work; a
launch that skips one unit or one block of words fails that check. Without a GPU: an sm_90a
compile shows 128-bit global loads and no spills. The probe section's dry run writes its rows.
On the GPU (`pytest -m gpu`): the same checksums on a V3 L1 slice with the real launch list.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 from the start (conftest sets it on CPU)")
REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _weight(fmt: str, E: int, N: int, K: int, tile_n: int, seed: int = 0, device: str = "cpu"):
    """A random FP4 weight (random codes and scale bytes) prepared in oct packing."""
    from moe.kernels import prepare_weights
    from moe.quant import QuantizedTensor

    g = torch.Generator().manual_seed(seed)
    block = 32 if fmt == "mxfp4" else 16
    data = torch.randint(0, 256, (E, N, K // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(0, 256, (E, N, K // block), generator=g, dtype=torch.uint8)
    gs = torch.ones(E, dtype=torch.float32) if fmt == "nvfp4" else None
    if fmt == "nvfp4":
        scale = scale & 0x7F   # E4M3 scale bytes, no NaN
        q = QuantizedTensor(data.to(device), scale.to(device), fmt, torch.Size((E, N, K)), global_scale=gs.to(device))
    else:
        q = QuantizedTensor(data.to(device), scale.to(device), fmt, torch.Size((E, N, K)))
    return prepare_weights(q, packing="oct", tile_n=tile_n)


def _numpy_sum(t: torch.Tensor) -> int:
    """Sum of the tensor's bytes read as little-endian int32 words, mod 2^32 (independent of torch)."""
    words = np.frombuffer(t.cpu().contiguous().numpy().tobytes(), dtype="<i4").astype(np.int64)
    return int(words.sum()) & 0xFFFFFFFF


def _cfgs():
    from launch.bench.stream_probe import StreamConfig as C

    return [C("flat", programs=3, block=256, num_stages=1), C("flat", programs=2, block=128, num_stages=2),
            C("flat", programs=5, block=64, num_stages=3),             # remainder blocks and a tail
            C("tiles", 64, 4, 3), C("tiles", 32, 4, 1), C("tiles", 64, 4, 2, scales=True),
            C("tiles", 32, 4, 2, split=2), C("tiles", 64, 4, 2, split=3),   # 3 does not divide the units
            C("persistent", 32, 4, 2, programs=3), C("persistent", 64, 4, 1, programs=2),
            C("persistent", 32, 4, 3, programs=7)]                     # more programs than some get items


@interp
@pytest.mark.parametrize("fmt,N,K,tile_n", [("mxfp4", 64, 512, 64), ("mxfp4", 96, 768, 32), ("nvfp4", 64, 256, 0),
                                            ("mxfp4", 128, 256, 128)])
def test_interp_every_stream_kernel_reads_each_word_once(fmt, N, K, tile_n):
    from launch.bench.stream_probe import checksum, reference_checksum, stream, stream_bytes

    w = _weight(fmt, 2, N, K, tile_n, seed=N + K)
    assert w.tile_n == tile_n
    data_ref, scale_ref = _numpy_sum(w.data), _numpy_sum(w.scale)
    assert reference_checksum(w) == data_ref
    assert reference_checksum(w, scales=True) == (data_ref + scale_ref) & 0xFFFFFFFF
    for cfg in _cfgs():
        want = (data_ref + (scale_ref if cfg.scales else 0)) & 0xFFFFFFFF
        assert checksum(stream(w, cfg)) == want, cfg
        assert stream_bytes(w, cfg) == 2 * N * K // 2 + (2 * N * K // w.block if cfg.scales else 0)


@interp
def test_interp_a_launch_that_skips_words_fails_the_check():
    """The same kernels launched to read one unit (tiles) / one block (flat) short: the checksum
    differs, so the probe's check can fail."""
    from launch.bench import stream_probe as sp

    w = _weight("mxfp4", 2, 64, 512, 64, seed=3)
    ref = sp.reference_checksum(w)
    st = w.strides()
    sdata = w.scale.view(torch.int64)
    out = torch.zeros(2 * 2, dtype=torch.int64)
    sp._stream_tiles_kernel[(2, 2)](st.data, sdata, out, 64, 2, st.expert, st.tile, st.row, st.chunk,
                                    sdata.stride(0), sdata.stride(1), UNITS=1, SPLIT=1, TILE=64, BLOCK_N=32,
                                    BLOCK=32, NS=1, SCALES=False)              # 1 of the 2 units
    assert sp.checksum(out) != ref
    flat = w.data.view(torch.int32).reshape(-1)
    out = torch.zeros(2, dtype=torch.int64)
    sp._stream_flat_kernel[(2,)](flat, out, flat.numel() - 128, ITERS=flat.numel() // 256, REM=1, BLOCK=128, NS=1)
    assert sp.checksum(out) == ref                                            # remainder block empty: all words
    sp._stream_flat_kernel[(2,)](flat, out, flat.numel(), ITERS=flat.numel() // 256 - 1, REM=0, BLOCK=128, NS=1)
    assert sp.checksum(out) != ref                                            # the last block of each program lost


def test_stream_config_rejects_bad_values():
    from launch.bench.stream_probe import StreamConfig

    for kw, word in ((dict(kind="rows"), "kind"), (dict(kind="tiles", block_n=96), "power of two"),
                     (dict(kind="flat"), "programs"), (dict(kind="tiles", split=0), ">= 1"),
                     (dict(kind="persistent", programs=4, scales=True), "scales")):
        with pytest.raises(ValueError, match=word):
            StreamConfig(**kw)


def test_stream_needs_oct_packing():
    from launch.bench.stream_probe import StreamConfig, stream
    from moe.kernels.prepare import repack

    w = repack(_weight("mxfp4", 1, 64, 512, 0), "paired")
    with pytest.raises(ValueError, match="oct"):
        stream(w, StreamConfig("tiles"))


def test_probe_configs_cover_the_brief():
    """The GPU launch list: the default tile config first, block_n 64/128/256 x stages 2-4 x warps
    4/8, direct loads, split-K 2/4/8, persistent grids of 1-3 x the SM count, flat grids of
    multiples of the SM count."""
    from launch.bench.stream_probe import configs

    cfgs = configs((128, 3, 4), 132, 28, tiny=False)
    tiles = [c for c in cfgs if c.kind == "tiles" and c.split == 1 and not c.scales]
    assert (tiles[0].block_n, tiles[0].num_stages, tiles[0].num_warps) == (128, 3, 4)
    assert {(c.block_n, c.num_stages, c.num_warps) for c in tiles} >= {
        (bn, ns, nw) for bn in (64, 128, 256) for ns in (2, 3, 4) for nw in (4, 8)}
    assert any(c.num_stages == 1 for c in tiles)
    assert {c.split for c in cfgs if c.kind == "tiles"} == {1, 2, 4, 8}
    assert {c.programs for c in cfgs if c.kind == "persistent"} == {132, 264, 396}
    assert all(c.programs % 132 == 0 for c in cfgs if c.kind == "flat")
    assert len({c.label() for c in cfgs}) == len(cfgs)
    assert max(c.split for c in configs((128, 3, 4), 132, 8, tiny=False)) == 8


@interp
def test_interp_probe_decode5_dry_run(tmp_path, capsys):
    from launch.bench.gemm import probe

    probe(str(tmp_path), ["decode5"])
    rows = json.loads((tmp_path / "gemm-probe.json").read_text())["results"]
    assert rows and all(r["section"] == "decode5" for r in rows)
    assert not [r for r in rows if "error" in r]
    stream_rows = [r for r in rows if " stream " in r["name"]]
    assert {r["cfg"]["kind"] for r in stream_rows} == {"flat", "tiles", "persistent"}
    assert all(r["rel_err"] == 0.0 for r in stream_rows)                 # every checksum exact
    assert all("floor_frac" in r and "gbps" in r for r in stream_rows)
    kern = [r for r in rows if r["name"].endswith("w4a16 default")]
    assert len(kern) == 2 and all(r["rel_err"] < 1e-2 for r in kern)
    out = capsys.readouterr().out
    verdicts = [line for line in out.splitlines() if line.startswith("decode5 ")]
    assert len(verdicts) == 2 and all("persistent" in v and "w4a16 default" in v for v in verdicts)


def test_stream_kernels_compile_for_sm90a_with_128_bit_loads_and_no_spills():
    """`python -m megapar.launch.bench.stream_probe` (bench/debug/kernel_sass.py on the V3 L1
    launches): every kernel compiles for sm_90a, spills nothing, and loads the weight with
    16-byte vectors only (LDG.E.128 or LDGSTS.*.128; the scale words: 8-byte)."""
    import re

    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "megapar.launch.bench.stream_probe"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if "registers" in line]
    assert len(lines) == 9, proc.stdout
    for line in lines:
        assert " 0 B spilled" in line, line
        loads = eval(re.search(r"loads (\{.*?\})", line).group(1))  # noqa: S307 - our own printout
        moving = {op: n for op, n in loads.items() if op != "LDGDEPBAR" and op.startswith("LDG")}   # (stores listed too)
        wide = {op for op in moving if op.endswith(".128")}
        assert wide, line
        assert all(op.endswith(".128") or (op == "LDGSTS.E.64" and "+scales" in line) for op in moving), line
        if " s1" in line:
            assert "LDG.E.128" in moving, line            # direct loads into registers
        else:
            assert any(op.startswith("LDGSTS") for op in moving), line   # tl.range pipelining: cp.async


# ---- GPU ------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_stream_checksums_on_a_v3_slice():
    """The probe's GPU launch list on 4 experts of V3 L1 (N 4096, K 7168, 64-row tiles):
    every launch's checksum is torch's."""
    from launch.bench.stream_probe import checksum, configs, reference_checksum, stream

    w = _weight("mxfp4", 4, 4096, 7168, 64, seed=1, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    refs = {s: reference_checksum(w, s) for s in (False, True)}
    for cfg in configs((128, 3, 4), sms, 28, tiny=False):
        assert checksum(stream(w, cfg)) == refs[cfg.scales], cfg
