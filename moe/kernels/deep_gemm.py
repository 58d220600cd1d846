"""DeepGEMM (PyPI `deepinfer-gemm`, import `deep_gemm`) as the "deep_gemm" grouped-GEMM backend (Hopper).

`grouped_gemm(..., backend="deep_gemm")` runs DeepGEMM's SM90 FP8 grouped GEMMs:
- contiguous layout (prefill) -> `m_grouped_fp8_gemm_nt_contiguous`;
- slab layout (decode) -> `m_grouped_fp8_gemm_nt_masked` with masked_m = counts.

Operands, as DeepGEMM's SM90 kernels read them (its csrc/apis/gemm.hpp, the 1D2D kernels):
- activations: E4M3 [M, K] with one fp32 scale per token and 128 along K (`fp8_group` of
  parallel.quant, quantized here per call); DeepGEMM makes the scales MN-major and TMA-aligned.
- weights: E4M3 [E, N, K] with one fp32 scale per 128x128 block, [E, ceil(N/128), ceil(K/128)].
  The SM90 grouped kernels take no finer weight scales (a per-row recipe is SM100 or the
  non-grouped 1D1D kernel only), so a weight must be exact with 128x128 power-of-two (or its
  own fp8_block) scales - see `deep_gemm_weight`; otherwise the backend refuses and says why.

Capability (`check`): CUDA tensors on an SM90 device, `deep_gemm` importable, no libstdc++ mix-up
in the process (`libstdcxx_problem`: DeepGEMM's JIT runtime segfaults at its first call when
its std::regex runs against another C++ runtime; the check names the fix), K a multiple of 128
and an exact 128x128 FP8 form of the weight. "auto" never picks this backend unless
MEGAPAR_DEEP_GEMM_AUTO=1 is set before import (it stays opt-in until measured).

No host synchronization on the call path: counts stay on the device. The weight conversion
(`deep_gemm_weight`) runs once per weight and syncs once (its exactness test), like the W4A8
fold plan at load time.

Tests replace the package with a stand-in through `_TEST_MODULE` (then the capability checks
that need CUDA and the real package are skipped and CPU tensors run).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import importlib.util
import logging
import os
import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from megapar.moe.kernels.prepare import PreparedWeight, natural_data
from megapar.parallel import impl
from megapar.parallel.quant import QuantizedTensor, dequantize, mxfp4_to_fp8_block, quantize

if TYPE_CHECKING:
    from megapar.moe.kernels.grouped_gemm import ExpertRows

log = logging.getLogger(__name__)

PACKAGE = "deep_gemm"
PACKAGE_HINT = "pip install deepinfer-gemm, or pip install -e '.[deepgemm]'"
BLOCK = 128            # weight scale block (128x128) and activation scale group (1x128)
SLAB_ROW_ALIGN = 128   # largest BLOCK_M of the SM90 masked kernel (see `_masked`)
AUTO = os.environ.get("MEGAPAR_DEEP_GEMM_AUTO", "0") == "1"
SKIP_LIBSTDCXX_CHECK = "MEGAPAR_DEEP_GEMM_SKIP_LIBSTDCXX_CHECK"

_TEST_MODULE: Any = None
"""Tests only: a stand-in for the `deep_gemm` package. When set, the wrappers call it and the
capability checks that need CUDA, SM90 and the real package are skipped."""


def _module() -> Any:
    if _TEST_MODULE is not None:
        return _TEST_MODULE
    import deep_gemm  # noqa: PLC0415 - optional package, imported when used

    return deep_gemm


# ---- libstdc++ diagnosis ----------------------------------------------------------------------------
# DeepGEMM's JIT runtime parses `nvcc --version` with std::regex at its first call. A std::regex
# builds a std::locale and looks up std::ctype<char> by its facet id: if those symbols come from
# two different C++ runtimes (or from an older one than _C was built against), the lookup walks
# another runtime's locale tables and crashes. Loading the newest system libstdc++ first
# (LD_PRELOAD) puts one runtime in front of every other copy.

KEY_SYMBOLS = (
    "_ZNSt6locale7classicEv",                         # std::locale::classic()
    "_ZNSt6localeC1Ev",                               # std::locale::locale()
    "_ZNSt5ctypeIcE2idE",                             # std::ctype<char>::id
    "_ZNKSt6locale2id5_M_idEv",                       # std::locale::id::_M_id() const
    "_ZSt9use_facetISt5ctypeIcEERKT_RKSt6locale",     # std::use_facet<std::ctype<char>>
)
SYSTEM_LIBSTDCXX = ("/usr/lib/x86_64-linux-gnu/libstdc++.so.6", "/usr/lib64/libstdc++.so.6",
                    "/usr/lib/aarch64-linux-gnu/libstdc++.so.6", "/lib/x86_64-linux-gnu/libstdc++.so.6")
_GLIBCXX = re.compile(rb"GLIBCXX_3\.4(?:\.(\d+))?(?![\d.])")


def mapped_libstdcxx(maps_text: str) -> list[str]:
    """Paths of every libstdc++ mapped in a process, in order of first mapping, from the text of
    /proc/<pid>/maps (one mapping per line, the path in the 6th column)."""
    seen: list[str] = []
    for line in maps_text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6:
            continue
        path = parts[5].strip()
        if path.endswith(" (deleted)"):
            path = path[: -len(" (deleted)")]
        if os.path.basename(path).startswith("libstdc++") and path not in seen:
            seen.append(path)
    return seen


def glibcxx_versions(blob: bytes) -> set[int]:
    """The N of every `GLIBCXX_3.4.N` string in a shared object's bytes (bare GLIBCXX_3.4 = 0):
    for libstdc++ the versions it defines, for a library using it the versions it needs."""
    return {int(m.group(1) or 0) for m in _GLIBCXX.finditer(blob)}


def newest_glibcxx(blob: bytes) -> int | None:
    found = glibcxx_versions(blob)
    return max(found) if found else None


@functools.lru_cache(maxsize=64)
def _file_newest(path: str, size: int, mtime: float) -> int | None:
    with open(path, "rb") as f:
        return newest_glibcxx(f.read())


def file_newest_glibcxx(path: str) -> int | None:
    """Newest GLIBCXX_3.4.N string in the file at `path` (cached by path, size and mtime)."""
    try:
        st = os.stat(path)
        return _file_newest(os.path.realpath(path), st.st_size, st.st_mtime)
    except OSError:
        return None


def _version(n: int | None) -> str:
    return "?" if n is None else f"GLIBCXX_3.4.{n}"


def diagnose(libs: dict[str, int | None], providers: dict[str, str | None], needed: int | None,
             needed_by: str | None, system: dict[str, int | None]) -> str | None:
    """The libstdc++ problem, as a message naming the paths and the fix, or None.

    libs: every libstdc++ mapped in the process (realpath -> newest GLIBCXX_3.4.N it defines);
    providers: key std::locale / std::ctype symbol -> the object that provides it (None: not
        found in the global scope); needed / needed_by: the newest GLIBCXX_3.4.N that deep_gemm's
        _C extension needs and its path; system: candidate system libstdc++ paths -> newest.
    """
    problems: list[str] = []
    found = {s: p for s, p in providers.items() if p}
    owners = sorted(set(found.values()))
    if len(owners) > 1:
        problems.append("the std::locale/std::ctype symbols come from different objects: "
                        + "; ".join(f"{s} -> {p}" for s, p in found.items()))
    for p in owners:
        if not os.path.basename(p).startswith("libstdc++"):
            problems.append(f"std::locale symbols are bound to {p}, which carries its own C++ runtime "
                            f"(not a libstdc++)")
    if len({v for v in libs.values() if v is not None}) > 1:
        problems.append("libstdc++ copies of different versions are mapped: "
                        + ", ".join(f"{p} ({_version(v)})" for p, v in libs.items()))
    active = next((p for p in owners if p in libs), None) or next(iter(libs), None)
    if needed is not None and active is not None and libs.get(active) is not None and libs[active] < needed:
        problems.append(f"{needed_by or 'deep_gemm._C'} needs {_version(needed)} but the libstdc++ in use, "
                        f"{active}, has only {_version(libs[active])}")
    if not problems:
        return None
    candidates = {**{p: v for p, v in system.items() if v is not None}, **{p: v for p, v in libs.items() if v is not None}}
    best = max(candidates, key=lambda p: candidates[p]) if candidates else SYSTEM_LIBSTDCXX[0]
    if needed is not None and best in candidates and candidates[best] < needed:
        fix = (f"install a libstdc++ with {_version(needed)} (newest found: {best}, {_version(candidates[best])}) "
               f"and LD_PRELOAD it before starting Python")
    else:
        fix = f"start Python with LD_PRELOAD={best} (the newest libstdc++ found) so one C++ runtime serves the process"
    return ("deep_gemm would crash in its JIT runtime (std::regex in get_compiler_info): " + "; ".join(problems)
            + f". Fix: {fix} (or set {SKIP_LIBSTDCXX_CHECK}=1 to skip this check)")


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def _libdl() -> Any:
    for name in (None, "libdl.so.2"):
        try:
            lib = ctypes.CDLL(name)
            lib.dlsym, lib.dladdr  # noqa: B018 - both exist (glibc >= 2.34 has them in libc)
            return lib
        except (OSError, AttributeError):
            continue
    return None


def symbol_providers(symbols: tuple[str, ...] = KEY_SYMBOLS, library: str | None = None) -> dict[str, str | None]:
    """symbol -> realpath of the object providing it: the global scope (RTLD_DEFAULT; what every
    library binds to first), else - when `library` (a loaded object's path) is given - that
    library's own dependency scope. None where neither has it."""
    dl = _libdl()
    if dl is None:
        return {s: None for s in symbols}
    dl.dlsym.restype = ctypes.c_void_p
    dl.dlsym.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    dl.dladdr.restype = ctypes.c_int
    dl.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    local = None
    if library is not None:
        try:
            local = ctypes.CDLL(library, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)._handle
        except OSError:
            local = None
    out: dict[str, str | None] = {}
    for s in symbols:
        addr = dl.dlsym(None, s.encode())              # RTLD_DEFAULT is the null handle
        if not addr and local is not None:
            addr = dl.dlsym(local, s.encode())
        info = _DlInfo()
        if addr and dl.dladdr(addr, ctypes.byref(info)) and info.dli_fname:
            out[s] = os.path.realpath(info.dli_fname.decode())
        else:
            out[s] = None
    return out


def extension_path() -> str | None:
    """Path of deep_gemm's compiled extension (_C*.so), found without importing the package."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        hits = sorted(glob.glob(os.path.join(root, "_C*.so")))
        if hits:
            return hits[0]
    return None


def _inspect() -> str | None:
    with open("/proc/self/maps") as f:
        maps = f.read()
    libs: dict[str, int | None] = {}
    for p in mapped_libstdcxx(maps):
        libs.setdefault(os.path.realpath(p), file_newest_glibcxx(p))
    ext = extension_path()
    needed = file_newest_glibcxx(ext) if ext else None
    loaded_ext = ext if ext and os.path.realpath(ext) in {os.path.realpath(q) for q in _mapped_paths(maps)} else None
    providers = symbol_providers(KEY_SYMBOLS, loaded_ext)
    system = {p: file_newest_glibcxx(p) for p in SYSTEM_LIBSTDCXX if os.path.exists(p)}
    return diagnose(libs, providers, needed, ext, system)


def _mapped_paths(maps_text: str) -> set[str]:
    return {parts[5].strip() for line in maps_text.splitlines() if len(parts := line.split(None, 5)) == 6}


_libstdcxx_cache: list[str | None] = []


def libstdcxx_problem(refresh: bool = False) -> str | None:
    """Why DeepGEMM's JIT runtime would crash in this process (two C++ runtimes, or std::locale
    bound to the wrong object), with the paths and the fix; None when nothing is wrong or it
    cannot be inspected. Never raises. Cached: the first answer after `deep_gemm` was imported
    stands (pass refresh=True to look again)."""
    if os.environ.get(SKIP_LIBSTDCXX_CHECK) == "1":
        return None
    if _libstdcxx_cache and not refresh:
        return _libstdcxx_cache[0]
    try:
        why = _inspect()
    except Exception as e:  # noqa: BLE001 - a diagnosis must never break the caller
        log.debug("libstdc++ inspection failed: %s: %s", type(e).__name__, e)
        why = None
    if PACKAGE in sys.modules:   # the libraries deep_gemm loads are mapped: the answer is final
        _libstdcxx_cache[:] = [why]
    return why


# ---- capability --------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _needs_sm90(f: impl.Facts) -> impl.Unusable | None:
    dev = f.device
    major, minor = _capability(dev.index if dev.index is not None else torch.cuda.current_device())
    if major != 9:
        return impl.Unusable(f"DeepGEMM's FP8 grouped kernels here are the SM90 (Hopper) ones, got sm_{major}{minor}")
    return None


_needs_package = impl.needs_package(PACKAGE, PACKAGE_HINT)


def _runtime_safe(f: impl.Facts) -> impl.Unusable | None:
    why = libstdcxx_problem()
    return None if why is None else impl.Unusable(why)


_capable = impl.all_of(impl.needs_cuda_tensor, _needs_sm90, _needs_package, _runtime_safe)


def check(f: impl.Facts) -> impl.Unusable | None:
    """The Impl check of "deep_gemm" (facts: device, needs_grad, weight)."""
    if _TEST_MODULE is None:
        why = _capable(f)
        if why is not None:
            return why
    why = impl.forward_only(f)
    if why is not None:
        return why
    w: PreparedWeight | None = f.weight
    if w is None:                        # (impl.report(): no inputs, only capabilities)
        return None
    if w.fmt not in ("fp8", "mxfp4", "nvfp4"):
        return impl.Unusable(f"deep_gemm needs fp8_block, mxfp4 or nvfp4 weights (FP8 operands), got {w.fmt!r}")
    if w.k % BLOCK or w.n % 8:
        return impl.Unusable(f"deep_gemm needs K a multiple of {BLOCK} and N of 8 (TMA), got N={w.n}, K={w.k}")
    dw = deep_gemm_weight(w)
    return dw if isinstance(dw, impl.Unusable) else None


# ---- the weight ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DeepGemmWeight:
    """A weight as DeepGEMM's SM90 grouped kernels read it.

    data: float8_e4m3fn [E, N, K], contiguous (shared with the PreparedWeight for fp8_block weights).
    scale: fp32 [E, ceil(N/128), ceil(K/128)], contiguous: one scale per 128x128 block.
    source: how it was made ("fp8_block" scales as they are, "mxfp4 fold", "exact refold").
    extra_bytes: device memory this copy adds to the PreparedWeight.
    """

    data: torch.Tensor
    scale: torch.Tensor
    source: str
    extra_bytes: int


def cache_bytes(E: int, N: int, K: int) -> int:
    """Bytes of an FP8 copy with 128x128 fp32 scales of an [E, N, K] weight: E * (N*K + 4 *
    ceil(N/128) * ceil(K/128)). V3 EP=8 shard (32 experts, H=7168, I=2048): W13 [32, 4096, 7168]
    939,753,472 + W2 [32, 7168, 2048] 469,876,736 = 1,409,630,208 B (1.31 GiB) per MoE layer,
    on top of the 748,683,264 B of the MXFP4 weights themselves."""
    return E * (N * K + 4 * (-(-N // BLOCK)) * (-(-K // BLOCK)))


def _block_scales_of_rows(scale: torch.Tensor) -> torch.Tensor | None:
    """fp8 PreparedWeight scales [E, N, Kb] (one per row) -> [E, ceil(N/128), Kb] when every
    128-row block has one scale per column block (as fp8_block quantization makes them), else None.
    (Rows reordered by gate/up splitting can mix blocks.)"""
    E, N, Kb = scale.shape
    blocks = scale[:, ::BLOCK]
    same = torch.equal(blocks.repeat_interleave(BLOCK, dim=1)[:, :N], scale)
    return blocks.contiguous() if same else None


def _expert(w: PreparedWeight, e: int, fp4_natural: torch.Tensor | None) -> QuantizedTensor:
    """Expert e of a quantized PreparedWeight as a QuantizedTensor [N, K]; fp4_natural: the FP4
    bytes in checkpoint order (`natural_data(w)`, made once by the caller)."""
    _, N, K = w.shape
    if w.is_fp4:
        gs = None if w.global_scale is None else w.global_scale[e]
        return QuantizedTensor(fp4_natural[e], w.scale[e], w.fmt, torch.Size((N, K)), gs)
    return QuantizedTensor(w.data[e], w.scale[e], "fp8_group", torch.Size((N, K)))   # one scale per (row, 128)


def _fold(w: PreparedWeight) -> DeepGemmWeight | impl.Unusable:
    E, N, K = w.shape
    if w.fmt == "fp8":
        blocks = _block_scales_of_rows(w.scale)
        if blocks is not None:
            return DeepGemmWeight(w.data.contiguous(), blocks, "fp8_block", blocks.numel() * 4)
    data = torch.empty(E, N, K, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty(E, -(-N // BLOCK), -(-K // BLOCK), dtype=torch.float32, device=w.device)
    nat = natural_data(w) if w.is_fp4 else None       # untile / unpack once, not per expert
    for e in range(E):                                # one expert at a time: bounded fp32 temporaries
        q = _expert(w, e, nat)
        if w.fmt == "mxfp4":
            try:
                f = mxfp4_to_fp8_block(q, tile_rows=BLOCK, strict=True)
            except ValueError as err:
                return impl.Unusable(f"deep_gemm needs an exact 128x128-block FP8 form of the weight; expert {e}: {err}")
        else:
            v = dequantize(q, torch.float32)
            f = quantize(v, "fp8_block", ue8m0=True)
            lost = int((dequantize(f, torch.float32) != v).sum())
            if lost:
                what = ("fp8 row scales differ inside a 128-row block (rows reordered, e.g. gate/up split)"
                        if w.fmt == "fp8" else f"{w.fmt} values")
                return impl.Unusable(f"deep_gemm needs an exact 128x128-block FP8 form of the weight: {what}; "
                                     f"expert {e}: {lost} of {N * K} elements are not exact in E4M3 with one "
                                     f"power-of-two scale per 128x128 block")
        data[e].copy_(f.data)
        scale[e].copy_(f.scale)
    return DeepGemmWeight(data, scale, f"{w.fmt} fold" if w.fmt != "fp8" else "exact refold",
                          data.numel() + scale.numel() * 4)


def deep_gemm_weight(w: PreparedWeight) -> DeepGemmWeight | impl.Unusable:
    """The weight in DeepGEMM's form, made once and cached on `w` (or why there is none).

    fp8_block: its data with one scale per 128x128 block (no copy of the data; rows reordered
    across blocks need an exact refold). mxfp4: the exact fold of parallel.quant
    (`mxfp4_to_fp8_block(tile_rows=128, strict=True)`: every 128x128 block's scale exponents
    span <= 14). nvfp4 (and reordered fp8): quantized to fp8_block with power-of-two scales and
    kept only when that reproduces every value exactly. A fold that is not exact is refused
    (the reason says which expert), never rounded. Memory: `cache_bytes` (N*K bytes + scales per
    expert; the FP4 original stays resident). Syncs once (the exactness test)."""
    if "deep_gemm" not in w.cache:
        if w.fmt not in ("fp8", "mxfp4", "nvfp4"):
            return impl.Unusable(f"deep_gemm needs fp8_block, mxfp4 or nvfp4 weights, got {w.fmt!r}")
        w.cache["deep_gemm"] = _fold(w)
    return w.cache["deep_gemm"]


# ---- the wrappers ------------------------------------------------------------------------------------

def alignment(dg: Any) -> int:
    """DeepGEMM's M alignment of the contiguous layout (its BLOCK_M on SM90; 128 by default)."""
    fn = getattr(dg, "get_mk_alignment_for_contiguous_layout", None) or dg.get_m_alignment_for_contiguous_layout
    return int(fn())


