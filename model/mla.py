"""DeepSeek-V3 multi-head latent attention (MLA) for the demo model, and a loader for HF weights.

Per token (H hidden, heads over TP, r = kv_lora_rank, d_n / d_r / d_v the nope / rope / value
head dims; docs/numerics.md and `parallel.cp.mla` hold the equations):

    q      = q_b_proj(RMSNorm_q(q_a_proj(h)))   [heads, d_n + d_r]  (or q_proj(h) when q_lora_rank = 0)
    kv     = kv_a_proj_with_mqa(h)              [r + d_r]           c_kv = RMSNorm_kv(kv[:r]), k_pe = kv[r:]
    RoPE on q[..., d_n:] and k_pe: pairs (2i, 2i+1) rotated by the table `cos_sin` [max_pos, d_r]
    o      = o_proj(attention)                   with W_UK / W_UV (kv_b_proj) per head

- Prefill (non-absorbed): keys [W_UK c_kv, k_pe] and values W_UV c_kv of the local zigzag shard
  go through `mla_prefill_attention` (ring attention over PCP); the latent [c_kv, k_pe] of the
  whole prompt is all-gathered over PCP and inserted into the latent paged cache, sharded over
  the pcp * dcp ranks of a DCP group and its PCP peers (as the GQA cache is, vLLM's layout).
- Decode (absorbed): `mla_prep` (RMSNorm + RoPE + cache insert, one Triton kernel on CUDA), then
  `mla_decode_attention`: q_lat = W_UK^T q_nope against the latent cache, DCP over the DCP group
  (one latent head shared by every query head, so the TP-carved DCP group's gathered heads all
  map onto it), LSE-merged over PCP, o = W_UV o_lat.

TP: q_b_proj / q_proj rows, kv_b_proj rows and o_proj columns are split by heads; q_a_proj,
kv_a_proj_with_mqa and both norms are replicated (the latent is per token, not per head). With
sequence parallelism the token shard is all-gathered over TP first and o_proj reduce-scatters.

HF: `hf_attention_state` maps the state dict of one `DeepseekV3Attention` (`q_a_proj`, ...,
`o_proj`) onto these names, permuting the RoPE rows when `rope_interleave` is off (HF then
rotates halves (i, i + d_r/2); here pairs (2i, 2i+1)); `hf_rope_table` takes HF's cos/sin (yarn's
attention factor included) and `hf_softmax_scale` its softmax scale (yarn's mscale^2 included).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megapar.parallel.cp import ContextParallelAttention, DCPLayout
from megapar.parallel.cp.mla import MLACache, MLADims, mla_decode_attention, mla_kv_insert, mla_prefill_attention, \
    split_kv_b
from megapar.parallel.cp.mla_prep import mla_prep, rope_pairs, rope_table
from megapar.parallel.groups import ParallelGroups
from megapar.parallel.sp import RowParallelLinear, sp_all_gather

from .config import ModelConfig
from .model import copy_weight, rms_norm
from .profile import Timer


def mla_dims(cfg: ModelConfig) -> MLADims:
    return MLADims(kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                   qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim)


class MLAttention(nn.Module):
    """MLA with TP heads, PCP ring prefill (non-absorbed) and absorbed DCP decode over a latent cache.

    The same interface as the GQA `model.model.Attention`: `load_full`, `allocate_cache`,
    `prefill`, `decode`, and `cp` (the ContextParallelAttention giving shards and positions).
    `cos_sin` ([max_pos, d_r] fp32, `rope_table`) and `scale` default to the plain RoPE of
    `cfg.rope_theta` and (d_n + d_r)^-1/2; the HF loader replaces them.
    """

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups, *, sequence_parallel: bool, overlap: bool,
                 timer: Timer, device: torch.device, interleave: int = 1) -> None:
        super().__init__()
        tp = groups.tp
        self.cfg, self.groups, self.timer, self.sequence_parallel = cfg, groups, timer, sequence_parallel
        self.dims = mla_dims(cfg)
        self.local_heads = cfg.heads // tp.size
        self.head_range = (tp.rank * self.local_heads, (tp.rank + 1) * self.local_heads)
        d = self.dims
        zeros = lambda *shape: torch.zeros(*shape, device=device)
        if cfg.q_lora_rank:
            self.register_buffer("q_a", zeros(cfg.q_lora_rank, cfg.hidden))                  # [q_lora, H]
            self.register_buffer("q_a_norm", zeros(cfg.q_lora_rank))
            self.register_buffer("q_b", zeros(self.local_heads * d.qk_head_dim, cfg.q_lora_rank))
        else:
            self.register_buffer("q_b", zeros(self.local_heads * d.qk_head_dim, cfg.hidden))  # q_proj rows
        self.register_buffer("kv_a", zeros(d.latent_dim, cfg.hidden))                        # [r + d_r, H]
        self.register_buffer("kv_a_norm", zeros(d.kv_lora_rank))
        self.register_buffer("kv_b", zeros(self.local_heads * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank))
        self.o_proj = RowParallelLinear(cfg.heads * d.v_head_dim, cfg.hidden, tp, sequence_parallel=sequence_parallel,
                                        overlap=overlap, device=device, dtype=torch.float32)
        self.cp = ContextParallelAttention(groups, interleave=interleave)
        pcp, dcp = groups.pcp, groups.dcp
        self.kv_pcp = pcp if pcp.size > 1 else None
        self.shard_rank = pcp.rank * dcp.size + dcp.rank           # vLLM's total_cp_rank (docs/numerics.md §8)
        self.cos_sin: torch.Tensor | None = None
        self.rope_loaded = False
        self.scale = d.qk_head_dim ** -0.5
        self.cache: MLACache | None = None

    @property
    def wo(self) -> RowParallelLinear:
        """The output projection (the GQA layer's name; `DemoModel.corrupt` perturbs it)."""
        return self.o_proj

    @torch.no_grad()
    def load_full(self, state: dict[str, torch.Tensor], prefix: str) -> None:
        """Take this rank's heads of the full MLA weights (names in model/weights.py, HF's)."""
        lo, hi = self.head_range
        d = self.dims

        def load(dst: torch.Tensor, name: str, per_head: int = 0) -> None:    # (shapes checked: no broadcast)
            key = f"{prefix}.{name}.weight"
            w = state[key]
            if not per_head:
                copy_weight(dst, w, key)
                return
            # the full [heads * per_head, in] weight is checked before this rank's heads are cut from it
            # (a view by heads took any tensor of as many elements, e.g. a transposed one, scrambled)
            full = (self.cfg.heads * per_head, dst.shape[1])
            if tuple(w.shape) != full:
                raise ValueError(f"{key} has shape {tuple(w.shape)}, expected {full}")
            copy_weight(dst, w.view(self.cfg.heads, per_head, -1)[lo:hi].flatten(0, 1), key)
        if self.cfg.q_lora_rank:
            load(self.q_a, "q_a_proj")
            load(self.q_a_norm, "q_a_layernorm")
            load(self.q_b, "q_b_proj", d.qk_head_dim)
        else:
            load(self.q_b, "q_proj", d.qk_head_dim)
        load(self.kv_a, "kv_a_proj_with_mqa")
        load(self.kv_a_norm, "kv_a_layernorm")
        load(self.kv_b, "kv_b_proj", d.qk_nope_head_dim + d.v_head_dim)
        self.o_proj.load_full_weight(state[f"{prefix}.o_proj.weight"])

    def allocate_cache(self, num_blocks: int, block_size: int, device: torch.device) -> None:
        self.cache = MLACache.allocate(num_blocks, block_size, self.dims, dtype=torch.float32, device=device)
        self.rope(self.cache_positions, device)

    def rope(self, max_pos: int, device: torch.device) -> torch.Tensor:
        """The RoPE table [P, d_r] fp32: the loaded one (HF's, P = the positions it was given, which
        max_pos does not extend: a position past it raises in prefill / decode on the CPU), else
        one built from cfg.rope_theta with P >= max_pos."""
        if not self.rope_loaded and (self.cos_sin is None or self.cos_sin.shape[0] < max_pos):
            self.cos_sin = rope_table(max_pos, self.dims.qk_rope_head_dim, self.cfg.rope_theta, device=device)
        return self.cos_sin

    # ---- pieces -------------------------------------------------------------------------

    def _project(self, h: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """h: [T_in, H] -> q [T, H_local, d_n + d_r], kv [T, r + d_r] over the T real tokens."""
        with self.timer.span("attn.qkv"):
            if self.sequence_parallel:
                h = sp_all_gather(h, self.groups.tp, num_tokens=num_tokens)
            h = h[:num_tokens]
            x = rms_norm(h @ self.q_a.T, self.q_a_norm, self.cfg.norm_eps) if self.cfg.q_lora_rank else h
            q = (x @ self.q_b.T).view(num_tokens, self.local_heads, self.dims.qk_head_dim)
            return q, h @ self.kv_a.T

    def _absorb_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H_local, d_n, r], W_UV [H_local, d_v, r]) of this rank's heads."""
        return split_kv_b(self.kv_b, self.local_heads, self.dims)

    def _output(self, o: torch.Tensor, rows: int) -> torch.Tensor:
        """o: [T, H_local * d_v] -> [T_in, H] (rows = the padded T the row linear expects)."""
        if rows > o.shape[0]:
            o = F.pad(o, (0, 0, 0, rows - o.shape[0]))
        with self.timer.span("attn.out"):
            return self.o_proj(o)

    def _layout(self) -> DCPLayout:
        return DCPLayout(size=self.cp.kv_shards, rank=self.shard_rank, block_size=self.cache.block_size,
                         interleave=self.cp.interleave)

    # ---- entry points -------------------------------------------------------------------

    def prefill(self, h: torch.Tensor, batch: int, seq_len: int, padded_rows: int, block_table: torch.Tensor
                ) -> torch.Tensor:
        """h: [T_in, H] (T = batch * seq_len / pcp local tokens, zigzag order) -> [T_in, H]."""
        d, local_len = self.dims, seq_len // self.groups.pcp.size
        if seq_len > self.cos_sin.shape[0]:   # (positions index the table: an IndexError, a device assert on CUDA)
            raise ValueError(f"seq_len ({seq_len}) exceeds the RoPE table's {self.cos_sin.shape[0]} positions "
                             f"(a loaded HF table keeps the length it was given)")
        q, kv = self._project(h, batch * local_len)
        positions = self.cp.positions(seq_len, device=h.device)                     # [S/pcp]
        with self.timer.span("attn.rope"):
            cs = self.cos_sin[positions]                             # [S/pcp, d_r]
            cos, sin = cs.chunk(2, dim=-1)
            q = q.view(batch, local_len, self.local_heads, d.qk_head_dim)
            q_nope = q[..., :d.qk_nope_head_dim]
            q_pe = rope_pairs(q[..., d.qk_nope_head_dim:], cos[:, None], sin[:, None])   # [B, S/pcp, Hl, d_r]
            kv = kv.view(batch, local_len, d.latent_dim)
            c_kv = rms_norm(kv[..., :d.kv_lora_rank], self.kv_a_norm, self.cfg.norm_eps)
            k_pe = rope_pairs(kv[..., d.kv_lora_rank:], cos, sin)                  # [B, S/pcp, d_r]
        w_uk, w_uv = self._absorb_weights()
        with self.timer.span("attn.ring" if self.groups.pcp.size > 1 else "attn.local"):
            o = mla_prefill_attention(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, self.groups.pcp, causal=True,
                                      scale=self.scale)                            # [B, S/pcp, Hl, d_v]
        with self.timer.span("attn.kv_fill"):
            c_full, pe_full = self.cp.unshard(c_kv, dim=1), self.cp.unshard(k_pe, dim=1)   # [B, S, r], [B, S, d_r]
            pos = torch.arange(seq_len, device=h.device).repeat(batch)
            table = block_table.repeat_interleave(seq_len, dim=0)
            mla_kv_insert(self.cache, c_full.flatten(0, 1), pe_full.flatten(0, 1), pos, table, self.groups.dcp,
                          interleave=self.cp.interleave, pcp_group=self.kv_pcp)
        return self._output(o.reshape(batch * local_len, -1), padded_rows)

    def decode(self, h: torch.Tensor, batch: int, padded_rows: int, positions: torch.Tensor,
               block_table: torch.Tensor) -> torch.Tensor:
        """h: [T_in, H] for one new token per sequence at `positions` [B] -> [T_in, H]."""
        d = self.dims
        q, kv = self._project(h, batch)
        with self.timer.span("attn.mla_prep"):
            # RMSNorm + RoPE + the sharded latent insert (one kernel on CUDA)
            prep = mla_prep(q, kv, positions, self.cache, block_table, self.cos_sin,
                            self.kv_a_norm, layout=self._layout(), nope=d.qk_nope_head_dim, eps=self.cfg.norm_eps)
        w_uk, w_uv = self._absorb_weights()
        with self.timer.span("attn.dcp" if self.cp.kv_shards > 1 else "attn.paged"):
            o = mla_decode_attention(prep.q[..., :d.qk_nope_head_dim], prep.q[..., d.qk_nope_head_dim:], self.cache,
                                     w_uk, w_uv, block_table, positions + 1, self.groups.dcp,
                                     interleave=self.cp.interleave, scale=self.scale, pcp_group=self.kv_pcp)
        return self._output(o.reshape(batch, -1), padded_rows)

    @property
    def cache_positions(self) -> int:
        """Positions of the whole cache, every sequence's blocks together: a bound on the positions
        of any one sequence (the RoPE table's length), not its capacity."""
        return self.cache.kv.shape[0] * self.cache.block_size * self.cp.kv_shards


