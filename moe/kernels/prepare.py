"""Expert weights in the layout the grouped-GEMM kernels read, prepared once at load time.

One idea: FP4 bytes are *paired* by scale block. Inside each chunk of two scale blocks
(2 x 32 elements for MXFP4, 2 x 16 for NVFP4), byte j holds element j (low nibble) and
element j + block (high nibble), instead of elements 2j and 2j + 1. A kernel then expands
the low nibbles of a [rows, block] byte tile into block 2c and the high nibbles into block
2c + 1: two dense operands with exactly one scale per row each, and no register shuffles
to interleave nibbles. The bytes and scales are the checkpoint's, only reordered.

Other preparation done here, once:
- W13 with interleaved gate/up rows (row 2i gate, 2i + 1 up) is reordered to split halves
  (rows [0, I) gate, [I, 2I) up), so a kernel reads the gate and up tiles at a fixed offset.
- fp8_block (128x128 fp32 scales) is kept as E4M3 data with one scale per (row, 128 along K),
  which survives row reordering and is what the fp8 kernel reads.
- For MXFP4 the exact W4A8 fold (docs/numerics.md, parallel.quant.fold) is planned (`fold_plan`): per row,
  the largest block exponent; `rowwise_exact` says whether one fp32 scale per row keeps every
  element exact in E4M3 (then a rowwise fp8 GEMM applies), `group_exact` the same for one
  scale per 1x128 group.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from megapar.parallel.quant import QuantizedTensor, dequantize, load_fp4_checkpoint, quantize
from megapar.parallel.quant.reference import expected_storage

_log = logging.getLogger(__name__)

WeightFmt = Literal["bf16", "fp16", "fp32", "mxfp4", "nvfp4", "fp8"]
Packing = Literal["natural", "paired", "oct", "octb"]
GateUp = Literal["split", "interleaved"]

DENSE_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
FP4_BLOCK = {"mxfp4": 32, "nvfp4": 16}
FOLD_SPREAD = 14   # e_max - e_block <= 14 keeps every E2M1 value exact in E4M3 (moe.quant.fold)
# FP4 rows are stored in tiles of this many rows (see PreparedWeight.tile_n) unless asked otherwise;
# measured on the H200 (bench/gemm-notes.md): 64-row tiles + 64-row programs were the fastest decode.
DEFAULT_TILE_N = 64


@dataclass(frozen=True, kw_only=True)
class PreparedWeight:
    """Stacked expert weights [E, N, K] (y = x @ w[e]^T) ready for the grouped GEMMs.

    data: bf16/fp16/fp32 [E, N, K]; mxfp4/nvfp4: uint8 [E, N, K/2] (`packing` says the nibble
        order); fp8: float8_e4m3fn [E, N, K].
    scale: mxfp4: uint8 E8M0 [E, N, K/32]; nvfp4: uint8 E4M3 bits [E, N, K/16];
        fp8: fp32 [E, N, ceil(K/128)]; dense: None.
    global_scale: nvfp4: fp32 [E] (one per expert); else None.
    tile_n: FP4 only: 0 = rows in order; T > 0 = the rows come in tiles of T, and within a tile
        the T rows' bytes of one packing unit are contiguous (one program's load is one block).
    cache: derived data computed once (the W4A8 fold plan, the per-row fold scale, copies in
        another kernel layout made by `in_layout`), never part of equality.

    Everything a kernel needs to choose and launch is read off this object: `fused_fp4_fits`,
    `fp8_fold` (the exact FP8 form, if any), `strides()` (addressing of packing, tiles and rows)
    and `in_layout(packing, tile_n)` (the weight in a kernel's layout, prepared once).
    """

    fmt: WeightFmt
    shape: tuple[int, int, int]
    data: torch.Tensor
    scale: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None
    packing: Packing = "natural"
    tile_n: int = 0
    gate_up: GateUp | None = None
    cache: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_experts(self) -> int:
        return self.shape[0]

    @property
    def n(self) -> int:
        return self.shape[1]

    @property
    def k(self) -> int:
        return self.shape[2]

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def is_fp4(self) -> bool:
        return self.fmt in FP4_BLOCK

    @property
    def block(self) -> int:
        """Elements per scale along K (32 mxfp4, 16 nvfp4, 128 fp8, 0 dense)."""
        return FP4_BLOCK.get(self.fmt, 128 if self.fmt == "fp8" else 0)

    @property
    def nbytes(self) -> int:
        parts = (self.data, self.scale, self.global_scale)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def _mapped(self, fn) -> PreparedWeight:
        """This weight over fn of each of its tensors, its derived data (cache) rebuilt on first use."""
        f = (lambda t: None if t is None else fn(t))
        return replace(self, data=f(self.data), scale=f(self.scale), global_scale=f(self.global_scale), cache={})

    def to(self, device: torch.device | str) -> PreparedWeight:
        return self._mapped(lambda t: t.to(device))

    def clone(self) -> PreparedWeight:
        """A copy over fresh storage (e.g. a benchmark's copies, read in turn so none is in L2)."""
        return self._mapped(torch.Tensor.clone)

    @property
    def fused_fp4_fits(self) -> bool:
        """The Triton FP4 kernels expand two scale blocks per step: K must hold a whole number of
        them (tiny test shapes may not; "auto" then takes the dequantizing torch path)."""
        return not self.is_fp4 or self.k % (2 * self.block) == 0

    @property
    def fold(self) -> FoldPlan | None:
        """The W4A8 fold plan (mxfp4; planned at load time), else None."""
        return fold_plan(self) if self.fmt == "mxfp4" else None

    @property
    def fp8_fold(self) -> Literal["fp8", "row", "group"] | None:
        """How the W4A8 GEMM gets exact FP8 weights: "fp8" (already fp8), "row" / "group" (mxfp4
        folded with one scale per row / per 1x128 group), None (no exact FP8 form)."""
        if self.fmt == "fp8":
            return "fp8"
        plan = self.fold
        if plan is None:
            return None
        return "row" if plan.rowwise_exact else "group" if plan.group_exact else None

    @property
    def fp8_exact(self) -> bool:
        return self.fp8_fold is not None

    def keep_fp8(self) -> PreparedWeight:
        """Keep the exact FP8 form of this mxfp4 weight resident (the W4A8 GEMM then reads it
        instead of expanding the FP4 weight on every call): e4m3 [E, N, K] plus its fp32 scales,
        2x the FP4 bytes on top of them (V3 L1 shard of 32 experts: +896 MiB). For prefill, where
        the per-call expansion is what keeps W4A8 under the fp8 anchor (bench/gemm-notes.md);
        decode (W4A16) reads the FP4 weight either way. Returns self; an fp8 weight needs
        nothing; ValueError when there is no exact FP8 form (`fp8_fold` None)."""
        if self.fmt == "fp8":
            return self
        if self.fp8_fold is None:
            raise ValueError(f"keep_fp8 needs an mxfp4 weight with an exact FP8 form, got fmt {self.fmt!r}"
                             + (" (blocks more than 14 exponents below their group's largest)"
                                if self.fmt == "mxfp4" else ""))
        if "fp8_resident" not in self.cache:
            from megapar.moe.kernels.triton_expand import expand_fp4

            self.cache["fp8_resident"] = expand_fp4(self, fold=self.fp8_fold)
        return self

    @property
    def kernel_packing(self) -> Packing:
        """The packing the fused FP4 kernels read for this weight: its own, unless natural (then
        the widest unit that divides K)."""
        if self.packing != "natural":
            return self.packing
        return "oct" if self.k % (8 * self.block) == 0 else "paired"

    def in_layout(self, packing: Packing, tile_n: int | None = None) -> PreparedWeight:
        """This weight with FP4 nibbles in `packing` and rows tiled by `tile_n` (None: as now; 0:
        rows in order): itself when it already is, else a copy made once and cached (load time
        is the place for it: `prepare_weights(packing=..., tile_n=...)`)."""
        if not self.is_fp4:
            return self
        tile_n = self.tile_n if tile_n is None else tile_n
        if self.packing == packing and self.tile_n == tile_n:
            return self
        key = ("layout", packing, tile_n)
        if key not in self.cache:
            _log.info("moe.kernels: re-laying out a %s weight %s -> %s/tile %d once (prepare it in this layout "
                      "at load time to avoid the copy)", self.fmt, self.packing, packing, tile_n)
            self.cache[key] = repack(self, packing, tile_n=tile_n)
        return self.cache[key]

    def strides(self) -> WeightStrides:
        """How the kernels address this FP4 weight (see WeightStrides)."""
        if not self.is_fp4 or self.packing == "natural":
            raise ValueError(f"kernel strides need an FP4 weight in paired/oct packing, got {self.fmt} "
                             f"{self.packing}; use in_layout() or prepare_weights()")
        E, N, K = self.shape
        oct = self.packing in ("oct", "octb")
        data = self.data.view(torch.int32) if oct else self.data
        per_row = K // 8 if oct else K // 2                 # data elements per row
        unit = self.block                                    # data elements per packing unit and row
        if self.tile_n:
            T = self.tile_n
            return WeightStrides(data, N * per_row, T * per_row, unit, T * unit, T)
        return WeightStrides(data, N * per_row, 0, per_row, unit, UNTILED)

    def row_fold_scale(self) -> torch.Tensor:
        """fp32 [E, N]: 2^e_ref per row (NaN where the row has a NaN block scale), cached (mxfp4)."""
        if "row_fold_scale" not in self.cache:
            e_ref = fold_plan(self).e_ref
            scale = ((e_ref + 127) << 23).view(torch.float32)
            scale = torch.where((self.scale == 255).any(-1), float("nan"), scale)
            self.cache["row_fold_scale"] = scale.contiguous()
        return self.cache["row_fold_scale"]

    def row_max_scale(self) -> torch.Tensor:
        """uint8 [E, N]: each row's largest E8M0 block exponent (255 where any block is NaN),
        cached (mxfp4; the fused W4A16 kernel's prescaled operands are relative to it)."""
        if self.fmt != "mxfp4":
            raise ValueError(f"row_max_scale is for mxfp4 weights, got {self.fmt!r}")
        if "row_max_scale" not in self.cache:
            self.cache["row_max_scale"] = self.scale.amax(-1).contiguous()   # 255 (NaN) is the largest byte
        return self.cache["row_max_scale"]


UNTILED = 1 << 30   # WeightStrides.tile_n of a weight whose rows are in order


@dataclass(frozen=True)
class WeightStrides:
    """How the kernels address a prepared FP4 weight: data (uint8, or int32 words for oct) and
    the strides of expert, row tile, row inside the tile, and packing unit, in data elements."""

    data: torch.Tensor
    expert: int
    tile: int
    row: int
    chunk: int
    tile_n: int

    def row_offset(self, rows: int) -> int:
        """Data offset of row n + rows from row n (rows a multiple of the tile height when tiled)."""
        if self.tile_n < UNTILED:
            if rows % self.tile_n:
                raise ValueError(f"row offset {rows} is not a multiple of the weight tile height {self.tile_n}")
            return rows // self.tile_n * self.tile
        return rows * self.row


# ---- nibble orders ------------------------------------------------------------------------------

def _codes(data: torch.Tensor) -> torch.Tensor:
    """Natural packing uint8 [..., K/2] -> codes uint8 [..., K]."""
    return torch.stack((data & 0xF, data >> 4), dim=-1).reshape(*data.shape[:-1], 2 * data.shape[-1])


def _natural(codes: torch.Tensor) -> torch.Tensor:
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def pair_fp4(data: torch.Tensor, block: int) -> torch.Tensor:
    """Natural packing (element 2i low, 2i+1 high) -> paired packing (byte j of each 2*block
    chunk: element j low, element j + block high). data: uint8 [..., K/2]."""
    codes = _codes(data).reshape(*data.shape[:-1], -1, 2, block)                   # [..., K/2B, 2, B]
    return (codes[..., 0, :] | (codes[..., 1, :] << 4)).reshape(data.shape)


def unpair_fp4(data: torch.Tensor, block: int) -> torch.Tensor:
    """Inverse of `pair_fp4`: paired packing -> natural packing. data: uint8 [..., K/2]."""
    chunks = data.reshape(*data.shape[:-1], -1, block)                             # [..., K/2B, B]
    codes = torch.stack((chunks & 0xF, chunks >> 4), dim=-2)                       # [..., K/2B, 2, B]
    return _natural(codes.reshape(*data.shape[:-1], -1))


def oct_fp4(data: torch.Tensor, block: int) -> torch.Tensor:
    """Natural packing -> "oct" packing: in each chunk of 8 scale blocks, 32-bit word q
    (little endian) holds element i*block + q in nibble i (bits 4i..4i+3), i = 0..7.
    data: uint8 [..., K/2] -> uint8 [..., K/2] (view as int32 for the kernel)."""
    codes = _codes(data).reshape(*data.shape[:-1], -1, 8, block)                   # [..., K/8B, i, q]
    words = codes.transpose(-1, -2)                                                # [..., K/8B, q, i]
    return (words[..., 0::2] | (words[..., 1::2] << 4)).reshape(data.shape)         # byte k = nibbles 2k, 2k+1


def unoct_fp4(data: torch.Tensor, block: int) -> torch.Tensor:
    """Inverse of `oct_fp4`."""
    b = data.reshape(*data.shape[:-1], -1, block, 4)                               # [..., K/8B, q, byte]
    words = torch.stack((b & 0xF, b >> 4), dim=-1).reshape(*b.shape[:-1], 8)       # [..., K/8B, q, i]
    return _natural(words.transpose(-1, -2).reshape(*data.shape[:-1], -1))


# "octb": the W4A16 kernel's bf16-rotation layout (mode "bf16rot"). A packing unit is 8 scale
# blocks, as in "oct", but 32-bit word q = 2p + h holds the k-adjacent pair (2p, 2p + 1) of the
# four blocks 4h .. 4h + 3, so that one word expands into four bf16 pairs. OCTB_POS[j][half] gives
# the bits of block 4h + j, element 2p + half, for its code bits (m, e0, e1, sign). Blocks 0-2 sit
# where one rotation by 6 / 2 / 28 moves them onto the bf16 pattern (magnitude at bits 6-8, sign
# at bit 15, and +16 for the pair's second element); block 3 has e0, e1 and sign there already and
# its m a rotation by 8 away. The pattern: 9 instructions per 8 elements (the "oct" expansion: 14).
OCTB_POS = (((0, 1, 2, 9), (16, 17, 18, 25)),
            ((4, 5, 6, 13), (20, 21, 22, 29)),
            ((10, 11, 12, 19), (26, 27, 28, 3)),
            ((30, 7, 8, 15), (14, 23, 24, 31)))


def octb_fp4(data: torch.Tensor, block: int) -> torch.Tensor:
    """Natural packing -> "octb" packing (see OCTB_POS). data: uint8 [..., K/2] -> uint8 [..., K/2]
    (view as int32 for the kernel); K a multiple of 8 blocks."""
    lead = data.shape[:-1]
    codes = _codes(data).to(torch.int64).reshape(*lead, -1, 2, 4, block // 2, 2)   # [..., unit, h, j, p, half]
    words = torch.zeros(*lead, codes.shape[-5], block // 2, 2, dtype=torch.int64, device=data.device)  # [.., p, h]
    for j in range(4):
        for half in range(2):
            c = codes[..., :, j, :, half].transpose(-1, -2)                            # [..., unit, p, h]
            for bit, pos in enumerate(OCTB_POS[j][half]):
                words |= ((c >> bit) & 1) << pos
    words = words.reshape(*lead, -1)                                                    # word q = 2p + h
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return words.view(torch.uint8).reshape(data.shape)


def unoctb_fp4(data: torch.Tensor, block: int) -> torch.Tensor:
    """Inverse of `octb_fp4`."""
    lead = data.shape[:-1]
    words = data.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    words = words.reshape(*lead, -1, block // 2, 2)                                    # [..., unit, p, h]
    codes = torch.zeros(*lead, words.shape[-3], 2, 4, block // 2, 2, dtype=torch.int64, device=data.device)
    for j in range(4):
        for half in range(2):
            c = torch.zeros_like(words)
            for bit, pos in enumerate(OCTB_POS[j][half]):
                c |= ((words >> pos) & 1) << bit
            codes[..., :, j, :, half] = c.transpose(-1, -2)
    return _natural(codes.reshape(*lead, -1).to(torch.uint8))


def unit_bytes(packing: str, block: int) -> int:
    """Bytes of one row in one packing unit."""
    return {"natural": block // 2, "paired": block, "oct": 4 * block, "octb": 4 * block}[packing]


def tile_fp4(data: torch.Tensor, tile_n: int, unit: int) -> torch.Tensor:
    """[E, N, Kb] bytes, rows in order -> rows in tiles of tile_n, each (tile, unit) block contiguous."""
    E, N, Kb = data.shape
    if N % tile_n or Kb % unit:
        raise ValueError(f"tiling needs N ({N}) divisible by tile_n ({tile_n}) and K/2 ({Kb}) by {unit}")
    return data.view(E, N // tile_n, tile_n, Kb // unit, unit).permute(0, 1, 3, 2, 4).contiguous().view(E, N, Kb)


def untile_fp4(data: torch.Tensor, tile_n: int, unit: int) -> torch.Tensor:
    E, N, Kb = data.shape
    return data.view(E, N // tile_n, Kb // unit, tile_n, unit).permute(0, 1, 3, 2, 4).contiguous().view(E, N, Kb)


def natural_data(w: PreparedWeight) -> torch.Tensor:
    """The FP4 bytes of `w` in checkpoint order (rows in order, natural nibbles)."""
    data = untile_fp4(w.data, w.tile_n, unit_bytes(w.packing, w.block)) if w.tile_n else w.data
    return _FROM[w.packing](data, w.block)


_TO = {"natural": lambda d, b: d, "paired": pair_fp4, "oct": oct_fp4, "octb": octb_fp4}
_FROM = {"natural": lambda d, b: d, "paired": unpair_fp4, "oct": unoct_fp4, "octb": unoctb_fp4}
CHUNK_BLOCKS = {"natural": 1, "paired": 2, "oct": 8, "octb": 8}   # scale blocks per packing unit along K


def _split_rows(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """Rows (dim 1) from interleaved gate/up order (g0 u0 g1 u1 ...) to split (g0 g1 ... u0 u1 ...)."""
    if t is None:
        return None
    order = torch.cat((torch.arange(0, n, 2), torch.arange(1, n, 2))).to(t.device)
    return t.index_select(1, order).contiguous()


# ---- W4A8 fold plan -----------------------------------------------------------------------------

@dataclass(frozen=True)
class FoldPlan:
    """MXFP4 -> exact FP8 (W4A8) plan of one weight.

    e_ref: int32 [E, N], the row's reference exponent (max block exponent - 6, >= -126);
        row n is stored as E4M3 v * 2^(e_block - e_ref) with fp32 scale 2^e_ref.
    rowwise_exact / group_exact: every nonzero block is within FOLD_SPREAD exponents of the
        row's (resp. its 1x128 group's) largest, so the fold loses nothing.
    """

    e_ref: torch.Tensor
    rowwise_exact: bool
    group_exact: bool


def fold_plan(w: PreparedWeight) -> FoldPlan:
    """The W4A8 fold plan of an mxfp4 weight (computed once, cached on `w`; syncs once)."""
    if w.fmt != "mxfp4":
        raise ValueError(f"an exact FP8 fold needs mxfp4 (power-of-two scales), got {w.fmt!r}")
    if "fold_plan" not in w.cache:
        data = natural_data(w)
        e = torch.where(w.scale == 255, -127, w.scale.to(torch.int32) - 127)       # [E, N, B]
        codes = torch.stack((data & 0x7, (data >> 4) & 0x7), dim=-1)               # magnitudes only
        blk_nz = (codes.reshape(*data.shape[:-1], -1, 32) != 0).any(-1)            # [E, N, B]
        e_row_max = e.amax(-1)                                                      # [E, N]
        row_ok = ((e_row_max.unsqueeze(-1) - e) <= FOLD_SPREAD) | ~blk_nz
        nb = e.shape[-1]
        eg = torch.nn.functional.pad(e, (0, -nb % 4), value=-127).reshape(*e.shape[:-1], -1, 4)
        g_max = eg.amax(-1).repeat_interleave(4, dim=-1)[..., :nb]
        grp_ok = ((g_max - e) <= FOLD_SPREAD) | ~blk_nz
        e_ref = (e_row_max - 6).clamp(min=-126).to(torch.int32).contiguous()
        w.cache["fold_plan"] = FoldPlan(e_ref, bool(row_ok.all()), bool(grp_ok.all()))
    return w.cache["fold_plan"]


# ---- preparation ------------------------------------------------------------------------------

def packing_for(fmt: str, act_dtype: torch.dtype, cuda: bool) -> str | None:
    """The FP4 packing a quantized expert weight is prepared in. CPU: checkpoint order ("natural",
    nothing to repack for the reference path). CUDA: "octb" for MXFP4 under bf16 activations, whose
    decode kernel (W4A16 mode bf16rot_ps) is about 1.10-1.24x the oct one (bench/gemm-notes.md, rounds 7
    and 8);
    else None, the kernels' default ("oct"; prepare_weights falls back where K does not divide)."""
    if not cuda:
        return "natural"
    return "octb" if fmt == "mxfp4" and act_dtype == torch.bfloat16 else None


def prepare_weights(w: torch.Tensor | QuantizedTensor | PreparedWeight | dict[str, torch.Tensor], *,
                    fmt: str | None = None, packing: Packing = "oct", gate_up: GateUp | None = None,
                    device: torch.device | str | None = None, dtype: torch.dtype = torch.bfloat16,
                    tile_n: int | None = None) -> PreparedWeight:
    """Expert weights -> PreparedWeight, once at load time.

    w: float [E, N, K]; a QuantizedTensor [E, N, K] ("mxfp4", "nvfp4", "fp8_block"); a
        checkpoint dict {"weight", "weight_scale"[, "weight_scale_2"]} (moe.quant.load_fp4_checkpoint);
        or a PreparedWeight (re-packed if `packing` differs).
    fmt: quantize a float weight to "mxfp4" / "nvfp4" / "fp8_block" first; None keeps it dense
        (cast to `dtype`).
    packing: FP4 nibble order: "oct" (default: 8 nibbles of one 32-bit word = 8 scale blocks,
        what the fused W4A16 kernel's inline-PTX expansion reads), "octb" (the same unit with the
        nibbles in bf16 pair order, `OCTB_POS`: what W4A16 mode bf16rot reads; the MoE layer's
        choice for MXFP4 under bf16 activations, `packing_for`), "paired" (K only divisible by
        two blocks) or "natural" (checkpoint order). A K that the unit does not divide falls
        back to "paired", then "natural".
    gate_up: for a W13 weight, "interleaved" reorders its rows to "split"; "split" records it.
    tile_n: FP4 row tiling (PreparedWeight.tile_n); None = DEFAULT_TILE_N where it divides N
        (and, for W13, I), else rows in order.
    """
    if packing not in _TO:
        raise ValueError(f"packing must be one of {list(_TO)}, got {packing!r}")
    if gate_up not in (None, "split", "interleaved"):
        raise ValueError(f"gate_up must be 'split', 'interleaved' or None, got {gate_up!r}")
    if isinstance(w, PreparedWeight):
        if gate_up == "interleaved" and w.gate_up != "split":
            raise ValueError("an already prepared weight cannot be re-ordered; prepare from the raw weight")
        out = w.to(device) if device is not None else w
        return repack(out, packing)
    if isinstance(w, dict):
        missing = {"weight", "weight_scale"} - set(w)
        if missing:
            raise ValueError(f"checkpoint dict needs keys 'weight', 'weight_scale' (+ 'weight_scale_2' for nvfp4); "
                             f"missing {sorted(missing)}")
        w = load_fp4_checkpoint(w["weight"], w["weight_scale"], w.get("weight_scale_2"))
    if device is not None:
        w = w.to(device)
    if isinstance(w, torch.Tensor):
        if w.dim() != 3 or not w.is_floating_point():
            raise ValueError(f"expert weight must be a float tensor [E, N, K], got {w.dtype}{tuple(w.shape)}")
        if fmt is None:
            if dtype not in DENSE_DTYPES:
                raise ValueError(f"dense dtype must be one of {list(DENSE_DTYPES)}, got {dtype}")
            data = w.to(dtype).contiguous()
            if gate_up == "interleaved":
                data = _split_rows(data, data.shape[1])
            return PreparedWeight(fmt=DENSE_DTYPES[dtype], shape=tuple(data.shape), data=data,
                                  gate_up="split" if gate_up else None)
        if fmt not in ("mxfp4", "nvfp4", "fp8_block"):
            raise ValueError(f"fmt must be 'mxfp4', 'nvfp4', 'fp8_block' or None, got {fmt!r}")
        opts = {"global_scale": "matrix"} if fmt == "nvfp4" else {}
        w = quantize(w.contiguous(), fmt, **opts)
    if not isinstance(w, QuantizedTensor):
        raise ValueError(f"cannot prepare a {type(w).__name__}; valid: tensor, QuantizedTensor, checkpoint dict")
    out = _from_quantized(w, packing=packing, gate_up=gate_up)
    if out.is_fp4:
        want = DEFAULT_TILE_N if tile_n is None else tile_n
        n_unit = out.n // 2 if out.gate_up else out.n          # W13: the up half starts on a tile boundary
        if want and n_unit % want == 0 and out.packing != "natural":
            out = repack(out, out.packing, tile_n=want)
        elif tile_n:
            raise ValueError(f"tile_n={tile_n} must divide the rows ({out.n}{', per half' if out.gate_up else ''})")
    if out.fmt == "mxfp4":
        fold_plan(out)   # plan the exact W4A8 fold now, at load time
    return out


def _check_storage(q: QuantizedTensor) -> None:
    """ValueError unless q's tensors are what its format stores for its shape (parallel.quant's
    `expected_storage`): FP4 data and scale as uint8 bits (torch's fp4 / e8m0 / e4m3 views are
    taken as such by QuantizedTensor), fp8_block data in float8_e4m3fn with float scales, and an
    nvfp4 global scale of one element or one per expert. The kernels read these tensors by their
    format's strides, so a scale of another shape or dtype would be read wrongly, not refused."""
    E = q.shape[0]
    data_shape, scale_shape = expected_storage(q.fmt, q.shape)
    fp4 = q.fmt in FP4_BLOCK
    data_ok = q.data.dtype == (torch.uint8 if fp4 else torch.float8_e4m3fn)
    scale_ok = q.scale.dtype == torch.uint8 if fp4 else q.scale.is_floating_point()
    want_data = "uint8" if fp4 else "float8_e4m3fn"
    want_scale = {"mxfp4": "uint8 E8M0 bytes ", "nvfp4": "uint8 E4M3 bytes "}.get(q.fmt, "float ")
    if tuple(q.data.shape) != data_shape or not data_ok:
        raise ValueError(f"{q.fmt} expert weight {tuple(q.shape)} needs data {want_data} {data_shape}, "
                         f"got {q.data.dtype} {tuple(q.data.shape)}")
    if tuple(q.scale.shape) != scale_shape or not scale_ok:
        raise ValueError(f"{q.fmt} expert weight {tuple(q.shape)} needs scale {want_scale}{scale_shape}, "
                         f"got {q.scale.dtype} {tuple(q.scale.shape)}")
    if q.fmt == "nvfp4":
        gs = q.global_scale
        if gs is None or not gs.is_floating_point() or gs.numel() not in (1, E):
            got = None if gs is None else f"{gs.dtype} {tuple(gs.shape)}"
            raise ValueError(f"nvfp4 expert weight {tuple(q.shape)} needs a float global_scale of one element or "
                             f"one per expert [E={E}], got {got}")


def _from_quantized(q: QuantizedTensor, *, packing: Packing, gate_up: GateUp | None) -> PreparedWeight:
    if len(q.shape) != 3:
        raise ValueError(f"expert weight must be [E, N, K], got shape {tuple(q.shape)}")
    if q.fmt in FP4_BLOCK or q.fmt == "fp8_block":
        _check_storage(q)
    E, N, K = q.shape
    if gate_up == "interleaved" and N % 2:
        raise ValueError(f"interleaved gate/up needs an even number of rows, got N={N}")
    split = gate_up == "interleaved"
    if q.fmt in FP4_BLOCK:
        block = FP4_BLOCK[q.fmt]
        for fallback in (packing, "paired", "natural"):   # the widest unit that divides K
            if K % (CHUNK_BLOCKS[fallback] * block) == 0:
                packing = fallback
                break
        data, scale = q.data.contiguous(), q.scale.contiguous()
        if split:
            data, scale = _split_rows(data, N), _split_rows(scale, N)
        gs = None
        if q.fmt == "nvfp4":
            gs = q.global_scale.float()
            gs = gs.expand(E).contiguous() if gs.dim() == 0 else gs.reshape(E).contiguous()
        data = _TO[packing](data, block)
        return PreparedWeight(fmt=q.fmt, shape=(E, N, K), data=data, scale=scale, global_scale=gs,
                              packing=packing, gate_up="split" if gate_up else None)
    if q.fmt == "fp8_block":
        scale = q.scale.float().repeat_interleave(128, dim=-2)[:, :N].contiguous()   # [E, N, ceil(K/128)]
        data = q.data.contiguous()
        if split:
            data, scale = _split_rows(data, N), _split_rows(scale, N)
        return PreparedWeight(fmt="fp8", shape=(E, N, K), data=data, scale=scale,
                              gate_up="split" if gate_up else None)
    raise ValueError(f"expert weights in {q.fmt!r} are not supported; valid: mxfp4, nvfp4, fp8_block")


def repack(w: PreparedWeight, packing: Packing, tile_n: int | None = None) -> PreparedWeight:
    """The same weight with FP4 nibbles in `packing` order and rows tiled by `tile_n` (None: keep
    the current tiling; 0: rows in order). Dense/fp8 weights are returned as is."""
    if not w.is_fp4:
        return w
    tile_n = w.tile_n if tile_n is None else tile_n
    if w.packing == packing and w.tile_n == tile_n:
        return w
    if packing not in _TO:
        raise ValueError(f"packing must be one of {list(_TO)}, got {packing!r}")
    if w.k % (CHUNK_BLOCKS[packing] * w.block):
        raise ValueError(f"{packing!r} packing needs K ({w.k}) divisible by {CHUNK_BLOCKS[packing] * w.block}")
    data = _TO[packing](natural_data(w), w.block)
    if tile_n:
        data = tile_fp4(data, tile_n, unit_bytes(packing, w.block))
    keep = {"fold_plan": w.cache["fold_plan"]} if "fold_plan" in w.cache else {}
    return replace(w, data=data, packing=packing, tile_n=tile_n, cache=keep)


def as_prepared(w: torch.Tensor | QuantizedTensor | PreparedWeight) -> PreparedWeight:
    """Wrap what grouped_gemm was given, without copying where possible (natural packing)."""
    if isinstance(w, PreparedWeight):
        return w
    if isinstance(w, torch.Tensor):
        if w.dim() != 3 or not w.is_floating_point():
            raise ValueError(f"expert weight must be a float tensor [E, N, K], got {w.dtype}{tuple(w.shape)}")
        if w.dtype not in DENSE_DTYPES:
            w = w.float()
        return PreparedWeight(fmt=DENSE_DTYPES[w.dtype], shape=tuple(w.shape), data=w)
    if isinstance(w, QuantizedTensor):
        return _from_quantized(w, packing="natural", gate_up=None)
    raise ValueError(f"expert weight must be a tensor, QuantizedTensor or PreparedWeight, got {type(w).__name__}")


def to_quantized(w: PreparedWeight) -> QuantizedTensor:
    """A quantized PreparedWeight as a moe.quant QuantizedTensor (natural packing, fp8 as fp8_group
    with one scale per row and 128 along K)."""
    if w.is_fp4:
        data = natural_data(w)
        return QuantizedTensor(data, w.scale, w.fmt, torch.Size(w.shape), w.global_scale)
    if w.fmt == "fp8":
        return QuantizedTensor(w.data, w.scale, "fp8_group", torch.Size(w.shape))
    raise ValueError(f"to_quantized needs a quantized weight, got fmt {w.fmt!r}")


def dequantize_prepared(w: PreparedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight's values as a dense [E, N, K] tensor (fp32 math, one rounding to `dtype`)."""
    if w.fmt in ("bf16", "fp16", "fp32"):
        return w.data.to(dtype)
    return dequantize(to_quantized(w), dtype)