def _ceil(a: int, b: int) -> int:
    return -(-a // b) * b


def deep_gemm_grouped_gemm(x: torch.Tensor, w: PreparedWeight, rows: ExpertRows, *, out_dtype: torch.dtype,
                           expected_m: int | None = None, rows_aligned: bool = False) -> torch.Tensor:
    """y = x @ w[e]^T per expert through DeepGEMM (any device when `_TEST_MODULE` is set).

    x: contiguous [M, K] or slab [E, C, K]; rows: `expert_rows(...)`. Activations are quantized
    to fp8_group here. expected_m (slab): DeepGEMM's hint of rows per expert (default: rows.rows_hint,
    which is C unless the caller gave a hint).
    rows_aligned (contiguous, offsets given): the caller guarantees every expert starts at a
    multiple of the alignment (DeepGEMM's own layout): no padding copy. Output in `out_dtype`
    (DeepGEMM writes bf16); rows without an expert are zero.
    """
    dg = _module()
    dw = deep_gemm_weight(w)
    if isinstance(dw, impl.Unusable):
        raise ValueError(f"moe.grouped_gemm: 'deep_gemm' cannot run here: {dw.message()}")
    if rows.layout == "slab":
        return _masked(dg, x, dw, rows, out_dtype, expected_m)
    return _contiguous(dg, x, dw, rows, out_dtype, rows_aligned)


def _contiguous(dg: Any, x: torch.Tensor, dw: DeepGemmWeight, rows: ExpertRows, out_dtype: torch.dtype,
                rows_aligned: bool) -> torch.Tensor:
    """Prefill. DeepGEMM reads the expert of each BLOCK_M-row block off its first row
    (m_indices[r] = expert, -1 = padding: skipped), so every expert must start on a multiple of
    the alignment A (128). Unless the caller says the rows already are so (`rows_aligned`), the
    quantized rows are scattered on the device into a buffer of the static bound
    M + E*(A-1) rows (rounded up to A): expert e's rows start at sum_{j<e} ceil(c_j/A)*A.
    Cost: one copy of the fp8 activations and their scales (M*K + 4*M*K/128 bytes) into that
    buffer, one gather of the bf16 output back (2*M*N bytes read and written), and up to
    E*(A-1) padding rows in the GEMM (DeepGEMM skips 64-row sub-blocks that are all padding:
    at most ~E*64 extra rows are computed, e.g. 32 experts x 512 rows: <= 12.5%)."""
    M, K = x.shape
    E = rows.num_experts
    N = dw.data.shape[1]
    dev = x.device
    q = quantize(x, "fp8_group")                                       # e4m3 [M, K], fp32 [M, K/128]
    counts = rows.counts.to(torch.int64)
    starts = rows.offsets[:-1].to(torch.int64) if rows.offsets is not None else torch.cumsum(counts, 0) - counts
    ends = starts + counts
    r = torch.arange(M, device=dev)
    e_of = torch.searchsorted(ends.contiguous(), r, right=True).clamp_(max=max(E - 1, 0))   # [M]
    valid = (r >= starts[e_of]) & (r < ends[e_of])
    if rows_aligned:
        m_idx = torch.where(valid, e_of, -1).to(torch.int32)
        d = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
        dg.m_grouped_fp8_gemm_nt_contiguous((q.data, q.scale), (dw.data, dw.scale), d, m_idx)
        return torch.where(valid[:, None], d, 0).to(out_dtype)
    A = alignment(dg)
    Mp = _ceil(M + E * (A - 1), A)
    padded = (counts + A - 1) // A * A
    pstart = torch.cumsum(padded, 0) - padded
    dest = torch.where(valid, pstart[e_of] + r - starts[e_of], Mp)     # invalid rows -> the spare row Mp
    a = torch.empty(Mp + 1, K, dtype=torch.float8_e4m3fn, device=dev)
    sfa = torch.empty(Mp + 1, q.scale.shape[1], dtype=torch.float32, device=dev)
    m_idx = torch.full((Mp + 1,), -1, dtype=torch.int32, device=dev)
    a.view(torch.uint8).index_copy_(0, dest, q.data.view(torch.uint8))   # (no fp8 index_copy_ kernel)
    sfa.index_copy_(0, dest, q.scale)
    m_idx.index_copy_(0, dest, torch.where(valid, e_of, -1).to(torch.int32))
    d = torch.empty(Mp, N, dtype=torch.bfloat16, device=dev)
    dg.m_grouped_fp8_gemm_nt_contiguous((a[:Mp], sfa[:Mp]), (dw.data, dw.scale), d, m_idx[:Mp])
    y = d.index_select(0, dest.clamp(max=Mp - 1))
    return torch.where(valid[:, None], y, 0).to(out_dtype)


def _masked(dg: Any, x: torch.Tensor, dw: DeepGemmWeight, rows: ExpertRows, out_dtype: torch.dtype,
            expected_m: int | None) -> torch.Tensor:
    """Decode. DeepGEMM stores whole BLOCK_M-row tiles (64 or 128) into a flat [E*C, N] view of
    the output, so with C not a multiple of 128 the last tile of expert e would overwrite the
    first rows of expert e+1: C is padded up to a multiple of 128 (a copy of the fp8 slab) when
    it is not. Rows >= counts[e] come back zero."""
    E, C, K = x.shape
    N = dw.data.shape[1]
    q = quantize(x.reshape(E * C, K), "fp8_group")                     # e4m3 [E*C, K], fp32 [E*C, K/128]
    a, sfa = q.data.view(E, C, K), q.scale.view(E, C, -1)
    Cp = _ceil(max(C, 1), SLAB_ROW_ALIGN)
    if Cp != C:
        a = torch.zeros(E, Cp, K, dtype=torch.float8_e4m3fn, device=x.device)
        a[:, :C] = q.data.view(E, C, K)
        sfa = torch.zeros(E, Cp, q.scale.shape[-1], dtype=torch.float32, device=x.device)
        sfa[:, :C] = q.scale.view(E, C, -1)
    masked_m = rows.counts.to(torch.int32).contiguous()
    d = torch.empty(E, Cp, N, dtype=torch.bfloat16, device=x.device)
    dg.m_grouped_fp8_gemm_nt_masked((a, sfa), (dw.data, dw.scale), d, masked_m, int(expected_m or max(round(rows.rows_hint), 1)))
    keep = torch.arange(C, device=x.device)[None, :] < rows.counts[:, None]
    return torch.where(keep[..., None], d[:, :C], 0).to(out_dtype)