# ---------------------------------------------------------------------------------------------
# HF transformers' DeepseekV3Attention


HF_NAMES = ("q_a_proj", "q_a_layernorm", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
            "o_proj")


def _interleave_rows(w: torch.Tensor, start: int, rope_dim: int, period: int) -> torch.Tensor:
    """Rows [start, start + d_r) of every block of `period` rows, from halves (i, i + d_r/2) to pairs (2i, 2i+1)."""
    half = rope_dim // 2
    perm = torch.stack([torch.arange(half), torch.arange(half) + half], dim=-1).flatten()   # [d_r]
    blocks = w.view(-1, period, *w.shape[1:]).clone()
    blocks[:, start:start + rope_dim] = blocks[:, start:start + rope_dim][:, perm]
    return blocks.view(w.shape)


def hf_attention_state(hf_state: dict[str, torch.Tensor], cfg: ModelConfig, *, rope_interleave: bool = True,
                       prefix: str = "", out_prefix: str = "layers.0.attn") -> dict[str, torch.Tensor]:
    """One `DeepseekV3Attention`'s weights (HF names under `prefix`) as this model's MLA state dict.

    rope_interleave: HF's `config.rope_interleave`. True (DeepSeek's checkpoints): HF rotates
    pairs (2i, 2i+1) and writes the results de-interleaved, which permutes q_pe and k_pe alike
    and leaves every score as here: the weights are taken as they are. False: HF rotates halves
    (i, i + d_r/2), so the RoPE rows of q_b_proj (per head) and kv_a_proj_with_mqa are permuted
    into pairs. Biases (`attention_bias`) are not supported: ValueError."""
    d = mla_dims(cfg)
    q_name = "q_b_proj" if cfg.q_lora_rank else "q_proj"
    need = ([("q_a_proj", (cfg.q_lora_rank, cfg.hidden)), ("q_a_layernorm", (cfg.q_lora_rank,))]
            if cfg.q_lora_rank else [])
    need += [(q_name, (cfg.heads * d.qk_head_dim, cfg.q_lora_rank or cfg.hidden)),
             ("kv_a_proj_with_mqa", (d.latent_dim, cfg.hidden)), ("kv_a_layernorm", (d.kv_lora_rank,)),
             ("kv_b_proj", (cfg.heads * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank)),
             ("o_proj", (cfg.hidden, cfg.heads * d.v_head_dim))]
    biases = sorted(k for k in hf_state if k.startswith(prefix) and k.endswith(".bias"))
    if biases:
        raise ValueError(f"attention biases are not supported (attention_bias=True): {biases}")
    out: dict[str, torch.Tensor] = {}
    for name, shape in need:
        key = f"{prefix}{name}.weight"
        if key not in hf_state:
            raise ValueError(f"{key!r} missing from the HF state dict; expected {[f'{prefix}{n}.weight' for n, _ in need]}")
        w = hf_state[key].detach().float().cpu()
        if tuple(w.shape) != shape:
            raise ValueError(f"{key} has shape {tuple(w.shape)}, expected {shape} for {cfg.heads} heads, "
                             f"hidden {cfg.hidden}, {d}")
        if not rope_interleave and name == q_name:
            w = _interleave_rows(w, d.qk_nope_head_dim, d.qk_rope_head_dim, d.qk_head_dim)
        if not rope_interleave and name == "kv_a_proj_with_mqa":
            w = _interleave_rows(w, d.kv_lora_rank, d.qk_rope_head_dim, d.latent_dim)
        out[f"{out_prefix}.{name}.weight"] = w
    return out


