"""The "deep_gemm" grouped-GEMM backend (moe/kernels/deep_gemm.py).

CPU: a stand-in `deep_gemm` module (`FakeDeepGemm`) checks every argument the way DeepGEMM
2.8.2's csrc/apis/gemm.hpp asserts them on SM90 (dtypes, K-major operands, N-major output,
scale shapes and the 128x128 SFB layout, int32 m_indices / masked_m, TMA 16-byte alignment),
mimics what its kernels do with the layout (the expert of a 128-row block is read off its first
row, all-padding 64-row sub-blocks are skipped, the masked kernel stores whole 128-row tiles
into a flat [E*C, N] view, untouched output rows are garbage) and computes the products with
torch. Our wrappers must then match the torch reference with the same fp8 activations.
GPU (`-m gpu`, needs deep_gemm): the real package against the same reference computed on the CPU.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from megapar.moe.kernels import deep_gemm as dgm
from megapar.moe.kernels import expert_rows, grouped_gemm, prepare_weights
from megapar.moe.kernels.grouped_gemm import GEMM, grouped_gemm_reference, quantize_dequantize_act
from megapar.moe.kernels.prepare import dequantize_prepared
from megapar.parallel import impl
from megapar.parallel.quant import QuantizedTensor, quantize

ALIGN = 128


# ---- the stand-in -------------------------------------------------------------------------------

def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class FakeDeepGemm:
    """What deep_gemm's SM90 FP8 grouped GEMMs check and do, in torch (see the module docstring)."""

    __name__ = "deep_gemm"

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def get_mk_alignment_for_contiguous_layout(self) -> int:
        return ALIGN

    # -- checks (csrc/utils/layout.hpp, csrc/apis/gemm.hpp) --
    @staticmethod
    def _tma(t: torch.Tensor, what: str) -> None:
        assert t.data_ptr() % 16 == 0, f"{what}: TMA needs 16-byte aligned data"
        assert (t.stride(-2) * t.element_size()) % 16 == 0, f"{what}: TMA outer stride must be 16-byte aligned"

    @staticmethod
    def _k_major(t: torch.Tensor, dims: int, what: str) -> None:
        assert t.dtype == torch.float8_e4m3fn, f"{what}: SM90 needs float8_e4m3fn, got {t.dtype}"
        assert t.dim() == dims, f"{what}: needs {dims} dims, got {tuple(t.shape)}"
        assert t.stride(-1) == 1, f"{what}: SM90 FP8 needs K-major operands"
        if dims == 3:
            assert t.stride(0) == t.shape[-2] * t.shape[-1], f"{what}: batch must be contiguous"
        FakeDeepGemm._tma(t, what)

    @staticmethod
    def _sfb(sfb: torch.Tensor, G: int, N: int, K: int) -> None:
        assert sfb.dtype == torch.float32, f"SM90 SFB is fp32 (recipe 1,128,128), got {sfb.dtype}"
        assert tuple(sfb.shape) == (G, _ceil_div(N, 128), _ceil_div(K, 128)), f"SFB shape {tuple(sfb.shape)}"
        assert sfb.stride(-3) == sfb.shape[-2] * sfb.shape[-1]
        assert (sfb.stride(-1) == 1 and sfb.stride(-2) == sfb.shape[-1]) or \
               (sfb.stride(-1) == sfb.shape[-2] and sfb.stride(-2) == 1), "SM90 SFB must be contiguous (or transposed)"

    @staticmethod
    def _sfa(sfa: torch.Tensor, shape: tuple[int, ...]) -> None:
        assert sfa.dtype == torch.float32, f"SM90 SFA is fp32 (1x128), got {sfa.dtype}"
        assert tuple(sfa.shape) == shape, f"SFA shape {tuple(sfa.shape)} != {shape}"

    @staticmethod
    def _out(d: torch.Tensor, shape: tuple[int, ...]) -> None:
        assert d.dtype == torch.bfloat16, f"grouped D must be bf16, got {d.dtype}"
        assert tuple(d.shape) == shape and d.stride(-1) == 1, "D must be N-major with the right shape"
        if d.dim() == 3:
            assert d.stride(0) == d.shape[-2] * d.shape[-1]
        FakeDeepGemm._tma(d, "D")

    @staticmethod
    def _dequant_b(b: torch.Tensor, sfb: torch.Tensor) -> torch.Tensor:
        G, N, K = b.shape
        s = sfb.repeat_interleave(128, dim=-2)[:, :N].repeat_interleave(128, dim=-1)[..., :K]
        return b.float() * s

    @staticmethod
    def _dequant_a(a: torch.Tensor, sfa: torch.Tensor) -> torch.Tensor:
        return a.float() * sfa.repeat_interleave(128, dim=-1)[..., : a.shape[-1]]

    # -- the kernels --
    def m_grouped_fp8_gemm_nt_contiguous(self, a, b, d, grouped_layout, recipe=None, recipe_a=None, recipe_b=None,
                                         compiled_dims="nk", disable_ue8m0_cast=False, use_psum_layout=False,
                                         ensure_zero_padding=True, expected_m_for_psum_layout=None, epilogue=None):
        (A, sfa), (B, sfb) = a, b
        self._k_major(A, 2, "A")
        self._k_major(B, 3, "B")
        M, K = A.shape
        G, N, K_ = B.shape
        assert K == K_ and N > 0 and K > 0 and G > 0
        self._out(d, (M, N))
        assert grouped_layout.is_contiguous() and grouped_layout.dtype == torch.int32
        assert tuple(grouped_layout.shape) == (M,), "m_indices must be [M]"
        assert not use_psum_layout and recipe is None
        self._sfa(sfa, (M, _ceil_div(K, 128)))
        self._sfb(sfb, G, N, K)
        self.calls.append({"fn": "contiguous", "M": M})
        idx = grouped_layout.long()
        assert M == 0 or (int(idx.max()) < G and int(idx.min()) >= -1)
        wb = self._dequant_b(B, sfb)
        aa = self._dequant_a(A, sfa)
        d.fill_(float("nan"))                                  # rows the kernel skips hold garbage
        for b0 in range(0, M, ALIGN):
            blk = idx[b0:b0 + ALIGN]
            e = int(blk[0])
            valid = blk >= 0
            # the expert is read off the block's first row: valid rows form one prefix, one expert
            n_valid = int(valid.sum())
            assert bool(valid[:n_valid].all()) and (n_valid == 0 or e >= 0), f"block at {b0}: padding before rows"
            assert bool((blk[:n_valid] == e).all()), f"block at {b0} mixes experts {blk.unique().tolist()}"
            for s0 in range(b0, min(b0 + ALIGN, M), 64):      # all-padding 64-row sub-blocks are skipped
                if int(idx[s0]) >= 0:
                    s1 = min(s0 + 64, M)
                    d[s0:s1] = (aa[s0:s1].double() @ wb[e].double().t()).float().to(torch.bfloat16)

    def m_grouped_fp8_gemm_nt_masked(self, a, b, d, masked_m, expected_m, recipe=None, recipe_a=None,
                                     recipe_b=None, compiled_dims="nk", disable_ue8m0_cast=False, epilogue=None):
        (A, sfa), (B, sfb) = a, b
        self._k_major(A, 3, "A")
        self._k_major(B, 3, "B")
        G, M, K = A.shape
        G_, N, K_ = B.shape
        assert G == G_ and K == K_ and masked_m.numel() == G
        assert expected_m > 0 and M > 0 and N > 0 and K > 0 and G > 0
        self._out(d, (G, M, N))
        assert masked_m.is_contiguous() and masked_m.dtype == torch.int32
        self._sfa(sfa, (G, M, _ceil_div(K, 128)))
        self._sfb(sfb, G, N, K)
        self.calls.append({"fn": "masked", "expected_m": expected_m, "M": M})
        counts = masked_m.tolist()
        assert all(0 <= c <= M for c in counts), f"masked_m {counts} outside [0, {M}]"
        wb = self._dequant_b(B, sfb)
        aa = self._dequant_a(A, sfa).reshape(G * M, K)
        flat = d.view(G * M, N)
        flat.fill_(float("nan"))
        for g in reversed(range(G)):          # whole 128-row tiles into the flat view, in any order
            for t0 in range(0, _ceil_div(counts[g], 128) * 128, 128):
                r0 = g * M + t0
                r1 = min(r0 + 128, G * M)
                flat[r0:r1] = (aa[r0:r1].double() @ wb[g].double().t()).float().to(torch.bfloat16)


