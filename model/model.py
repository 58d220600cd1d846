"""The distributed demo model: every parallel part of megapar wired into one forward.

    tokens -> embed -> mHC broadcast (M streams)
      L x [ mHC pre -> RMSNorm -> attention (TP heads; ring over PCP in prefill, DCP cache in decode) -> mHC post
            mHC pre -> RMSNorm -> MoE (EP dispatch, FP4 experts, shared expert; ubatch, EPLB)   -> mHC post ]
      -> mHC head -> RMSNorm -> lm_head (vocab-parallel over TP) -> logits

Where each token lives (per data-parallel replica; replicas split the batch):
- Prefill: each PCP rank holds the zigzag shard of every prompt (chunks r and 2P-1-r of 2P),
  [B, S/P] tokens, replicated over its TP group (or, with sequence parallelism, split over TP
  between the TP linears: the column linear all-gathers them, the row linear reduce-scatters).
  Attention is `ring_attention` over PCP (positions for RoPE from `zigzag_positions`). The K/V
  of the prompt is all-gathered over PCP and written into the paged cache, sharded (vLLM's
  layout) over the pcp * dcp ranks of a DCP group and its PCP peers: each keeps the positions it
  owns.
- Decode: the B new tokens are replicated on every rank of the replica; attention inserts
  their K/V into the cache and runs `dcp_decode_attention` over the DCP group, merged over PCP.
- MoE: the tokens replicated over TP are cut into TP shards (`sp_shard`, padding masked out of
  routing), each rank routes and dispatches its shard over the EP group, and the outputs are
  all-gathered over TP; with sequence parallelism the shard is already there. In decode, PCP
  ranks hold the same tokens and dispatch them twice (simple; the duplicate costs compute only).
- The lm_head is vocab-parallel over TP (outputs all-gathered); prefill's last position lives on
  one PCP rank (the one holding chunk 2P-1) and is all-reduced from there.

KV heads: split over TP when kv_heads >= tp; otherwise each is replicated on tp // kv_heads
ranks by repeating its rows in the full wk/wv before the column split (vLLM's rule). Each rank
keeps ONE `PagedKVCache` holding its local KV heads, and a decode step is one
`dcp_decode_attention` call. Every rank of a DCP group holds the same KV heads (`check_layout`):
DCP is carved from TP, so its ranks hold different query heads over one shared KV head, and the
gathered heads all map onto it. PCP peers share their TP rank, hence all their heads.

MLA (`ModelConfig.attention = "mla"`, model/mla.py): DeepSeek-V3's latent attention takes the
attention's place: the same prefill (ring over PCP, non-absorbed) / decode (DCP, absorbed, over a
latent paged cache sharded like the GQA cache) flow with one latent KV head for every query head.

mHC between sublayers: `mhc_post_pre` fuses one sublayer's mHC post with the next one's pre
(attention -> MoE inside a layer, MoE -> the next layer's attention); the first pre and the
last post (before the head) stand alone.

Options: `sequence_parallel` (from the ParallelConfig), `overlap` (async-TP linears), `ubatch`
(micro-batches of the MoE call through `UBatchRunner`: dispatch/combine of one overlap the
other's experts), `eplb_redundant` (EPLB with that many extra expert slots; `rebalance_experts()`
moves the experts by the load seen so far, between prefill and decode in the demo).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megapar.moe import MoELayer
from megapar.parallel import comm
from megapar.parallel.cp import ContextParallelAttention, PagedKVCache
from megapar.parallel.groups import ParallelGroups
from megapar.parallel.sp import ColumnParallelLinear, RowParallelLinear, sp_all_gather, sp_local_tokens, sp_shard
from megapar.parallel.ubatch import UBatchRunner

from .config import ModelConfig, check_layout, kv_heads_of_tp_rank
from .mhc import mhc_broadcast, mhc_head, mhc_post, mhc_post_pre, mhc_pre
from .profile import Timer


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H] -> [T, H], fp32 math."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate pairs (2i, 2i+1) of the last dim by positions * theta^(-2i/D).

    x: [..., P, heads, D] with P = positions.numel() (positions [P] int)."""
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float64) / d)
    angles = (positions.to(torch.float64)[:, None] * inv_freq).to(torch.float32)   # [P, D/2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]                   # [P, 1, D/2]
    even, odd = x[..., 0::2].float(), x[..., 1::2].float()
    out = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return out.flatten(-2).to(x.dtype)