def hf_rope_table(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotary embedding output for positions 0..P-1 (cos, sin [P, d_r] = cat(freqs, freqs)
    times the attention factor) -> this model's table [P, d_r] fp32 (cos | sin of each pair)."""
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] % 2:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be [positions, d_r], d_r even")
    half = cos.shape[1] // 2
    if not (torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])):
        raise ValueError("cos/sin must be HF's cat(freqs, freqs) layout (both halves equal)")
    return torch.cat([cos[:, :half], sin[:, :half]], dim=-1).float()


def hf_softmax_scale(qk_head_dim: int, rope_parameters: dict | None) -> float:
    """HF's DeepseekV3Attention.scaling: (d_n + d_r)^-1/2, times mscale^2 for yarn with
    `mscale_all_dim` (mscale = 0.1 * mscale_all_dim * ln(factor) + 1, factor > 1)."""
    scale = qk_head_dim ** -0.5
    params = rope_parameters or {}
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim", 0):
        factor = params["factor"]
        mscale = 0.1 * params["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


def load_hf_attention(layer: MLAttention, hf_state: dict[str, torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                      *, rope_interleave: bool = True, rope_parameters: dict | None = None, prefix: str = "") -> None:
    """Copy an HF `DeepseekV3Attention` into `layer`: weights (`hf_attention_state`), HF's RoPE
    table (`hf_rope_table`) and softmax scale (`hf_softmax_scale`)."""
    state = hf_attention_state(hf_state, layer.cfg, rope_interleave=rope_interleave, prefix=prefix, out_prefix="a")
    device = layer.kv_a.device
    layer.load_full({k: v.to(device) for k, v in state.items()}, "a")
    layer.cos_sin = hf_rope_table(cos, sin).to(device)
    layer.rope_loaded = True
    layer.scale = hf_softmax_scale(layer.dims.qk_head_dim, rope_parameters)