@pytest.fixture
def fake(monkeypatch):
    mod = FakeDeepGemm()
    monkeypatch.setitem(sys.modules, "deep_gemm", mod)
    monkeypatch.setattr(dgm, "_TEST_MODULE", mod)
    return mod


# ---- data and the reference ---------------------------------------------------------------------

def _weight(fmt: str, E: int, N: int, K: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(E, N, K, generator=g) * torch.exp2(torch.randint(-2, 2, (E, N, 1), generator=g).float())
    if fmt == "fp8_block":
        return prepare_weights(quantize(w, "fp8_block"))
    return prepare_weights(w, fmt=fmt)


def _reference(x: torch.Tensor, w, rows) -> torch.Tensor:
    """The torch reference with DeepGEMM's fp8_group activations, rounded once to bf16."""
    xq = quantize_dequantize_act(x, "fp8_group")
    return grouped_gemm_reference(xq, dequantize_prepared(w, torch.float32), rows).to(torch.bfloat16)


def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.isfinite(y.float()).all()
    torch.testing.assert_close(y.float(), ref.float(), rtol=2 ** -7, atol=1e-5)   # one bf16 ulp


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


# ---- contiguous (prefill) ------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["fp8_block", "mxfp4"])
@pytest.mark.parametrize("counts", [[0, 130, 1, 257, 64], [128, 0, 256], [3]])
def test_contiguous_matches_reference(fake, fmt, counts):
    E, N, K = len(counts), 192, 256                       # N not a multiple of 128: a partial SFB block
    w = _weight(fmt, E, N, K, seed=len(counts))
    x = torch.randn(sum(counts) + 5, K, generator=torch.Generator().manual_seed(1))   # 5 rows after the last expert
    c = torch.tensor(counts)
    y = grouped_gemm(x.to(torch.bfloat16), w, counts=c, backend="deep_gemm")
    rows = expert_rows(x, E, c, None, "contiguous")
    ref = _reference(x.to(torch.bfloat16), w, rows)
    assert y.dtype == torch.bfloat16 and y.shape == (x.shape[0], N)
    _close(y, ref)
    assert (y[sum(counts):] == 0).all()
    # the fp8 activations only: close to the unquantized torch backend
    assert _rel(y, grouped_gemm(x, w, counts=c, backend="torch")) < 3e-2
    M = x.shape[0]
    assert fake.calls[-1]["M"] == -(-(M + E * (ALIGN - 1)) // ALIGN) * ALIGN   # the static bound, no sync


def test_contiguous_with_offsets_and_gaps(fake):
    E, N, K = 3, 128, 384
    w = _weight("mxfp4", E, N, K, seed=5)
    x = torch.randn(300, K, generator=torch.Generator().manual_seed(2))
    offs = torch.tensor([0, 40, 40, 250])                  # expert 1 empty, rows 250.. unowned
    y = grouped_gemm(x, w, offsets=offs, backend="deep_gemm", out_dtype=torch.float32)
    ref = _reference(x, w, expert_rows(x, E, None, offs, "contiguous"))
    assert y.dtype == torch.float32
    _close(y, ref)


def test_contiguous_rows_aligned_skips_the_copy(fake):
    E, N, K = 3, 128, 256
    w = _weight("fp8_block", E, N, K, seed=6)
    offs = torch.tensor([0, 128, 128, 300])                # every expert starts on a multiple of 128
    x = torch.randn(384, K, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    rows = expert_rows(x, E, None, offs, "contiguous")
    y = dgm.deep_gemm_grouped_gemm(x, w, rows, out_dtype=torch.bfloat16, rows_aligned=True)
    assert fake.calls[-1]["M"] == 384                      # no padded buffer
    _close(y, _reference(x, w, rows))
    assert (y[300:] == 0).all()


# ---- slab (decode) ----------------------------------------------------------------------------------

@pytest.mark.parametrize("C", [96, 128, 200])
def test_slab_matches_reference(fake, C):
    E, N, K = 3, 128, 256
    w = _weight("mxfp4", E, N, K, seed=C)
    counts = torch.tensor([0, C, 17])                      # empty, full, partial
    x = torch.randn(E, C, K, generator=torch.Generator().manual_seed(C)).to(torch.bfloat16)
    x[2, 17:] = float("nan")                               # rows past the count: their outputs stay 0
    y = grouped_gemm(x, w, counts=counts, layout="slab", backend="deep_gemm")
    rows = expert_rows(x, E, counts, None, "slab")
    ref = _reference(x.nan_to_num(0.0), w, rows)
    assert y.shape == (E, C, N) and (y[0] == 0).all() and (y[2, 17:] == 0).all()
    _close(y, ref)
    call = fake.calls[-1]
    assert call["M"] % 128 == 0 and call["expected_m"] == C


def test_slab_expected_m_hint(fake):
    E, C, N, K = 2, 128, 64, 128
    w = _weight("fp8_block", E, N, K, seed=8)
    x = torch.randn(E, C, K)
    rows = expert_rows(x, E, torch.tensor([5, 9]), None, "slab")
    dgm.deep_gemm_grouped_gemm(x, w, rows, out_dtype=torch.bfloat16, expected_m=8)
    assert fake.calls[-1]["expected_m"] == 8


# ---- the weight ------------------------------------------------------------------------------------

def test_fp8_block_weight_is_used_as_is(fake):
    E, N, K = 2, 256, 384
    q = quantize(torch.randn(E, N, K), "fp8_block")
    w = prepare_weights(q)
    dw = dgm.deep_gemm_weight(w)
    assert dw.source == "fp8_block" and dw.data.data_ptr() == w.data.data_ptr()   # no copy of the data
    assert torch.equal(dw.scale, q.scale.float()) and dw.extra_bytes == q.scale.numel() * 4


def test_mxfp4_fold_is_exact_and_cached(fake):
    E, N, K = 3, 192, 256
    w = _weight("mxfp4", E, N, K, seed=11)
    dw = dgm.deep_gemm_weight(w)
    assert dw.source == "mxfp4 fold" and dw.scale.shape == (E, 2, 2)
    deq = FakeDeepGemm._dequant_b(dw.data, dw.scale)
    assert torch.equal(deq, dequantize_prepared(w))
    assert dgm.deep_gemm_weight(w) is dw
    assert dw.extra_bytes == dgm.cache_bytes(E, N, K) == E * (N * K + 4 * 2 * 2)


def test_memory_cost_of_the_v3_shard():
    w13, w2 = dgm.cache_bytes(32, 4096, 7168), dgm.cache_bytes(32, 7168, 2048)
    assert (w13, w2) == (32 * (4096 * 7168 + 4 * 32 * 56), 32 * (7168 * 2048 + 4 * 56 * 16))
    assert w13 + w2 == 1_409_630_208


def test_inexact_folds_are_refused_with_a_reason(fake):
    E, N, K = 1, 128, 128
    # mxfp4: two blocks of one 128x128 tile 20 exponents apart (> 14): no exact 128x128 form
    data = torch.full((E, N, K // 2), 0x11, dtype=torch.uint8)      # every value 0.5
    scale = torch.full((E, N, K // 32), 127, dtype=torch.uint8)
    scale[0, 5, 1] = 107
    w = prepare_weights(QuantizedTensor(data, scale, "mxfp4", torch.Size((E, N, K))))
    x = torch.randn(4, K)
    with pytest.raises(ValueError, match="exact 128x128-block FP8 form.*expert 0"):
        grouped_gemm(x, w, counts=torch.tensor([4]), backend="deep_gemm")
    # nvfp4 with a non-power-of-two global scale: refused
    wn = _weight("nvfp4", E, N, K, seed=12)
    why = GEMM.usable(device=torch.device("cpu"), weight=wn)["deep_gemm"]
    assert why is not None and "nvfp4 values" in why
    # fp8 whose row scales differ inside a 128-row block (gate/up split of two blocks)
    g = torch.Generator().manual_seed(13)
    wf = torch.randn(1, 256, K, generator=g)
    wf[:, 128:] *= 3.0
    wi = prepare_weights(quantize(wf, "fp8_block"), gate_up="interleaved")
    why = GEMM.usable(device=torch.device("cpu"), weight=wi)["deep_gemm"]
    assert why is not None and "128-row block" in why
    # dense weights and K not a multiple of 128
    assert "fp8_block, mxfp4 or nvfp4" in GEMM.usable(device=torch.device("cpu"), weight=prepare_weights(wf))["deep_gemm"]
    assert "multiple of 128" in GEMM.usable(device=torch.device("cpu"),
                                            weight=prepare_weights(torch.randn(1, 64, 96), fmt="fp8_block"))["deep_gemm"]


def test_nvfp4_with_power_of_two_scales_folds_exactly(fake):
    E, N, K = 2, 128, 256
    g = torch.Generator().manual_seed(14)
    data = torch.randint(0, 256, (E, N, K // 2), generator=g, dtype=torch.uint8)
    exps = torch.randint(-3, 3, (E, N, K // 16), generator=g)
    scale = ((exps + 7) << 3).to(torch.uint8)                       # E4M3 bits of 2^exp
    q = QuantizedTensor(data, scale, "nvfp4", torch.Size((E, N, K)), torch.tensor([1.0, 0.25]))
    w = prepare_weights(q)
    dw = dgm.deep_gemm_weight(w)
    assert not isinstance(dw, impl.Unusable), dw
    assert torch.equal(FakeDeepGemm._dequant_b(dw.data, dw.scale), dequantize_prepared(w))
    x = torch.randn(70, K, generator=g)
    c = torch.tensor([30, 40])
    _close(grouped_gemm(x, w, counts=c, backend="deep_gemm", out_dtype=torch.bfloat16),
           _reference(x, w, expert_rows(x, E, c, None, "contiguous")))


def test_expert_ffn_runs_both_gemms_through_deep_gemm(fake):
    from megapar.moe.kernels import expert_ffn

    E, H, inter = 3, 256, 128
    w13 = _weight("mxfp4", E, 2 * inter, H, seed=17)
    w2 = _weight("mxfp4", E, H, inter, seed=18)
    counts = torch.tensor([40, 0, 90])
    x = torch.randn(130, H, generator=torch.Generator().manual_seed(19)).to(torch.bfloat16)
    y = expert_ffn(x, w13, w2, counts=counts, backend="deep_gemm")
    assert [c["fn"] for c in fake.calls] == ["contiguous", "contiguous"]
    ref = expert_ffn(x, w13, w2, counts=counts, backend="torch")
    assert y.shape == ref.shape and _rel(y, ref) < 5e-2


# ---- resolution -----------------------------------------------------------------------------------

def test_without_the_package_the_name_is_known_and_refused():
    w = _weight("mxfp4", 2, 16, 128, seed=15)
    x = torch.randn(4, 128)
    with pytest.raises(ValueError, match="'deep_gemm' cannot run here: needs CUDA tensors"):
        grouped_gemm(x, w, counts=torch.tensor([1, 3]), backend="deep_gemm")
    assert "deep_gemm" in GEMM.names
    if not dgm.AUTO:
        assert GEMM.get("deep_gemm").auto is False       # "auto" passes over it until measured


def test_grad_is_refused(fake):
    w = _weight("mxfp4", 2, 16, 128, seed=16)
    with pytest.raises(ValueError, match="no backward"):
        GEMM.resolve("deep_gemm", device="cpu", needs_grad=True, weight=w)


# ---- libstdc++ diagnosis ------------------------------------------------------------------------------

MAPS = """\
7f0000000000-7f0000001000 r--p 00000000 08:01 123 /opt/conda/lib/libstdc++.so.6.0.29
7f0000001000-7f0000002000 r-xp 00001000 08:01 123 /opt/conda/lib/libstdc++.so.6.0.29
7f0000003000-7f0000004000 r--p 00000000 08:01 456 /usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.33
7f0000005000-7f0000006000 rw-p 00000000 00:00 0
7f0000007000-7f0000008000 r--p 00000000 08:01 789 /usr/lib/libc.so.6
7f0000009000-7f000000a000 r--p 00000000 08:01 999 /tmp/x/libstdc++-abc.so.6 (deleted)
7ffd00000000-7ffd00001000 rw-p 00000000 00:00 0 [stack]
"""


def test_mapped_libstdcxx_parses_maps():
    assert dgm.mapped_libstdcxx(MAPS) == ["/opt/conda/lib/libstdc++.so.6.0.29",
                                          "/usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.33", "/tmp/x/libstdc++-abc.so.6"]
    assert dgm.mapped_libstdcxx("") == []


def test_glibcxx_versions_of_bytes():
    blob = b"\x00GLIBCXX_3.4\x00CXXABI_1.3\x00GLIBCXX_3.4.21\x00xGLIBCXX_3.4.32\x00GLIBCXX_3.4.9\x00GLIBCXX_DEBUG\x00"
    assert dgm.glibcxx_versions(blob) == {0, 9, 21, 32}
    assert dgm.newest_glibcxx(blob) == 32 and dgm.newest_glibcxx(b"nothing") is None


SYS = "/usr/lib/x86_64-linux-gnu/libstdc++.so.6"
CONDA = "/opt/conda/lib/libstdc++.so.6.0.29"
NEW = "/usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.33"


def test_diagnose_clean_process_is_none():
    one = {s: NEW for s in dgm.KEY_SYMBOLS}
    assert dgm.diagnose({NEW: 33}, one, 32, "_C.so", {SYS: 33}) is None
    assert dgm.diagnose({NEW: 33}, {s: None for s in dgm.KEY_SYMBOLS}, None, None, {}) is None
    assert dgm.diagnose({}, {}, None, None, {}) is None


def test_diagnose_two_runtimes_names_paths_and_fix():
    msg = dgm.diagnose({CONDA: 29, NEW: 33}, {s: CONDA for s in dgm.KEY_SYMBOLS}, 32, "/p/deep_gemm/_C.so", {SYS: 33})
    assert msg is not None
    assert CONDA in msg and NEW in msg and "GLIBCXX_3.4.29" in msg and "GLIBCXX_3.4.33" in msg
    assert "needs GLIBCXX_3.4.32" in msg and f"LD_PRELOAD={SYS}" in msg


def test_diagnose_symbols_bound_to_a_foreign_runtime():
    providers = dict.fromkeys(dgm.KEY_SYMBOLS, NEW)
    providers["_ZNSt5ctypeIcE2idE"] = "/site-packages/foo/libfoo.so"
    msg = dgm.diagnose({NEW: 33}, providers, 30, "_C.so", {SYS: 33})
    assert msg is not None and "different objects" in msg and "libfoo.so" in msg and "not a libstdc++" in msg


def test_diagnose_old_runtime_only():
    msg = dgm.diagnose({CONDA: 29}, dict.fromkeys(dgm.KEY_SYMBOLS, CONDA), 32, "_C.so", {CONDA: 29})
    assert msg is not None and "has only GLIBCXX_3.4.29" in msg and "install a libstdc++ with GLIBCXX_3.4.32" in msg


def test_libstdcxx_problem_never_raises(monkeypatch):
    got = dgm.libstdcxx_problem(refresh=True)
    assert got is None or (isinstance(got, str) and "LD_PRELOAD" in got)

    def boom():
        raise OSError("no /proc")

    monkeypatch.setattr(dgm, "_inspect", boom)
    assert dgm.libstdcxx_problem(refresh=True) is None
    monkeypatch.setattr(dgm, "_inspect", lambda: "deep_gemm would crash: x")
    monkeypatch.setenv(dgm.SKIP_LIBSTDCXX_CHECK, "1")
    assert dgm.libstdcxx_problem(refresh=True) is None
    monkeypatch.delenv(dgm.SKIP_LIBSTDCXX_CHECK)
    assert dgm.libstdcxx_problem(refresh=True) == "deep_gemm would crash: x"
    dgm._libstdcxx_cache.clear()


def test_runtime_problem_refuses_the_backend(monkeypatch):
    monkeypatch.setattr(dgm, "libstdcxx_problem", lambda refresh=False: "deep_gemm would crash: two runtimes")
    why = dgm._runtime_safe(impl.Facts(torch.device("cpu")))
    assert why is not None and why.reason == "deep_gemm would crash: two runtimes"


def test_symbol_providers_on_this_machine():
    got = dgm.symbol_providers(("_ZNSt6locale7classicEv", "no_such_symbol_xyz"))
    assert got["no_such_symbol_xyz"] is None
    assert got["_ZNSt6locale7classicEv"] is None or "/" in got["_ZNSt6locale7classicEv"]


# ---- GPU: the real package ----------------------------------------------------------------------------

def _real_deep_gemm() -> bool:
    return torch.cuda.is_available() and impl.importable("deep_gemm")


def _runs_here() -> None:
    """Skip (with the check's message) where DeepGEMM would crash in this process."""
    import deep_gemm  # noqa: F401  (its libraries must be mapped for the check)

    why = dgm.libstdcxx_problem(refresh=True)
    if why is not None:
        pytest.skip(why)


@pytest.mark.gpu
@pytest.mark.skipif(not _real_deep_gemm(), reason="needs CUDA and deep_gemm")
@pytest.mark.parametrize("preload", [False, True])
def test_gpu_refuses_instead_of_crashing(preload):
    """In a fresh process without / with the system libstdc++ preloaded: the backend either runs
    and is right, or refuses with a ValueError naming the fix; it never segfaults."""
    import subprocess
    import sys

    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    lib = dgm.SYSTEM_LIBSTDCXX[0]
    if preload:
        if not os.path.exists(lib):
            pytest.skip(f"no {lib}")
        env["LD_PRELOAD"] = lib
    code = ("import torch\n"
            "from megapar.moe.kernels import grouped_gemm\n"
            "from megapar.moe.quant import quantize\n"
            "w = quantize(torch.randn(2, 256, 256), 'fp8_block').to('cuda')\n"
            "x = torch.randn(256, 256, device='cuda').to(torch.bfloat16)\n"
            "c = torch.tensor([128, 128], device='cuda')\n"
            "try:\n"
            "    y = grouped_gemm(x, w, counts=c, backend='deep_gemm')\n"
            "    r = grouped_gemm(x, w, counts=c, backend='torch')\n"
            "    print('ran', float((y.float() - r.float()).norm() / r.float().norm()))\n"
            "except ValueError as e:\n"
            "    print('refused', e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    verdict = out.stdout.strip().splitlines()[-1]
    if verdict.startswith("refused"):
        assert "LD_PRELOAD" in verdict and not preload, verdict
    else:
        assert float(verdict.split()[1]) < 6e-2, verdict   # fp8 activations against bf16 ones


@pytest.mark.parametrize("fmt", ["fp8_block", "mxfp4"])
@pytest.mark.parametrize("counts", [[0, 130, 1, 257, 64], [512, 512, 512]])
@pytest.mark.gpu
@pytest.mark.skipif(not _real_deep_gemm(), reason="needs CUDA and deep_gemm")
def test_gpu_contiguous_matches_reference(fmt, counts):
    _runs_here()
    E, N, K = len(counts), 512, 1024
    w = _weight(fmt, E, N, K, seed=21)
    x = torch.randn(sum(counts) + 3, K, generator=torch.Generator().manual_seed(22)).to(torch.bfloat16)
    c = torch.tensor(counts)
    ref = _reference(x, w, expert_rows(x, E, c, None, "contiguous"))     # on the CPU (docs/gpu.md)
    y = grouped_gemm(x.cuda(), w.to("cuda"), counts=c.cuda(), backend="deep_gemm").cpu()
    assert _rel(y, ref) < 1e-2
    assert (y[sum(counts):] == 0).all()


@pytest.mark.parametrize("C", [96, 128])
@pytest.mark.gpu
@pytest.mark.skipif(not _real_deep_gemm(), reason="needs CUDA and deep_gemm")
def test_gpu_slab_matches_reference(C):
    _runs_here()
    E, N, K = 5, 512, 1024
    w = _weight("mxfp4", E, N, K, seed=23)
    counts = torch.tensor([0, C, 17, 1, C - 1])
    x = torch.randn(E, C, K, generator=torch.Generator().manual_seed(24)).to(torch.bfloat16)
    ref = _reference(x, w, expert_rows(x, E, counts, None, "slab"))
    y = grouped_gemm(x.cuda(), w.to("cuda"), counts=counts.cuda(), layout="slab", backend="deep_gemm").cpu()
    assert _rel(y, ref) < 1e-2
    assert (y[0] == 0).all() and (y[2, 17:] == 0).all()
