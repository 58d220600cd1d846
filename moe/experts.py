"""This rank's routed experts (`Experts`) and the shared expert (`SharedExpert`).

`Experts` holds S local expert slots (S = num_experts / EP size, or the EPLB slots of this
rank) as two stacked weights, in one of EXPERT_FORMATS:

    w13: [S, 2I, H]  gate (W1) and up (W3) rows, "split" (W1 then W3) or "interleaved"
    w2:  [S, H, I]

"bf16"/"fp32" keep them as trainable `nn.Parameter`s (gradients flow); "fp8_block",
"mxfp4" and "nvfp4" keep `QuantizedTensor` storage as buffers (data, scale, global scale;
nvfp4 with one global scale per expert matrix). `forward(x, counts)` runs the fused expert
FFN of `moe.kernels` (docs/numerics.md §3) on rows grouped by slot:

    h = act(x @ W1^T, x @ W3^T);  y = h @ W2^T
    act(g, u) = g' * sigmoid(alpha * g') * (u' + beta),  g' = min(g, L),  u' = clamp(u, -L, L)

Construction (`init=`): "random" (default) draws normal weights and quantizes them on the
target device, one expert at a time (peak memory: the storage plus one expert's temporaries);
"empty" allocates the storage only (values undefined until loaded); "meta" allocates nothing
(tensors on the meta device) and loading materializes the storage on `device`.

Loading (`load_deepseek`) reads DeepSeek checkpoint names relative to the MoE module,
`experts.{e}.w1/w2/w3.weight`, keeping only the slots' experts: bf16/fp32 tensors (quantized
here when the format asks), pre-quantized FP4 tensors (`weight` packed uint8 + `weight_scale`
or `scale` [+ `weight_scale_2` for NVFP4]) or DeepSeek-V3 FP8 (`weight` e4m3 +
`weight_scale_inv` 128x128). A pre-quantized tensor in another format than the module's is
converted by `moe.quant.prepare_weight`. The state may be a lazy mapping (`moe.loading`): only
the slots' keys are read, one expert at a time, each written into its slot of the storage on
the storage's device (quantized there), so host memory holds one expert at a time.
"""

from __future__ import annotations

import numbers
from typing import Any, Literal, Mapping, Sequence

import torch
from torch import nn

from megapar.parallel import impl

from megapar.moe.kernels import PreparedWeight, expert_ffn, packing_for, prepare_weights, swiglu
from megapar.moe.kernels.ffn import ffn_backend
from megapar.moe.quant import QuantizedTensor, dequantize, load_fp4_checkpoint, prepare_weight, quantize
from megapar.parallel.quant import e8m0_to_float
from megapar.parallel.quant.formats import FP4_FORMATS
from megapar.parallel.quant.reference import check_storage, expected_storage

EXPERT_FORMATS: tuple[str, ...] = ("bf16", "fp32", "fp8_block", "mxfp4", "nvfp4")
GATE_UP_LAYOUTS: tuple[str, ...] = ("split", "interleaved")
INITS: tuple[str, ...] = ("random", "empty", "meta")
_DENSE = {"bf16": torch.bfloat16, "fp32": torch.float32}
_QUANT_OPTS = {"nvfp4": {"global_scale": "matrix"}}


def _first(state: Mapping[str, torch.Tensor], keys: Sequence[str]) -> torch.Tensor | None:
    """The first of `keys` present in state (a lazy state reads only that one), else None."""
    for k in keys:
        if k in state:
            return state[k]
    return None


_STORED_SUFFIXES = ("weight", "weight_scale_inv", "weight_scale", "scale", "weight_scale_2")
"""what `read_weight` may read of one weight: the tensor and its scales' names"""