def copy_weight(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    """dst.copy_(src) for a loaded weight `name`, refusing another shape (copy_ would broadcast a
    [1] or [H] tensor silently)."""
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"{name} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


class _ReadLog(dict):
    """A state dict that records the keys read, so that a load can name the ones it left unused."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> torch.Tensor:
        value = super().__getitem__(key)
        self.read.add(key)
        return value

    def get(self, key: str, default=None):    # (dict.get would bypass __getitem__)
        return self[key] if key in self else default


class MHCParams(nn.Module):
    """fn / base / scale of one mHC site (sublayer or head), fp32 buffers."""

    def __init__(self, rows: int, streams: int, hidden: int, num_scales: int) -> None:
        super().__init__()
        self.register_buffer("fn", torch.zeros(rows, streams * hidden))
        self.register_buffer("base", torch.zeros(rows))
        self.register_buffer("scale", torch.ones(num_scales))


class Attention(nn.Module):
    """GQA attention with TP heads, PCP ring prefill and a DCP-sharded paged KV cache."""

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups, *, sequence_parallel: bool, overlap: bool,
                 timer: Timer, device: torch.device) -> None:
        super().__init__()
        tp = groups.tp
        self.cfg, self.groups, self.timer = cfg, groups, timer
        self.kv_heads = kv_heads_of_tp_rank(cfg, tp.size, tp.rank)
        self.replicated_kv = max(tp.size // cfg.kv_heads, 1)      # ranks holding each KV head
        d = cfg.head_dim
        kv_rows = len(self.kv_heads) * tp.size * d
        kw = dict(sequence_parallel=sequence_parallel, overlap=overlap, device=device, dtype=torch.float32)
        self.qkv = ColumnParallelLinear(cfg.hidden, [cfg.heads * d, kv_rows, kv_rows], tp, **kw)
        self.wo = RowParallelLinear(cfg.heads * d, cfg.hidden, tp, **kw)
        self.cp = ContextParallelAttention(groups)
        self.cache: PagedKVCache | None = None

    def load_full(self, state: dict[str, torch.Tensor], prefix: str) -> None:
        d, h = self.cfg.head_dim, self.cfg.hidden
        # each weight's own shape: the replication below views wk / wv by heads (which took any tensor
        # of as many elements, a transposed one too), and the concatenation is checked only in all
        for name, rows in (("wq", self.cfg.heads), ("wk", self.cfg.kv_heads), ("wv", self.cfg.kv_heads)):
            key, want = f"{prefix}.{name}.weight", (rows * d, h)
            if tuple(state[key].shape) != want:
                raise ValueError(f"{key} has shape {tuple(state[key].shape)}, expected {want}")
        wk, wv = state[f"{prefix}.wk.weight"], state[f"{prefix}.wv.weight"]
        if self.replicated_kv > 1:  # repeat every KV head's rows so that each TP rank gets its copy
            wk = wk.view(self.cfg.kv_heads, d, -1).repeat_interleave(self.replicated_kv, 0).flatten(0, 1)
            wv = wv.view(self.cfg.kv_heads, d, -1).repeat_interleave(self.replicated_kv, 0).flatten(0, 1)
        self.qkv.load_full_weight(torch.cat([state[f"{prefix}.wq.weight"], wk, wv]))
        self.wo.load_full_weight(state[f"{prefix}.wo.weight"])

    def allocate_cache(self, num_blocks: int, block_size: int, device: torch.device) -> None:
        self.cache = PagedKVCache.allocate(num_blocks, block_size, len(self.kv_heads), self.cfg.head_dim,
                                           dtype=torch.float32, device=device)

    def _project(self, h: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h: [T_in, H] -> q [T, Hq_local, D], k, v [T, Hkv_local, D] over the T real tokens."""
        d = self.cfg.head_dim
        with self.timer.span("attn.qkv"):
            q, k, v = self.qkv(h)
        return (q[:num_tokens].view(num_tokens, -1, d), k[:num_tokens].view(num_tokens, -1, d),
                v[:num_tokens].view(num_tokens, -1, d))

    def _output(self, o: torch.Tensor, rows: int) -> torch.Tensor:
        """o: [T, Hq_local * D] -> [T_in, H] (rows = the padded T the row linear expects)."""
        if rows > o.shape[0]:
            o = F.pad(o, (0, 0, 0, rows - o.shape[0]))
        with self.timer.span("attn.out"):
            return self.wo(o)

    def prefill(self, h: torch.Tensor, batch: int, seq_len: int, padded_rows: int, block_table: torch.Tensor
                ) -> torch.Tensor:
        """h: [T_in, H] (T = batch * seq_len / pcp local tokens, zigzag order) -> [T_in, H]."""
        local_len = seq_len // self.groups.pcp.size
        q, k, v = self._project(h, batch * local_len)
        positions = self.cp.positions(seq_len, device=h.device)                     # [S/pcp]
        with self.timer.span("attn.rope"):
            q = apply_rope(q.view(batch, local_len, *q.shape[1:]), positions, self.cfg.rope_theta)
            k = apply_rope(k.view(batch, local_len, *k.shape[1:]), positions, self.cfg.rope_theta)
        v = v.view(batch, local_len, *v.shape[1:])
        with self.timer.span("attn.ring" if self.groups.pcp.size > 1 else "attn.local"):
            o = self.cp(q, k, v, causal=True)                                      # [B, S/pcp, Hq_l, D]
        with self.timer.span("attn.kv_fill"):
            k_full, v_full = self.cp.unshard(k, dim=1), self.cp.unshard(v, dim=1)  # [B, S, Hkv_l, D]
            pos = torch.arange(seq_len, device=h.device).repeat(batch)
            table = block_table.repeat_interleave(seq_len, dim=0)
            self.cp.insert_kv(self.cache, k_full.flatten(0, 1), v_full.flatten(0, 1), pos, table)
        return self._output(o.reshape(batch * local_len, -1), padded_rows)

    def decode(self, h: torch.Tensor, batch: int, padded_rows: int, positions: torch.Tensor,
               block_table: torch.Tensor) -> torch.Tensor:
        """h: [T_in, H] for one new token per sequence at `positions` [B] -> [T_in, H]."""
        q, k, v = self._project(h, batch)
        with self.timer.span("attn.rope"):
            q = apply_rope(q, positions, self.cfg.rope_theta)
            k = apply_rope(k, positions, self.cfg.rope_theta)
        with self.timer.span("attn.kv_insert"):
            self.cp.insert_kv(self.cache, k, v, positions, block_table)
        with self.timer.span("attn.dcp" if self.cp.kv_shards > 1 else "attn.paged"):
            o = self.cp.decode(q, self.cache, block_table, positions + 1)
        return self._output(o.reshape(batch, -1), padded_rows)


class MoEBlock(nn.Module):
    """The MoE sublayer: TP shard -> MoELayer over EP (micro-batched optionally) -> TP all-gather."""

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups, layer: int, *, sequence_parallel: bool,
                 ubatch: UBatchRunner | None, eplb, timer: Timer, device: torch.device) -> None:
        super().__init__()
        self.groups, self.sequence_parallel, self.ubatch, self.timer = groups, sequence_parallel, ubatch, timer
        moe_cfg = cfg.moe_config()
        # Micro-batches yield around dispatch/combine only on the plain (one-chunk) path.
        self.moe = MoELayer(moe_cfg, groups.ep, tokens="sequence_parallel", overlap_chunks=1 if ubatch else None,
                            eplb=eplb, layer_index=layer, device=device)
        self._instrument()

    def _instrument(self) -> None:
        t, moe = self.timer, self.moe
        moe.gate.forward = t.wrap("moe.gate", moe.gate.forward)
        moe.experts.forward = t.wrap("moe.experts", moe.experts.forward)
        if moe.shared_experts is not None:
            moe.shared_experts.forward = t.wrap("moe.shared", moe.shared_experts.forward)
        moe.dispatcher.dispatch = t.wrap_async("moe.dispatch", moe.dispatcher.dispatch)
        moe.dispatcher.combine = t.wrap_async("moe.combine", moe.dispatcher.combine)

    def forward(self, h: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """h: [T_in, H] (a TP shard of `num_tokens` tokens with SP, else all of them) -> [T_in, H]."""
        tp = self.groups.tp
        shard = h if self.sequence_parallel else sp_shard(h, tp)
        rows = shard.shape[0]
        mask = torch.arange(tp.rank * rows, (tp.rank + 1) * rows, device=h.device) < num_tokens
        with self.timer.span("moe"):
            if self.ubatch is not None:
                y = self.ubatch.run(lambda x, m: self.moe(x, token_mask=m), shard, mask, split=True)
            else:
                y = self.moe(shard, token_mask=mask)
        if self.sequence_parallel:
            return y
        with self.timer.span("moe.tp_gather"):
            return sp_all_gather(y, tp, num_tokens=num_tokens)


class Block(nn.Module):
    """One layer's weights: mHC-wrapped attention and mHC-wrapped MoE (`DemoModel._trunk` runs them)."""

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups, layer: int, *, sequence_parallel: bool,
                 overlap: bool, ubatch: UBatchRunner | None, eplb, timer: Timer, device: torch.device) -> None:
        super().__init__()
        m, h = cfg.mhc_streams, cfg.hidden
        self.attn_mhc = MHCParams((2 + m) * m, m, h, 3)
        self.attn_norm = nn.Parameter(torch.ones(h), requires_grad=False)
        from .mla import MLAttention   # model/mla.py imports this module's rms_norm

        attention = MLAttention if cfg.attention == "mla" else Attention
        self.attn = attention(cfg, groups, sequence_parallel=sequence_parallel, overlap=overlap, timer=timer,
                              device=device)
        self.ffn_mhc = MHCParams((2 + m) * m, m, h, 3)
        self.ffn_norm = nn.Parameter(torch.ones(h), requires_grad=False)
        self.moe = MoEBlock(cfg, groups, layer, sequence_parallel=sequence_parallel, ubatch=ubatch, eplb=eplb,
                            timer=timer, device=device)

    def load_full(self, state: dict[str, torch.Tensor], prefix: str) -> None:
        with torch.no_grad():
            for site in ("attn_mhc", "ffn_mhc"):
                for name in ("fn", "base", "scale"):
                    key = f"{prefix}.{site}.{name}"
                    copy_weight(getattr(getattr(self, site), name), state[key], key)
            for norm in ("attn_norm", "ffn_norm"):
                key = f"{prefix}.{norm}.weight"
                copy_weight(getattr(self, norm), state[key], key)
        self.attn.load_full(state, f"{prefix}.attn")
        self.moe.moe.load_deepseek(state, prefix=f"{prefix}.moe.")

    def sublayers(self, attention: Callable[[torch.Tensor], torch.Tensor], num_tokens: int
                  ) -> list[tuple[MHCParams, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]]:
        """(mHC site, norm weight, sublayer h [T_in, H] -> [T_in, H]) of the attention, then the MoE.

        attention: this layer's prefill or decode attention; the model chains the mHC around them."""
        return [(self.attn_mhc, self.attn_norm, attention),
                (self.ffn_mhc, self.ffn_norm, lambda x: self.moe(x, num_tokens))]


