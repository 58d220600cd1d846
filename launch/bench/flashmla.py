"""FlashMLA, DeepSeek's MLA decode kernels for Hopper, as an anchor of `megapar bench cp`'s MLA rows.

FlashMLA's dense decode (sm90a, bf16 latent cache of page 64, 576-wide keys, 512-wide values) is
what a DeepSeek V3 server runs for MLA decode (vLLM's FLASHMLA backend), so it is the anchor our
absorbed MLA decode kernel is held against beside plain torch. It is not a dependency of the
project: `megapar bench cp` times it only where MEGAPAR_FLASHMLA_SRC names an unpacked FlashMLA
source folder (its csrc/ with the CUTLASS headers at csrc/cutlass/include;
bench/fetch_flashmla.sh packs the pinned commits for the GPU machine, which has no network).
`build` compiles the three CUDA files the dense decode needs (its split-KV kernel, the scheduler
metadata kernel, the split combine) and a one-function binding of FlashMLA's own
`dense_attn_decode_interface` with torch's extension builder; nothing else of FlashMLA's
extension (sparse, sm100) is built.

`FlashMLADecode` calls it as FlashMLA's Python interface does: the first call plans the splits
(its metadata kernel) and keeps the plan; later calls reuse it, so a captured call is the
split-KV kernel and the combine only (two launches, as a server's decode step runs it)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

ENV = "MEGAPAR_FLASHMLA_SRC"
FLASHMLA_COMMIT = "9241ae3"      # deepseek-ai/FlashMLA, "Swap FlashMLA combine grid dimensions (#182)"
CUTLASS_COMMIT = "147f567"       # NVIDIA/cutlass: FlashMLA's csrc/cutlass submodule at that commit
SOURCES = ("csrc/sm90/decode/dense/instantiations/bf16.cu",
           "csrc/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu",
           "csrc/smxx/decode/combine/combine.cu")
INCLUDES = ("csrc", "csrc/api", "csrc/sm90", "csrc/kerutils/include", "csrc/cutlass/include",
            "csrc/cutlass/tools/util/include")
BINDING = """#include <pybind11/pybind11.h>
#include "dense_decode.h"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("dense_decode_fwd", &dense_attn_decode_interface); }
"""
NVCC_FLAGS = ("-O3", "-std=c++20", "-DNDEBUG", "-D_USE_MATH_DEFINES", "-DFLASH_MLA_DISABLE_FP16",
              "-Wno-deprecated-declarations", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
              "-U__CUDA_NO_HALF2_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "--expt-relaxed-constexpr",
              "--expt-extended-lambda", "--use_fast_math", "--ptxas-options=--register-usage-level=10",
              "-gencode", "arch=compute_90a,code=sm_90a")
"""FlashMLA's own nvcc flags for its sm90 build (its ptxas register-usage level included: the machine code
it ships; its fp16 instantiations, its diagnostics and line info left out)."""
CXX_FLAGS = ("-O3", "-std=c++20", "-DNDEBUG", "-Wno-deprecated-declarations", "-DFLASH_MLA_DISABLE_FP16")
"""... and its host compiler's, for the binding."""

_loaded: dict[str, Any] = {}


def missing_files(src: str | os.PathLike) -> list[str]:
    """The files of SOURCES and the include folders that `src` lacks (empty: it can be built)."""
    root = Path(src)
    need = list(SOURCES) + [p for p in INCLUDES if p != "csrc/api"] + ["csrc/api/dense_decode.h"]
    return [p for p in need if not (root / p).exists()]


def build(src: str | os.PathLike, build_dir: str | os.PathLike | None = None, verbose: bool = False):
    """Compile FlashMLA's dense sm90 decode from the source folder `src` (see the module doc) into
    an extension module with `dense_decode_fwd`; ValueError naming the missing files first."""
    from torch.utils.cpp_extension import CUDA_HOME, load

    root = Path(src).resolve()
    missing = missing_files(root)
    if missing:
        raise ValueError(f"{root} is not a FlashMLA source folder with CUTLASS: missing {missing} "
                         f"(pack one with bench/fetch_flashmla.sh)")
    out = Path(build_dir) if build_dir is not None else root / "build-megapar"
    out.mkdir(parents=True, exist_ok=True)
    binding = out / "binding.cpp"
    if not binding.exists() or binding.read_text() != BINDING:
        binding.write_text(BINDING)
    includes = [str(root / p) for p in INCLUDES]
    # CUDA 13 keeps cuda/std (which CUTLASS includes) under include/cccl; the host compiler that
    # builds the binding is not given that folder by torch's builder
    cccl = Path(CUDA_HOME or "/usr/local/cuda") / "include" / "cccl"
    if cccl.is_dir():
        includes.append(str(cccl))
    return load(name="megapar_flashmla", sources=[str(binding)] + [str(root / s) for s in SOURCES],
                extra_include_paths=includes, extra_cflags=list(CXX_FLAGS),
                extra_cuda_cflags=list(NVCC_FLAGS), build_directory=str(out), verbose=verbose)


def load_from_env():
    """The built module when MEGAPAR_FLASHMLA_SRC is set (built once a process), else None. A
    failed build raises (the caller says so in its results)."""
    src = os.environ.get(ENV)
    if not src:
        return None
    if src not in _loaded:
        _loaded[src] = build(src)
    return _loaded[src]


class FlashMLADecode:
    """FlashMLA's dense decode over one paged latent cache, as its Python interface calls it: q [B,
    H, 576] or [B, Tq, H, 576] bf16, cache [nb, 64, 1, 576] bf16 (`MLACache.kv`), table [B, nbmax]
    int32, lens [B] int32 (this cache's tokens of each sequence). The first call plans the splits
    and keeps the plan (valid while the shapes and the lengths stay those of that call, as
    FlashMLA's own metadata is); returns (out [B, (Tq,) H, 512] bf16, lse [B, H, Tq] fp32, natural log;
    Tq = 1 for a 3-D q)."""

    def __init__(self, module, scale: float, causal: bool = False):
        self.module, self.scale, self.causal = module, float(scale), causal
        self.meta: Tensor | None = None
        self.splits: Tensor | None = None

    def __call__(self, q: Tensor, cache: Tensor, table: Tensor, lens: Tensor) -> tuple[Tensor, Tensor]:
        single = q.dim() == 3
        q4 = q.unsqueeze(1) if single else q
        out, lse, meta, splits = self.module.dense_decode_fwd(q4, cache, 512, lens, table, self.scale, self.causal,
                                                              self.meta, self.splits)
        if self.meta is None:
            self.meta, self.splits = meta, splits
        return (out[:, 0] if single else out), lse