def read_weight(state: Mapping[str, torch.Tensor], key: str) -> torch.Tensor | QuantizedTensor:
    """`{key}.weight` with its scales as stored in a checkpoint: a float tensor (bf16/fp16/fp32), an
    fp8_block QuantizedTensor (e4m3 + `weight_scale_inv` / `weight_scale` / `scale`, 128x128 tiles;
    a float scale, or E8M0 as float8_e8m0fnu or uint8 bytes)
    or an FP4 one (packed + `weight_scale` / `scale` [+ `weight_scale_2`]). KeyError if missing."""
    weight = state[f"{key}.weight"]
    if weight.is_floating_point() and weight.element_size() >= 2:
        return weight
    if weight.dtype == torch.float8_e4m3fn:
        scale = _first(state, [f"{key}.weight_scale_inv", f"{key}.weight_scale", f"{key}.scale"])
        if scale is None:
            raise KeyError(f"{key}.weight_scale_inv")
        # a uint8 scale holds E8M0 bytes (2^(byte - 127), as transformers reads one), not multipliers
        scale = e8m0_to_float(scale) if scale.dtype == torch.uint8 else scale.float()
        q = QuantizedTensor(weight, scale, "fp8_block", weight.shape)
        try:
            check_storage(q)     # (a scale of other tiles would be read as 128 x 128 ones: refused here)
        except ValueError as exc:
            raise ValueError(f"{key}.weight: {exc}") from None
        return q
    scale = _first(state, [f"{key}.weight_scale", f"{key}.scale"])
    if scale is None:
        raise KeyError(f"{key}.weight_scale")
    return load_fp4_checkpoint(weight, scale, _first(state, [f"{key}.weight_scale_2"]))