class DemoModel(nn.Module):
    """The distributed model of one rank. `prefill(tokens [B, S])` then `decode_step(tokens [B])`.

    groups: the job's ParallelGroups (`ParallelConfig.sequence_parallel` turns SP on). B is this
    data-parallel replica's batch; every rank of the replica passes the same tokens.
    """

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups, *, overlap: bool = True, ubatch: int = 1,
                 eplb_redundant: int | None = None, block_size: int = 4, timer: Timer | None = None,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        check_layout(cfg, groups.config, redundant_experts=eplb_redundant or 0)
        device = torch.device(device)
        self.cfg, self.groups, self.device, self.block_size = cfg, groups, device, block_size
        self.sequence_parallel = groups.config.sequence_parallel and groups.tp.size > 1
        self.timer = timer or Timer(sync_cuda=device.type == "cuda")
        self.eplb = None
        if eplb_redundant is not None:
            from megapar.parallel.ep.eplb_state import Eplb, EplbConfig

            self.eplb = Eplb(cfg.layers, cfg.experts, group=groups.ep, edp_group=groups.edp,
                             config=EplbConfig(num_redundant=eplb_redundant), device=device)
        runner = UBatchRunner(ubatch, min_tokens=1) if ubatch > 1 else None
        h = cfg.hidden
        self.register_buffer("embed", torch.zeros(cfg.vocab, h, device=device))
        self.layers = nn.ModuleList(
            Block(cfg, groups, i, sequence_parallel=self.sequence_parallel, overlap=overlap, ubatch=runner,
                  eplb=self.eplb, timer=self.timer, device=device) for i in range(cfg.layers))
        self.head_mhc = MHCParams(cfg.mhc_streams, cfg.mhc_streams, h, 1)
        self.register_buffer("norm", torch.ones(h, device=device))
        self.lm_head = ColumnParallelLinear(h, cfg.vocab, groups.tp, device=device, dtype=torch.float32)
        self.to(device)
        self.block_table: torch.Tensor | None = None
        self.seq_len = 0

    # ---- weights ------------------------------------------------------------------------

    @torch.no_grad()
    def load_full(self, state: dict[str, torch.Tensor]) -> None:
        """Take this rank's part of the full state dict (see model/weights.py for the names).

        A missing key raises KeyError, a tensor of another shape ValueError, and so do keys this
        model leaves unused (another config's layers, shared experts, attention weights): the
        model would silently differ from the checkpoint. Routed experts held by other EP ranks
        are theirs to read. A load that raises leaves every weight as it was (they are copied
        first and put back: the unused keys are known only once the rest has been read)."""
        tensors = list({id(t): t for t in (*self.parameters(), *self.buffers())}.values())
        saved = [t.detach().clone() for t in tensors]
        try:
            self._load_full(state)
        except BaseException:
            for t, old in zip(tensors, saved):
                t.detach().copy_(old)
            raise

    def _load_full(self, state: dict[str, torch.Tensor]) -> None:
        state = _ReadLog({k: v.to(self.device) for k, v in state.items()})
        copy_weight(self.embed, state["embed.weight"], "embed.weight")
        for i, layer in enumerate(self.layers):
            layer.load_full(state, f"layers.{i}")
        for name in ("fn", "base", "scale"):
            copy_weight(getattr(self.head_mhc, name), state[f"head_mhc.{name}"], f"head_mhc.{name}")
        copy_weight(self.norm, state["norm.weight"], "norm.weight")
        self.lm_head.load_full_weight(state["lm_head.weight"])
        elsewhere = tuple(f"layers.{i}.moe.experts.{e}." for i, layer in enumerate(self.layers)
                          for e in sorted(set(range(self.cfg.experts)) - set(layer.moe.moe.experts.local_experts)))
        unused = sorted(k for k in state if k not in state.read and not k.startswith(elsewhere))
        if unused:
            shown = ", ".join(unused[:8]) + (f", ... ({len(unused)} in all)" if len(unused) > 8 else "")
            raise ValueError(f"state dict keys this model leaves unused: {shown} (layers {self.cfg.layers}, "
                             f"attention {self.cfg.attention!r}, experts {self.cfg.experts}, shared_inter "
                             f"{self.cfg.shared_inter}); the checkpoint does not match the ModelConfig")

    @torch.no_grad()
    def corrupt(self, seed: int = 0) -> None:
        """Perturb this rank's shard of layer 0's attention output weight (to prove the check can fail)."""
        g = torch.Generator().manual_seed(seed)
        w = self.layers[0].attn.wo.weight
        w.add_(0.5 * torch.randn(w.shape, generator=g).to(w.device))

    # ---- pieces -------------------------------------------------------------------------

    def _tokens_in(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, ...] replicated over TP -> this rank's SP shard when sequence parallel."""
        return sp_shard(x, self.groups.tp) if self.sequence_parallel else x

    def _padded_rows(self, num_tokens: int) -> int:
        tp = self.groups.tp.size
        return tp * sp_local_tokens(num_tokens, tp) if self.sequence_parallel else num_tokens

    def _trunk(self, tokens: torch.Tensor, attention) -> torch.Tensor:
        """tokens: [T] local token ids -> final hidden [T, H] (replicated over TP)."""
        cfg, num_tokens = self.cfg, tokens.shape[0]
        with self.timer.span("embed"):
            x = self._tokens_in(F.embedding(tokens, self.embed))
            residual = mhc_broadcast(x, cfg.mhc_streams).contiguous()
        sublayers = [sub for layer in self.layers
                     for sub in layer.sublayers(lambda h, attn=layer.attn: attention(attn, h), num_tokens)]
        mhc_kw = dict(sinkhorn_iters=cfg.sinkhorn_iters, eps=cfg.mhc_eps, rms_eps=cfg.norm_eps)
        site = sublayers[0][0]
        with self.timer.span("mhc"):
            pre = mhc_pre(residual, site.fn, site.base, site.scale, **mhc_kw)
        for j, (_, norm, sublayer) in enumerate(sublayers):
            with self.timer.span("norm"):
                x = rms_norm(pre.layer_input, norm, cfg.norm_eps)
            out = sublayer(x)
            with self.timer.span("mhc"):   # this sublayer's post, fused with the next one's pre
                if j + 1 < len(sublayers):
                    nxt = sublayers[j + 1][0]
                    residual, pre = mhc_post_pre(out, residual, pre.post, pre.comb, nxt.fn, nxt.base, nxt.scale,
                                                 **mhc_kw)
                else:
                    residual = mhc_post(out, residual, pre.post, pre.comb)
        with self.timer.span("head"):
            h = mhc_head(residual, self.head_mhc.fn, self.head_mhc.base, self.head_mhc.scale, eps=cfg.mhc_eps,
                         rms_eps=cfg.norm_eps)
            h = rms_norm(h, self.norm, cfg.norm_eps)
            if self.sequence_parallel:
                h = sp_all_gather(h, self.groups.tp, num_tokens=num_tokens)
        return h

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: [B, H] -> [B, V] on every rank of the replica (vocab shards all-gathered over TP)."""
        with self.timer.span("lm_head"):
            local = self.lm_head(h)                                                  # [B, V / tp]
            return comm.all_gather_uneven(local.contiguous(), self.groups.tp, dim=-1)

    def allocate_cache(self, batch: int, max_len: int) -> None:
        """Paged KV cache for `batch` sequences of up to `max_len` tokens, sharded over pcp * dcp ranks."""
        per_virtual_block = self.block_size * self.layers[0].attn.cp.kv_shards
        blocks_per_seq = -(-max_len // per_virtual_block)
        self.block_table = torch.arange(batch * blocks_per_seq, device=self.device).view(batch, blocks_per_seq)
        self.max_len = max_len
        for layer in self.layers:
            layer.attn.allocate_cache(batch * blocks_per_seq, self.block_size, self.device)

    # ---- entry points -------------------------------------------------------------------

    def _check_tokens(self, tokens: torch.Tensor, what: str, *, values: bool) -> None:
        """Integer token ids, in [0, vocab) when `values` (reads them: a host sync on CUDA)."""
        if not isinstance(tokens, torch.Tensor) or tokens.dtype.is_floating_point or tokens.dtype.is_complex \
                or tokens.dtype == torch.bool:
            raise ValueError(f"{what} takes integer token ids; got "
                             f"{tokens.dtype if isinstance(tokens, torch.Tensor) else type(tokens).__name__}")
        if values and tokens.numel():
            lo, hi = (int(v) for v in torch.aminmax(tokens))
            if lo < 0 or hi >= self.cfg.vocab:
                raise ValueError(f"{what}: token ids in [{lo}, {hi}] are outside the vocabulary [0, {self.cfg.vocab})")

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, max_len: int | None = None) -> torch.Tensor:
        """tokens: [B, S] int (the full prompts, the same on every rank of the replica) ->
        logits [B, V] fp32 of the last position. Fills the KV cache (allocated for `max_len`).

        Bad tokens (shape, dtype, ids outside the vocabulary) raise ValueError before the cache is
        touched; a prefill that fails later leaves no decode state (`decode_step` then asks for a
        new prefill instead of reading a half-written cache)."""
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.shape[0] < 1:
            raise ValueError(f"prefill() takes the prompts as tokens [B, S] with B >= 1; got shape "
                             f"{tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__}")
        self._check_tokens(tokens, "prefill()", values=True)
        batch, seq_len = tokens.shape
        check_layout(self.cfg, self.groups.config, prompt_len=seq_len)
        if max_len is not None and max_len < seq_len:
            raise ValueError(f"max_len ({max_len}) must be >= the prompt length ({seq_len})")
        try:
            return self._prefill(tokens, batch, seq_len, max_len or seq_len)
        except BaseException:
            self.block_table, self.seq_len = None, 0   # the cache is half-rewritten: nothing to decode from
            raise

    def _prefill(self, tokens: torch.Tensor, batch: int, seq_len: int, max_len: int) -> torch.Tensor:
        self.allocate_cache(batch, max_len)
        cp = self.layers[0].attn.cp
        local = cp.shard(tokens.to(self.device), dim=1)                            # [B, S / pcp] zigzag
        num_tokens = local.numel()
        padded = self._padded_rows(num_tokens)
        table = self.block_table

        def attention(attn: Attention, h: torch.Tensor) -> torch.Tensor:
            return attn.prefill(h, batch, seq_len, padded, table)

        h = self._trunk(local.reshape(-1), attention).view(batch, -1, self.cfg.hidden)
        positions = cp.positions(seq_len, device=self.device)
        last = (positions == seq_len - 1).nonzero().flatten()
        with self.timer.span("head"):
            final = h[:, last[0]] if last.numel() else h.new_zeros(batch, self.cfg.hidden)
            final = comm.all_reduce(final.contiguous(), self.groups.pcp)           # one PCP rank holds it
        self.seq_len = seq_len
        return self._logits(final)

    @torch.no_grad()
    def decode_step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [B] int, one new token per sequence (the same on every rank of the replica) ->
        logits [B, V] fp32 for the next position. Ids outside the vocabulary raise ValueError when
        the tokens are CPU tensors (on the device, reading them would sync every step)."""
        if self.block_table is None:
            raise RuntimeError("decode_step() needs prefill() first (it fills the KV cache)")
        if self.seq_len >= self.max_len:
            raise ValueError(f"the KV cache holds {self.max_len} tokens per sequence; pass a larger max_len to "
                             f"prefill()")
        if tokens.dim() != 1:
            raise ValueError(f"decode_step() takes one token per sequence, shape [B]; got {tuple(tokens.shape)}")
        self._check_tokens(tokens, "decode_step()", values=tokens.device.type == "cpu")  # (no sync per step)
        batch = tokens.shape[0]
        if batch != self.block_table.shape[0]:
            raise ValueError(f"decode_step() got {batch} tokens but prefill() cached {self.block_table.shape[0]} "
                             f"sequences; decode one token for each")
        positions = torch.full((batch,), self.seq_len, device=self.device, dtype=torch.int64)
        padded = self._padded_rows(batch)
        table = self.block_table

        def attention(attn: Attention, h: torch.Tensor) -> torch.Tensor:
            return attn.decode(h, batch, padded, positions, table)

        h = self._trunk(tokens.to(self.device), attention)
        self.seq_len += 1
        return self._logits(h)

    @torch.no_grad()
    def rebalance_experts(self):
        """EPLB: fold the load counted so far and move the experts (collective over EP). None without EPLB."""
        if self.eplb is None:
            return None
        with self.timer.span("eplb.rebalance"):
            report = self.eplb.step()     # (rebalances by itself when the step lands on the interval)
            return report if report is not None else self.eplb.rebalance()
