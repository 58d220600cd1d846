"""Low-precision weight/activation formats: names, the container, and FP4 bit helpers.

One idea: a `QuantizedTensor` is plain storage (`data`, `scale`, optional `global_scale`) plus
the format name and the logical shape; what the bits mean is fixed by the format (docs/numerics.md):

| fmt         | data                              | scale                                   | block        |
|-------------|-----------------------------------|-----------------------------------------|--------------|
| "mxfp4"     | uint8 [..., K/2], 2 E2M1 per byte | uint8 E8M0 [..., K/32] (2^(byte-127))   | 1x32         |
| "nvfp4"     | uint8 [..., K/2]                  | uint8 FP8-E4M3 bits [..., K/16]         | 1x16 (+ fp32 tensor scale) |
| "fp8_block" | float8_e4m3fn [..., N, K]         | fp32 [..., ceil(N/128), ceil(K/128)]    | 128x128      |
| "fp8_token" | float8_e4m3fn [..., K]            | fp32 [..., 1]                           | 1xK          |
| "fp8_group" | float8_e4m3fn [..., K]            | fp32 [..., ceil(K/128)]                 | 1x128        |

Packing: element 2i sits in the LOW nibble, 2i+1 in the HIGH nibble (as torch.float4_e2m1fn_x2,
Triton dot_scaled and DeepGEMM). An E2M1 code is sign<<3 | magnitude index, magnitudes
{0, 0.5, 1, 1.5, 2, 3, 4, 6}. FP4 formats need K divisible by their block (ValueError
otherwise); FP8 formats accept a partial last block (its scale covers the elements present).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass(frozen=True)
class FormatInfo:
    """Static description of one format."""

    name: str
    block: tuple[int, int]  # (rows, cols) covered by one scale; cols along K; 0 = whole row
    bits: int               # bits per element of data
    scale_kind: str         # "e8m0", "e4m3+fp32", "fp32"
    description: str


FORMATS: dict[str, FormatInfo] = {
    "mxfp4": FormatInfo("mxfp4", (1, 32), 4, "e8m0", "OCP MXFP4: E2M1 values, one E8M0 scale per 32 along K"),
    "nvfp4": FormatInfo("nvfp4", (1, 16), 4, "e4m3+fp32", "NVFP4: E2M1 values, E4M3 scale per 16, fp32 tensor scale"),
    "fp8_block": FormatInfo("fp8_block", (128, 128), 8, "fp32", "FP8 E4M3 weights, fp32 scale per 128x128 tile"),
    "fp8_token": FormatInfo("fp8_token", (1, 0), 8, "fp32", "FP8 E4M3 activations, fp32 scale per row"),
    "fp8_group": FormatInfo("fp8_group", (1, 128), 8, "fp32", "FP8 E4M3 activations, fp32 scale per 1x128 along K"),
}

FP4_FORMATS = ("mxfp4", "nvfp4")
FP8_FORMATS = ("fp8_block", "fp8_token", "fp8_group")


def get_format(fmt: str) -> FormatInfo:
    """The `FormatInfo` of `fmt`; ValueError naming the valid formats otherwise."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; valid formats: {', '.join(FORMATS)}")
    return FORMATS[fmt]


def check_quantizable(x: torch.Tensor, fmt: str) -> FormatInfo:
    """Validate that `x` can be quantized to `fmt`; return the format's info."""
    info = get_format(fmt)
    if not x.is_floating_point():
        raise ValueError(f"quantize({fmt!r}) needs a floating-point tensor, got {x.dtype}")
    min_dims = 2 if fmt == "fp8_block" else 1
    if x.dim() < min_dims:
        raise ValueError(f"quantize({fmt!r}) needs a tensor with >= {min_dims} dims, got shape {tuple(x.shape)}")
    if fmt == "fp8_token" and x.shape[-1] == 0:  # a per-row scale of an empty row is undefined
        raise ValueError(f"fp8_token needs the last dim K >= 1 (one fp32 scale per row of K values), "
                         f"got shape {tuple(x.shape)}")
    if fmt in FP4_FORMATS:
        k, blk = x.shape[-1], info.block[1]
        if k % blk:
            valid = f"{(k // blk) * blk} or {(k // blk + 1) * blk}" if k > blk else f"{blk}"
            raise ValueError(f"{fmt} needs the last dim K ({k}) divisible by its block size {blk}; "
                             f"pad K to a multiple of {blk} (e.g. {valid})")
    return info