def read_dense(state: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    """`{key}.weight` as a float tensor (a quantized checkpoint tensor is dequantized, fp32)."""
    w = read_weight(state, key)
    return dequantize(w, torch.float32) if isinstance(w, QuantizedTensor) else w


def fuse_gate_up(w1: torch.Tensor, w3: torch.Tensor, layout: str) -> torch.Tensor:
    """w1, w3: [..., I, H] -> w13 [..., 2I, H] in `layout` (works for packed rows too)."""
    if layout == "split":
        return torch.cat([w1, w3], dim=-2)
    return torch.stack([w1, w3], dim=-2).reshape(*w1.shape[:-2], 2 * w1.shape[-2], w1.shape[-1])


def _fuse_quantized(q1: QuantizedTensor, q3: QuantizedTensor, layout: str) -> QuantizedTensor:
    """Quantized w1, w3 [I, H] -> w13 [2I, H]. NVFP4 halves with different tensor scales share the
    larger one; the other half's E4M3 block scales are rescaled (rounded once more)."""
    shape = torch.Size((2 * q1.shape[0], q1.shape[1]))
    if q1.fmt == "fp8_block":
        if layout != "split" or q1.shape[0] % 128:
            raise ValueError(f"fp8_block w1/w3 ({q1.shape[0]} rows) fuse only with gate_up='split' and a row "
                             "count that is a multiple of 128 (the scale tiles); load them as bf16 instead")
        return QuantizedTensor(torch.cat([q1.data, q3.data]), torch.cat([q1.scale, q3.scale]), q1.fmt, shape)
    s1, s3, gs = q1.scale, q3.scale, None
    if q1.fmt == "nvfp4":
        g1, g3 = q1.global_scale.float().reshape(()), q3.global_scale.float().reshape(())
        gs = torch.maximum(g1, g3)
        if not torch.equal(g1, g3):
            s1 = (s1.view(torch.float8_e4m3fn).float() * (g1 / gs)).to(torch.float8_e4m3fn).view(torch.uint8)
            s3 = (s3.view(torch.float8_e4m3fn).float() * (g3 / gs)).to(torch.float8_e4m3fn).view(torch.uint8)
    return QuantizedTensor(fuse_gate_up(q1.data, q3.data, layout), fuse_gate_up(s1, s3, layout), q1.fmt, shape, gs)


class Experts(nn.Module):
    """S routed expert slots of one MoE layer on this rank (see module docstring)."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        inter: int,
        *,
        fmt: str = "bf16",
        local_experts: Sequence[int] | None = None,
        swiglu_limit: float | None = None,
        alpha: float = 1.0,
        beta: float = 0.0,
        gate_up: Literal["split", "interleaved"] = "split",
        device: torch.device | str | None = None,
        backend: str = "auto",
        init_std: float = 0.02,
        init: Literal["random", "empty", "meta"] = "random",
        resident_fp8: bool = False,
    ) -> None:
        """num_experts: logical experts of the layer; local_experts: the logical expert of each
        local slot (default: all of them); backend: `moe.kernels.expert_ffn` backend. init: see
        the module docstring ("random": normal with `init_std`, made on `device`). Activations
        may be any float dtype. resident_fp8 (mxfp4 on CUDA): keep the weights' exact FP8 form
        resident beside the FP4 ones (`PreparedWeight.keep_fp8`: 2x the FP4 bytes more), so the
        W4A8 prefill path does not expand them on every call."""
        super().__init__()
        for name, value in (("num_experts", num_experts), ("hidden", hidden), ("inter", inter)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"Experts {name} ({value!r}) must be an int >= 1")
        if init not in INITS:
            raise ValueError(f"unknown init {init!r}; valid: {', '.join(INITS)}")
        if fmt not in EXPERT_FORMATS:
            raise ValueError(f"unknown expert format {fmt!r}; valid: {', '.join(EXPERT_FORMATS)}")
        if gate_up not in GATE_UP_LAYOUTS:
            raise ValueError(f"unknown gate_up layout {gate_up!r}; valid: {', '.join(GATE_UP_LAYOUTS)}")
        if fmt == "fp8_block" and gate_up != "split":
            raise ValueError("fp8_block experts support gate_up='split' only (128-row scale tiles)")
        local = list(range(num_experts)) if local_experts is None else [int(e) for e in local_experts]
        bad = [e for e in local if not 0 <= e < num_experts]
        if bad:
            raise ValueError(f"local_experts {bad} outside [0, num_experts={num_experts})")
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.local_experts = local
        if not isinstance(resident_fp8, bool):
            raise ValueError(f"resident_fp8 must be True or False, got {resident_fp8!r}")
        if resident_fp8 and fmt != "mxfp4":
            raise ValueError(f"resident_fp8 keeps an mxfp4 weight's exact FP8 form; fmt is {fmt!r}")
        self.fmt, self.gate_up, self.backend = fmt, gate_up, backend
        self.resident_fp8 = resident_fp8
        self.swiglu_limit, self.alpha, self.beta = swiglu_limit, alpha, beta
        self._prepared: tuple[PreparedWeight, PreparedWeight] | None = None
        self._prepared_key: tuple | None = None
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._allocate(torch.device("meta") if init == "meta" else self.device)
        if init == "random":
            with torch.no_grad():
                for slot in range(self.num_slots):  # one expert at a time: bounded temporaries
                    w13 = torch.randn(2 * inter, hidden, device=self.device) * init_std
                    w2 = torch.randn(hidden, inter, device=self.device) * init_std
                    self._write_slot(slot, w13, w2)

    # ---- storage ------------------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        return len(self.local_experts)

    @property
    def quantized(self) -> bool:
        return self.fmt not in _DENSE

    @property
    def materialized(self) -> bool:
        """False while the storage is on the meta device (init="meta", not loaded yet)."""
        return not self.slot_tensors()[0].is_meta

    def _shapes(self) -> dict[str, torch.Size]:
        s = self.num_slots
        return {"w13": torch.Size((s, 2 * self.inter, self.hidden)), "w2": torch.Size((s, self.hidden, self.inter))}

    def _allocate(self, device: torch.device) -> None:
        """Uninitialized storage of this format for every slot on `device` (meta: none)."""
        for name, shape in self._shapes().items():
            if not self.quantized:
                self.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=_DENSE[self.fmt], device=device)))
                continue
            data_shape, scale_shape = expected_storage(self.fmt, shape)
            fp4 = self.fmt in FP4_FORMATS
            self.register_buffer(f"{name}_data", torch.empty(data_shape, device=device,
                                                             dtype=torch.uint8 if fp4 else torch.float8_e4m3fn))
            self.register_buffer(f"{name}_scale", torch.empty(scale_shape, device=device,
                                                              dtype=torch.uint8 if fp4 else torch.float32))
            gs = torch.empty(shape[0], dtype=torch.float32, device=device) if self.fmt == "nvfp4" else None
            self.register_buffer(f"{name}_global_scale", gs)
            setattr(self, f"_{name}_shape", shape)

    def materialize(self, device: torch.device | str | None = None) -> None:
        """Meta storage -> uninitialized storage on `device` (default: the construction device)."""
        if not self.materialized:
            self.device = torch.device(device) if device is not None else self.device
            self._allocate(self.device)

    def _slot_value(self, name: str, w: torch.Tensor | QuantizedTensor, device: torch.device
                    ) -> torch.Tensor | QuantizedTensor:
        """One expert's w13 [2I, H] or w2 [H, I] in this module's storage format, on `device`."""
        if not self.quantized:
            w = dequantize(w.to(device), torch.float32) if isinstance(w, QuantizedTensor) else w
            return w.to(device=device, dtype=_DENSE[self.fmt])
        if isinstance(w, QuantizedTensor):
            w = self._convert(w.to(device))
        else:  # quantized here, on the storage's device (Triton on CUDA)
            w = quantize(w.to(device).float(), self.fmt, **_QUANT_OPTS.get(self.fmt, {}))
        if w.fmt != self.fmt:
            raise ValueError(f"{name} is {w.fmt}; this Experts module holds {self.fmt}")
        return w

    def _write_slot(self, slot: int, w13: torch.Tensor | QuantizedTensor, w2: torch.Tensor | QuantizedTensor) -> None:
        """Write one expert's w13 [2I, H] and w2 [H, I] (float or QuantizedTensor) into `slot`."""
        shapes = self._shapes()
        for name, w in (("w13", w13), ("w2", w2)):
            want = tuple(shapes[name][1:])
            if tuple(w.shape) != want:
                raise ValueError(f"{name} of slot {slot} has shape {tuple(w.shape)}; expected {want}")
            if not self.quantized:
                param = getattr(self, name)
                with torch.no_grad():
                    param[slot].copy_(self._slot_value(name, w, param.device))
                continue
            data = getattr(self, f"{name}_data")
            q = self._slot_value(name, w, data.device)
            data[slot].copy_(q.data.view(data.dtype))
            getattr(self, f"{name}_scale")[slot].copy_(q.scale)
            gs = getattr(self, f"{name}_global_scale")
            if gs is not None:
                gs[slot].copy_(q.global_scale.reshape(()))

    def _set_weights(self, w13: torch.Tensor | QuantizedTensor, w2: torch.Tensor | QuantizedTensor) -> None:
        """w13 [S, 2I, H], w2 [S, H, I]: float (quantized here if needed) or QuantizedTensor in self.fmt."""
        for name, w in (("w13", w13), ("w2", w2)):
            if self.quantized:
                q = w if isinstance(w, QuantizedTensor) else quantize(w.float(), self.fmt, **_QUANT_OPTS.get(self.fmt, {}))
                if q.fmt != self.fmt:
                    raise ValueError(f"{name} is {q.fmt}; this Experts module holds {self.fmt}")
                for part in ("data", "scale", "global_scale"):
                    self.register_buffer(f"{name}_{part}", getattr(q, part))
                setattr(self, f"_{name}_shape", q.shape)
                continue
            dense = w.to(_DENSE[self.fmt]).contiguous()
            current = self._parameters.get(name)
            if current is not None and current.shape == dense.shape and current.device == dense.device:
                with torch.no_grad():
                    current.copy_(dense)  # keep the Parameter object (optimizers hold it)
            else:
                self.register_parameter(name, nn.Parameter(dense))

    def weight(self, name: Literal["w13", "w2"]) -> torch.Tensor | QuantizedTensor:
        """The stacked weight: a Parameter (dense formats) or a QuantizedTensor view of the buffers."""
        if not self.quantized:
            return getattr(self, name)
        return QuantizedTensor(getattr(self, f"{name}_data"), getattr(self, f"{name}_scale"), self.fmt,
                               getattr(self, f"_{name}_shape"), getattr(self, f"{name}_global_scale"))

    def slot_tensors(self) -> list[torch.Tensor]:
        """Every per-slot tensor ([S, ...]), e.g. for EPLB weight migration."""
        if not self.quantized:
            return [self.w13.data, self.w2.data]
        out = []
        for name in ("w13", "w2"):
            for part in ("data", "scale", "global_scale"):
                t = getattr(self, f"{name}_{part}")
                if t is not None:
                    out.append(t)
        return out

    def dequantized(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [S, 2I, H], w2 [S, H, I]) as dense `dtype` (what the kernels compute with)."""
        out = []
        for name in ("w13", "w2"):
            w = self.weight(name)
            out.append(dequantize(w, dtype) if isinstance(w, QuantizedTensor) else w.detach().to(dtype))
        return out[0], out[1]

    # ---- loading ------------------------------------------------------------------------

    def check_keys(self, state: Mapping[str, torch.Tensor], prefix: str = "experts.") -> None:
        """KeyError naming the first missing `{prefix}{e}.w{1,2,3}.weight` of the slots' experts (and
        how many are missing); looks keys up only (a lazy state reads nothing)."""
        missing = [f"{prefix}{e}.{w}.weight" for e in dict.fromkeys(self.local_experts) for w in ("w1", "w3", "w2")
                   if f"{prefix}{e}.{w}.weight" not in state]
        if missing:
            more = f" (and {len(missing) - 1} more keys of this rank's experts)" if len(missing) > 1 else ""
            raise KeyError(f"missing {missing[0]}{more}")

    def check_uniform(self, state: Mapping[str, torch.Tensor], prefix: str = "experts.") -> None:
        """ValueError naming both keys when one of the slots' experts stores a tensor (weight or
        scale) of another shape than the first expert's, or has a scale it lacks (or the other way
        round). Reads stored shapes only (`moe.loading`'s lazy states read no tensor data)."""
        from megapar.moe.loading import _shape, checkpoint_key

        first: tuple[int, dict[str, tuple[int, ...] | None]] | None = None
        for e in dict.fromkeys(self.local_experts):
            sig = {f"{w}.{suffix}": (tuple(_shape(state, f"{prefix}{e}.{w}.{suffix}"))
                                     if f"{prefix}{e}.{w}.{suffix}" in state else None)
                   for w in ("w1", "w3", "w2") for suffix in _STORED_SUFFIXES}
            if first is None:
                first = (e, sig)
                continue
            e0, sig0 = first
            for name, got in sig.items():
                if got != sig0[name]:
                    show = lambda x, shape: (f"{checkpoint_key(state, f'{prefix}{x}.{name}')} "
                                             + ("absent" if shape is None else f"of shape {list(shape)}"))
                    raise ValueError(f"the experts differ: {show(e, got)}, {show(e0, sig0[name])}; every "
                                     "expert must be stored alike (nothing was written)")

    def load_deepseek(self, state: Mapping[str, torch.Tensor], prefix: str = "experts.") -> None:
        """Load the slots' experts from DeepSeek-named tensors `{prefix}{e}.w{1,2,3}.weight` (+ scales),
        one expert at a time into its slot (meta storage is materialized first). Missing experts
        raise KeyError naming the first missing key, before anything is written (or materialized);
        a checkpoint whose experts differ among themselves (a later expert's tensor of another stored
        shape, a scale one expert has and another lacks) ValueError naming both experts' keys, also
        before the first write (`check_uniform`: stored shapes only, no data read from a lazy
        state); a size that is not the module's (hidden, inter) ValueError on the first expert read,
        which every expert then shares."""
        self.check_keys(state, prefix)
        experts = list(self.local_experts)
        first = self._read_expert(state, prefix, experts[0]) if experts else None    # (the sizes checked)
        self.check_uniform(state, prefix)
        self.materialize()
        for slot, e in enumerate(experts):
            w1, w3, w2 = first if slot == 0 else self._read_expert(state, prefix, e)
            w1, w3 = self._convert(w1), self._convert(w3)
            if isinstance(w1, QuantizedTensor) and isinstance(w3, QuantizedTensor) and self.quantized:
                w13 = _fuse_quantized(w1, w3, self.gate_up)
            else:  # mixed or dense storage: fuse the values (quantized again when the format asks)
                w1, w3 = (dequantize(w, torch.float32) if isinstance(w, QuantizedTensor) else w for w in (w1, w3))
                w13 = fuse_gate_up(w1, w3, self.gate_up)
            self._write_slot(slot, w13, w2)

    def _read_expert(self, state: Mapping[str, torch.Tensor], prefix: str, e: int) -> tuple[Any, Any, Any]:
        """Expert e's (w1, w3, w2) as stored, ValueError unless their logical shapes are the module's."""
        w1 = self._read(state, f"{prefix}{e}.w1")
        w3 = self._read(state, f"{prefix}{e}.w3")
        w2 = self._read(state, f"{prefix}{e}.w2")
        for name, w, shape in (("w1", w1, (self.inter, self.hidden)), ("w3", w3, (self.inter, self.hidden)),
                               ("w2", w2, (self.hidden, self.inter))):
            if tuple(w.shape) != shape:
                from megapar.moe.loading import checkpoint_key

                key = f"{prefix}{e}.{name}.weight"
                stored = checkpoint_key(state, key)
                also = "" if stored == key else f", read as {key}"
                raise ValueError(f"{stored} has logical shape {tuple(w.shape)}; expected {shape} "
                                 f"(hidden={self.hidden}, inter={self.inter}{also})")
        return w1, w3, w2

    def _read(self, state: Mapping[str, torch.Tensor], key: str) -> torch.Tensor | QuantizedTensor:
        return read_weight(state, key)

    def _convert(self, w: torch.Tensor | QuantizedTensor) -> torch.Tensor | QuantizedTensor:
        if isinstance(w, QuantizedTensor) and w.fmt != self.fmt:
            return prepare_weight(w, self.fmt if self.quantized else "fp32", **_QUANT_OPTS.get(self.fmt, {}))
        return w

    # ---- compute ------------------------------------------------------------------------

    def prepared(self, act_dtype: torch.dtype = torch.bfloat16
                 ) -> tuple[torch.Tensor | PreparedWeight, torch.Tensor | PreparedWeight]:
        """(w13, w2) as `moe.kernels.expert_ffn` takes them for activations of act_dtype. Quantized
        weights are prepared once per device, storage version and packing (FP4 nibbles repacked for
        the CUDA kernels: a second copy of the packed data there); in-place changes (EPLB
        migration, loading) invalidate the copy."""
        if not self.quantized:
            return self.w13, self.w2
        tensors = [t for t in self.slot_tensors()]
        packing = packing_for(self.fmt, act_dtype, tensors[0].is_cuda)
        key = (tensors[0].device, packing, tuple((t.data_ptr(), t._version) for t in tensors))
        if self._prepared_key != key:
            packing = {"packing": packing} if packing else {}
            self._prepared = (prepare_weights(self.weight("w13"), gate_up=self.gate_up, **packing),
                              prepare_weights(self.weight("w2"), **packing))
            if self.resident_fp8 and tensors[0].is_cuda:      # (the CPU path reads dequantized weights)
                for w in self._prepared:
                    w.keep_fp8()
            self._prepared_key = key
        return self._prepared

    def takes_fp8_rows(self, num_rows: int, device: torch.device, act_dtype: torch.dtype = torch.bfloat16) -> bool:
        """Whether `forward` over num_rows rows of act_dtype on `device` runs the W4A8 path, which
        reads fp8_token rows: a caller may then quantize each token once, before its top-k copies,
        and pass the quantized rows (`moe.kernels.expert_ffn`) with out_dtype=act_dtype."""
        if not self.quantized:
            return False
        # the preparation `forward` reads for these activations (another act_dtype may pack the
        # weights differently on CUDA: asking with bf16 re-prepared them twice a call under fp32)
        w13, w2 = self.prepared(act_dtype)
        hint = num_rows / max(self.num_slots, 1)
        return ffn_backend(self.backend, torch.device(device), w13, w2, hint) == "triton_w4a8"

    def forward(self, x: torch.Tensor | QuantizedTensor, counts: torch.Tensor | Sequence[int],
                offsets: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x: [N, H] rows grouped by slot in slot order (or their fp8_token QuantizedTensor, see
        `takes_fp8_rows`); counts: [S] int rows per slot; offsets: [S + 1] int block starts when
        blocks are padded (padding rows must be zero) -> [N, H] in out_dtype (default x's dtype,
        bf16 for quantized rows), through the fused expert FFN (`moe.kernels.expert_ffn`, backend `self.backend`).
        Quantized rows read the weights' preparation for activations of out_dtype (the dtype they
        were quantized from, which the caller asked `takes_fp8_rows` about). Quantized weights
        under autograd (x requires grad) take the differentiable torch path with backend "auto"."""
        if len(x.shape) != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"Experts input must be [N, hidden={self.hidden}]; got {tuple(x.shape)}")
        if len(counts) != self.num_slots:
            raise ValueError(f"counts has {len(counts)} entries; this rank holds {self.num_slots} expert slots")
        w13, w2 = self.prepared((out_dtype or torch.bfloat16) if isinstance(x, QuantizedTensor) else x.dtype)
        if not isinstance(counts, torch.Tensor):
            device = x.data.device if isinstance(x, QuantizedTensor) else x.device
            counts = torch.tensor(list(counts), dtype=torch.int64, device=device)
        rows = dict(offsets=offsets) if offsets is not None else dict(counts=counts)
        # (under autograd "auto" passes over the fused kernels, which have no backward: grouped_gemm.GEMM)
        return expert_ffn(x, w13, w2, **rows, swiglu_limit=self.swiglu_limit, alpha=self.alpha, beta=self.beta,
                          gate_up=self.gate_up, backend=self.backend, out_dtype=out_dtype)

    def extra_repr(self) -> str:
        return (f"slots={self.num_slots} of {self.num_experts}, hidden={self.hidden}, inter={self.inter}, "
                f"fmt={self.fmt}, gate_up={self.gate_up}, swiglu_limit={self.swiglu_limit}")


class SharedExpert(nn.Module):
    """The always-on expert: a SwiGLU MLP (`w1` gate, `w3` up, `w2` down; DeepSeek names), with
    its own optional clamp. inter = num_shared * the per-expert intermediate size."""

    def __init__(self, hidden: int, inter: int, *, swiglu_limit: float | None = None,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.swiglu_limit = swiglu_limit
        self.w1 = nn.Linear(hidden, inter, bias=False, dtype=dtype, device=device)
        self.w3 = nn.Linear(hidden, inter, bias=False, dtype=dtype, device=device)
        self.w2 = nn.Linear(inter, hidden, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> [T, H]. On CUDA without autograd the SwiGLU is one Triton launch (same fp32
        arithmetic, `moe.kernels.triton_swiglu`)."""
        g, u = self.w1(x), self.w3(x)
        if g.is_cuda and not (torch.is_grad_enabled() and g.requires_grad) and impl.triton_importable():
            from megapar.moe.kernels import triton_swiglu

            return self.w2(triton_swiglu.swiglu(g, u, limit=self.swiglu_limit, out_dtype=x.dtype))
        return self.w2(swiglu(g, u, limit=self.swiglu_limit).to(x.dtype))