@dataclass
class QuantizedTensor:
    """A quantized tensor: storage plus the format and the logical (unpacked) shape.

    data: fp4 formats: [..., K/2] uint8 (low nibble = even element); fp8: same shape as the
        logical tensor, float8_e4m3fn.
    scale: per-block scales, layout per format (module docstring).
    fmt: one of FORMATS.
    shape: logical shape of the original tensor.
    global_scale: nvfp4 only: fp32 0-d tensor (or one per matrix, shape[:-2], e.g. [E] for
        stacked experts); dequant multiplies by it.
    """

    data: torch.Tensor
    scale: torch.Tensor
    fmt: str
    shape: torch.Size
    global_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        get_format(self.fmt)
        self.shape = torch.Size(self.shape)
        # torch's own fp4 / e8m0 / e4m3 dtypes are accepted as views of the uint8 storage; only
        # the scale dtype of the format itself (e8m0 for mxfp4, e4m3 for nvfp4): the other one
        # keeps its dtype, so that check_storage refuses it instead of reading its bits wrongly
        if self.fmt in FP4_FORMATS:
            if self.data.dtype == getattr(torch, "float4_e2m1fn_x2", None):
                self.data = self.data.view(torch.uint8)
            own = getattr(torch, "float8_e8m0fnu", None) if self.fmt == "mxfp4" else torch.float8_e4m3fn
            if own is not None and self.scale.dtype == own:
                self.scale = self.scale.view(torch.uint8)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Bytes of storage (data + scales + global scale)."""
        total = self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()
        if self.global_scale is not None:
            total += self.global_scale.numel() * self.global_scale.element_size()
        return total

    def to(self, device: torch.device | str, non_blocking: bool = False) -> QuantizedTensor:
        """The same tensor on `device`."""
        gs = self.global_scale.to(device, non_blocking=non_blocking) if self.global_scale is not None else None
        return replace(self, data=self.data.to(device, non_blocking=non_blocking),
                       scale=self.scale.to(device, non_blocking=non_blocking), global_scale=gs)

    def dequantize(self, dtype: torch.dtype = torch.float32, *, backend: str = "auto") -> torch.Tensor:
        from megapar.parallel.quant import dequantize
        return dequantize(self, dtype, backend=backend)

    def data_as_fp4x2(self) -> torch.Tensor:
        """data viewed as torch.float4_e2m1fn_x2 (fp4 formats; same bytes)."""
        if self.fmt not in FP4_FORMATS:
            raise ValueError(f"data_as_fp4x2 needs an fp4 format ({', '.join(FP4_FORMATS)}), got {self.fmt!r}")
        return self.data.view(_dtype("float4_e2m1fn_x2"))

    def scale_as_e8m0(self) -> torch.Tensor:
        """mxfp4 scale viewed as torch.float8_e8m0fnu (same bytes)."""
        if self.fmt != "mxfp4":
            raise ValueError(f"scale_as_e8m0 needs fmt 'mxfp4', got {self.fmt!r}")
        return self.scale.view(_dtype("float8_e8m0fnu"))

    def scale_as_e4m3(self) -> torch.Tensor:
        """nvfp4 block scale viewed as torch.float8_e4m3fn (same bytes)."""
        if self.fmt != "nvfp4":
            raise ValueError(f"scale_as_e4m3 needs fmt 'nvfp4', got {self.fmt!r}")
        return self.scale.view(torch.float8_e4m3fn)

    def __repr__(self) -> str:
        gs = self.global_scale
        gs = "" if gs is None else (f", global_scale={float(gs):.6g}" if gs.numel() == 1
                                    else f", global_scale=fp32{tuple(gs.shape)}")
        return (f"QuantizedTensor(fmt={self.fmt!r}, shape={tuple(self.shape)}, data={self.data.dtype}"
                f"{tuple(self.data.shape)}, scale={self.scale.dtype}{tuple(self.scale.shape)}{gs}, "
                f"device={self.device})")


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if dt is None:
        raise ValueError(f"this torch ({torch.__version__}) has no torch.{name}; use the uint8 storage instead")
    return dt


# ---- E2M1 bit helpers (shared by the reference, the checkpoint loader and the GEMM kernels) ----

_E2M1_TABLE = torch.tensor([*E2M1_MAGNITUDES, *(-m for m in E2M1_MAGNITUDES)], dtype=torch.float32)


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 in [0, 16), sign<<3 | index; code 8 is -0.0) -> fp32 of the same shape."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"e2m1_to_float needs uint8 codes, got {codes.dtype}")
    table = _E2M1_TABLE.to(codes.device)
    return table[(codes & 0xF).long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """codes: [..., K] uint8 E2M1 codes, K even -> [..., K/2] uint8, element 2i in the low nibble."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"pack_fp4 needs uint8 codes, got {codes.dtype}")
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dim, got {codes.shape[-1]}")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] & 0xF) | ((pairs[..., 1] & 0xF) << 4)


def unpack_fp4(data: torch.Tensor) -> torch.Tensor:
    """data: [..., K/2] uint8 (or float4_e2m1fn_x2) -> [..., K] uint8 codes (low nibble first)."""
    if data.dtype != torch.uint8:
        if data.dtype == getattr(torch, "float4_e2m1fn_x2", None):
            data = data.view(torch.uint8)
        else:
            raise ValueError(f"unpack_fp4 needs uint8 (or float4_e2m1fn_x2) data, got {data.dtype}")
    return torch.stack((data & 0xF, data >> 4), dim=-1).reshape(*data.shape[:-1], 2 * data.shape[-1])
