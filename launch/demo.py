"""`megapar demo`: the main job. A small DeepSeek-V4-style model (model/) prefills a batch of
prompts and decodes N tokens on every parallel axis at once, and every step's logits are
checked against a dense single-process reference built from the same seed and weights.

    megapar demo                                   # 4 local gloo ranks: tp 2, pcp 2, dcp 2, ep 4, MXFP4
    megapar demo --world-size 2 --tp 2 --sp        # sequence parallel
    megapar demo --ubatch --eplb                   # micro-batch overlap, EPLB rebalancing after prefill
    megapar demo --attention mla                   # DeepSeek-V3 latent attention (absorbed DCP decode)
    python -m launch.demo ...                      # the same
    torchrun --nproc-per-node 4 -m launch.demo --tp 2 --pcp 2 --dcp 2 --device cuda
    megapar demo --launcher ray --world-size 4     # one Ray actor per rank

Flow on each rank: build the full state dict from the seed and keep its part (TP heads and
vocab rows, EP experts quantized at load), prefill its data-parallel replica's prompts, then
decode greedily (the next tokens are broadcast from the first rank of the replica so that all
ranks feed the same ones). The reference (model/reference.py, float64, no KV cache) then runs
the whole sequence that was decoded, in the parent process (local, Ray) or on rank 0
(torchrun), and the logits of the prefill and of every decode step are compared: PASS when
max |logits - reference| / max |reference| <= tolerance. Exit code 0 on PASS, 1 on FAIL, 2 for
bad arguments, 3 when the job itself failed (a rank raised, died or timed out: one message naming
the rank, no traceback of the launcher). Each phase is printed as it happens.

Unset layout flags: tp 2, pcp 2, dcp 2 when none of them is given and 4 divides the world
size, else 1 (the KV cache is then sharded over pcp x dcp = 4 ranks, as in vLLM). KV heads
default to 2, or tp // dcp when dcp > 1 (DCP is carved from TP: a group shares one KV head). The batch defaults to 2 prompts per data-parallel replica. The printed timings
are rank 0's: phases between barriers, and per primitive (see model/profile.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from megapar.model.config import ATTENTION_KINDS, QUANT_FORMATS, ModelConfig, check_layout
from megapar.parallel.config import ParallelConfig

# Max relative logit error. The model runs in fp32 (the reference in fp64) and the parallel
# paths only reorder sums (ring/DCP merges, reduce-scatters): ~4e-7 is typical on CPU; CUDA
# kernels (SDPA, Triton mHC with tf32x3 dots) get some slack.
DEFAULT_TOLERANCE = {"cpu": 1e-4, "cuda": 1e-3}
LAUNCHERS = ("auto", "local", "torchrun", "ray")
EPLB_PER_RANK = object()
"""`--eplb` given alone: one slot per EP rank (not a number: `--eplb -1` is refused like any other
negative count; not a string either: argparse would convert a string const with type=int)"""


@dataclass(frozen=True)
class DemoSpec:
    """Everything a rank needs (picklable)."""

    model: ModelConfig
    parallel: ParallelConfig
    batch: int
    """prompts over all data-parallel replicas (each takes an equal slice)"""
    prompt_len: int
    new_tokens: int
    """decode steps after the prefill"""
    seed: int = 0
    device: str = "cpu"
    """"cpu" (gloo) or "cuda" (NCCL, one GPU per rank)"""
    overlap: bool = True
    """overlapped all-gather-matmul / matmul-reduce-scatter in the TP linears"""
    ubatch: int = 1
    """micro-batches of the MoE call (1 = none)"""
    eplb_redundant: int | None = None
    """EPLB extra expert slots; None = no EPLB"""
    corrupt_rank: int | None = None
    """perturb one weight on this rank (tests that the check can fail)"""
    progress: bool = False
    """rank 0 prints each phase as it happens (the command line turns this on)"""


@dataclass
class RankResult:
    """What one rank sends back (CPU tensors)."""

    rank: int
    replica: int
    batch_slice: tuple[int, int]
    tokens: torch.Tensor          # [b, S + N] int64: prompts + the tokens fed to decode steps
    logits: torch.Tensor          # [N + 1, b, V] fp32: prefill, then every decode step
    phase_seconds: dict[str, float]
    primitives: dict[str, dict[str, tuple[float, int]]]
    eplb: str | None = None


@dataclass
class CheckResult:
    passed: bool
    max_abs_error: float
    max_rel_error: float
    step_errors: list[float]
    tolerance: float
    tokens_matching: int
    tokens_total: int
    rank_disagreement: float
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# one rank


def replica_of(pcfg: ParallelConfig, rank: int) -> int:
    """Index of the data-parallel replica that `rank` belongs to."""
    from megapar.parallel.layout import coords

    c = coords(pcfg, rank)
    return c["ext_dp"] * pcfg.dp + c["dp"]


def make_prompts(spec: DemoSpec) -> torch.Tensor:
    """[batch, prompt_len] int64 token ids from the seed (the same everywhere)."""
    g = torch.Generator().manual_seed(spec.seed + 1)
    return torch.randint(spec.model.vocab, (spec.batch, spec.prompt_len), generator=g)


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _broadcast_first(t: torch.Tensor, groups) -> torch.Tensor:
    """Make every rank of the replica hold the first rank's `t` (TP, then PCP)."""
    import torch.distributed as dist

    for g in (groups.tp, groups.pcp):
        if g.size > 1:
            dist.broadcast(t, src=g.ranks[0], group=g.group)
    return t


def say(text: str) -> None:
    """One progress line of the demo (stdout, flushed: the ranks share the terminal)."""
    print(f"megapar demo: {text}", flush=True)


def _decode_marks(n: int) -> set[int]:
    """The decode steps after which progress is shown: every step up to 8, else about 8 marks."""
    return set(range(1, n + 1)) if n <= 8 else {min(n, round(n * i / 8)) for i in range(1, 9)}


def run_rank(groups, spec: DemoSpec) -> RankResult:
    """Prefill + decode on this rank of an initialized job."""
    from megapar.model.model import DemoModel
    from megapar.model.profile import Timer
    from megapar.model.weights import make_state_dict

    device = torch.device(f"cuda:{torch.cuda.current_device()}" if spec.device == "cuda" else "cpu")
    rank, pcfg = groups.rank, spec.parallel
    replicas = pcfg.dp * pcfg.ext_dp
    replica = replica_of(pcfg, rank)
    per_replica = spec.batch // replicas
    lo, hi = replica * per_replica, (replica + 1) * per_replica
    timer = Timer(sync_cuda=device.type == "cuda")
    show = spec.progress and rank == 0
    t0 = time.perf_counter()
    model = DemoModel(spec.model, groups, overlap=spec.overlap, ubatch=spec.ubatch,
                      eplb_redundant=spec.eplb_redundant, timer=timer, device=device)
    model.load_full(make_state_dict(spec.model, spec.seed))
    if spec.corrupt_rank == rank:
        model.corrupt(spec.seed)
    prompts = make_prompts(spec)[lo:hi].to(device)
    phases: dict[str, float] = {}
    max_len = spec.prompt_len + spec.new_tokens

    _barrier()
    if show:
        say(f"rank 0: model built, weights loaded ({time.perf_counter() - t0:.1f}s); prefill of "
            f"{spec.batch} x {spec.prompt_len} tokens ...")
    timer.phase = "prefill"
    start = time.perf_counter()
    logits = [model.prefill(prompts, max_len)]
    _barrier()
    phases["prefill"] = time.perf_counter() - start
    if show:
        say(f"rank 0: prefill done ({phases['prefill']:.2f}s)")

    eplb_summary = None
    if model.eplb is not None:
        timer.phase = "eplb"
        start = time.perf_counter()
        report = model.rebalance_experts()
        phases["eplb"] = time.perf_counter() - start
        eplb_summary = report.summary()
        if show:
            say(f"rank 0: EPLB rebalanced ({phases['eplb']:.2f}s)")

    timer.phase = "decode"
    fed = []
    start = time.perf_counter()
    marks = _decode_marks(spec.new_tokens)
    for step in range(1, spec.new_tokens + 1):
        nxt = _broadcast_first(logits[-1].argmax(-1), groups)
        fed.append(nxt)
        logits.append(model.decode_step(nxt))
        if show and step in marks:
            say(f"rank 0: decode step {step}/{spec.new_tokens} ({time.perf_counter() - start:.2f}s)")
    _barrier()
    phases["decode"] = time.perf_counter() - start
    tokens = torch.cat([prompts] + [t[:, None] for t in fed], dim=1)
    return RankResult(rank=rank, replica=replica, batch_slice=(lo, hi), tokens=tokens.cpu(),
                      logits=torch.stack(logits).cpu(), phase_seconds=phases, primitives=timer.as_dict(),
                      eplb=eplb_summary)


def _rank_entry(rank: int, spec: DemoSpec) -> RankResult:
    """launch_local / Ray entry: init the groups (unless the launcher did), run, tear down."""
    from megapar.parallel import destroy_parallel, get_optional_groups, init_parallel

    groups = get_optional_groups()
    owned = groups is None
    if spec.progress and rank == 0:
        say("rank 0: started" + ("; creating the process groups ..." if owned else ""))
    if owned:
        groups = init_parallel(spec.parallel)
    try:
        return run_rank(groups, spec)
    finally:
        if owned:
            destroy_parallel()


# ---------------------------------------------------------------------------------------------
# the check


def check_results(spec: DemoSpec, results: list[RankResult], tolerance: float) -> CheckResult:
    """Compare every rank's logits with the reference on the tokens that were decoded."""
    from megapar.model.reference import reference_logits
    from megapar.model.weights import make_state_dict

    firsts: dict[int, RankResult] = {}
    disagreement = 0.0
    for r in results:
        first = firsts.setdefault(r.replica, r)
        if r is not first:
            gap = (r.logits - first.logits).abs().max().item()
            # NaN (a rank's NaN logits) compares False with everything: max() would drop it
            disagreement = max(disagreement, math.inf if math.isnan(gap) else gap)
            if not torch.equal(r.tokens, first.tokens):
                disagreement = float("inf")
    replicas = [firsts[i] for i in sorted(firsts)]
    tokens = torch.cat([r.tokens for r in replicas])                              # [B, S + N]
    logits = torch.cat([r.logits for r in replicas], dim=1).double()              # [N + 1, B, V]
    ref = reference_logits(make_state_dict(spec.model, spec.seed), spec.model, tokens)
    s = spec.prompt_len
    ref_steps = ref[:, s - 1:s + spec.new_tokens].transpose(0, 1)                 # [N + 1, B, V]
    errors = (logits - ref_steps).abs()
    step_errors = errors.flatten(1).amax(1).tolist()
    max_abs = errors.max().item()     # NaN when any step has one (a Python max() of the list could drop it)
    max_rel = max_abs / ref_steps.abs().max().item()
    greedy_ref = ref_steps.argmax(-1)[:-1]                                        # tokens the reference picks
    fed = tokens[:, s:].T                                                         # [N, B]
    matching = int((greedy_ref == fed).sum())
    passed = max_rel <= tolerance and disagreement <= tolerance * ref_steps.abs().max().item()
    notes = []
    if matching < fed.numel():
        notes.append("greedy tokens differ from the reference's argmax where logits nearly tie; the reference "
                     "is fed the decoded tokens, so the logits comparison is unaffected")
    return CheckResult(passed, max_abs, max_rel, step_errors, tolerance, matching, fed.numel(), disagreement, notes)


# ---------------------------------------------------------------------------------------------
# report


def format_timings(spec: DemoSpec, result: RankResult) -> str:
    phases = result.phase_seconds
    b, s, n = spec.batch, spec.prompt_len, spec.new_tokens
    lines = [f"{'phase':<10} {'ms':>10} {'tokens':>7} {'tokens/s':>10}"]
    rows = [("prefill", b * s), ("eplb", 0), ("decode", b * n)]
    for name, count in rows:
        if name in phases:
            secs = phases[name]
            rate = f"{count / secs:>10.1f}" if count and secs > 0 else f"{'-':>10}"
            lines.append(f"{name:<10} {secs * 1e3:>10.2f} {count or '-':>7} {rate}")
    lines.append("")
    names = sorted({k for ph in result.primitives.values() for k in ph if ph})
    shown = [ph for ph in ("prefill", "eplb", "decode") if ph in result.primitives]
    lines.append(f"{'primitive (rank ' + str(result.rank) + ')':<22}" + "".join(
        f" {ph + ' ms':>12} {'calls':>6} {'%':>5}" for ph in shown))
    for name in names:
        row = f"{name:<22}"
        for ph in shown:
            secs, calls = result.primitives[ph].get(name, (0.0, 0))
            total = phases.get(ph, 0.0)
            pct = f"{100 * secs / total:>5.1f}" if total > 0 and calls else f"{'':>5}"
            row += f" {secs * 1e3:>12.2f} {calls:>6} {pct}" if calls else f" {'':>12} {'':>6} {pct}"
        lines.append(row)
    lines.append("(moe = gate + dispatch + experts + combine + shared; micro-batch threads overlap in wall time)")
    return "\n".join(lines)


def _attention_summary(cfg: ModelConfig) -> str:
    if cfg.attention == "mla":
        return (f"MLA {cfg.heads} heads (latent r {cfg.kv_lora_rank} + rope {cfg.qk_rope_head_dim}, nope "
                f"{cfg.qk_nope_head_dim}, v {cfg.v_head_dim}, q_lora {cfg.q_lora_rank})")
    return f"heads {cfg.heads}/{cfg.kv_heads} kv"


def format_report(spec: DemoSpec, launcher: str, backend: str, results: list[RankResult], check: CheckResult) -> str:
    from megapar.parallel.layout import format_layout

    pcfg, cfg = spec.parallel, spec.model
    out = [f"megapar demo: {pcfg.world_size} rank(s), launcher {launcher}, backend {backend}, device {spec.device}",
           f"model: {cfg.layers} layers, hidden {cfg.hidden}, {_attention_summary(cfg)}, "
           f"{cfg.experts} experts top-{cfg.top_k} ({cfg.quant}), mHC M={cfg.mhc_streams}, vocab {cfg.vocab}",
           f"run: batch {spec.batch}, prompt {spec.prompt_len}, {spec.new_tokens} new tokens, seed {spec.seed}, "
           f"sp {'on' if pcfg.sequence_parallel else 'off'}, overlap {'on' if spec.overlap else 'off'}, "
           f"ubatch {spec.ubatch}, eplb {'off' if spec.eplb_redundant is None else f'+{spec.eplb_redundant} slots'}"
           + (f", CORRUPTED weight on rank {spec.corrupt_rank}" if spec.corrupt_rank is not None else ""),
           "", format_layout(pcfg), "", format_timings(spec, results[0]), ""]
    if results[0].eplb:
        out += [results[0].eplb, ""]
    steps = " ".join(f"{e:.2e}" for e in check.step_errors)
    out.append(f"max |logits - reference| per step (prefill, decode 1..{spec.new_tokens}): {steps}")
    out.append(f"greedy tokens equal to the reference's argmax: {check.tokens_matching}/{check.tokens_total}; "
               f"ranks of a replica agree to {check.rank_disagreement:.2e}")
    out += [f"note: {n}" for n in check.notes]
    verdict = "PASS" if check.passed else "FAIL"
    out.append(f"{verdict}: max error {check.max_abs_error:.3e} (relative {check.max_rel_error:.3e}, "
               f"tolerance {check.tolerance:g})")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megapar demo", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=None, help="ranks (default 4; torchrun: from the environment)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size")
    p.add_argument("--pcp", type=int, default=None, help="prefill context-parallel size (ring attention)")
    p.add_argument("--dcp", type=int, default=None, help="decode context-parallel size (sharded KV cache)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size (default: all ranks)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel size (default: world / (tp * pcp))")
    p.add_argument("--sp", action="store_true", help="sequence parallelism over the TP group")
    p.add_argument("--no-overlap", action="store_true", help="plain collectives in the TP linears")
    p.add_argument("--quant", choices=QUANT_FORMATS, default="mxfp4", help="routed expert weight format")
    p.add_argument("--launcher", choices=LAUNCHERS, default="auto",
                   help="auto: torchrun when its environment is set, else local processes")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, one GPU per rank")
    p.add_argument("--layers", type=int, default=2, help="transformer layers (attention + MoE each)")
    p.add_argument("--hidden", type=int, default=64, help="hidden size (a multiple of the quant block, 32 for mxfp4)")
    p.add_argument("--heads", type=int, default=4, help="query heads (split over TP)")
    p.add_argument("--kv-heads", type=int, default=None,
                   help="KV heads (GQA; replicated when fewer than tp). Default 2, or tp // dcp when dcp > 1 "
                        "(a DCP group, carved from TP, shares one KV head)")
    p.add_argument("--attention", choices=ATTENTION_KINDS, default="gqa",
                   help="gqa, or mla: DeepSeek-V3 multi-head latent attention (ring prefill non-absorbed, DCP "
                        "decode absorbed over a latent paged cache, fused MLA prep)")
    p.add_argument("--kv-lora-rank", type=int, default=32, help="MLA latent rank r (cache: r + rope dims per token)")
    p.add_argument("--q-lora-rank", type=int, default=32, help="MLA query down-projection rank (0 = q_proj)")
    p.add_argument("--experts", type=int, default=8, help="routed experts (split over EP)")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--vocab", type=int, default=512, help="vocabulary (split over TP in the lm_head)")
    p.add_argument("--batch", type=int, default=None, help="prompts in all (default 2 per data-parallel replica)")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens (a multiple of 2 * pcp)")
    p.add_argument("--new-tokens", type=int, default=8, help="decode steps")
    p.add_argument("--seed", type=int, default=0, help="weights and prompts")
    p.add_argument("--ubatch", type=int, nargs="?", const=2, default=1,
                   help="micro-batches around the MoE dispatch/combine (flag alone: 2)")
    p.add_argument("--eplb", type=int, nargs="?", const=EPLB_PER_RANK, default=None, metavar="REDUNDANT",
                   help="EPLB with REDUNDANT extra expert slots (flag alone: one per EP rank); rebalances after prefill")
    p.add_argument("--tolerance", type=float, default=None,
                   help=f"max relative logit error (default {DEFAULT_TOLERANCE['cpu']:g} cpu, "
                        f"{DEFAULT_TOLERANCE['cuda']:g} cuda)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a hung job is stopped")
    p.add_argument("--corrupt-rank", type=int, default=None, help=argparse.SUPPRESS)  # tests: prove FAIL works
    return p


def _torchrun_env() -> bool:
    return all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def spec_from_args(args: argparse.Namespace, world_size: int) -> DemoSpec:
    axes = (args.tp, args.pcp, args.dcp)
    demo_layout = all(a is None for a in axes) and world_size % 4 == 0
    tp, pcp, dcp = (2, 2, 2) if demo_layout else tuple(1 if a is None else a for a in axes)   # 0 is refused
    pcfg = ParallelConfig(world_size=world_size, tp=tp, pcp=pcp, dcp=dcp, dp=args.dp, ep=args.ep,
                          sequence_parallel=args.sp)
    mla = args.attention == "mla"
    if args.kv_heads is not None:
        kv_heads = args.kv_heads
    else:   # MLA: one latent KV head for every query head
        kv_heads = 1 if mla else (tp // dcp if dcp > 1 else 2)
    if mla and args.kv_heads not in (None, 1):
        raise ValueError(f"--kv-heads ({args.kv_heads}) does not apply to --attention mla (one latent KV head); "
                         f"leave it unset or 1")
    cfg = ModelConfig(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
                      kv_heads=kv_heads, experts=args.experts, top_k=args.top_k, quant=args.quant,
                      attention=args.attention, kv_lora_rank=args.kv_lora_rank, q_lora_rank=args.q_lora_rank)
    replicas = pcfg.dp * pcfg.ext_dp
    batch = args.batch if args.batch is not None else 2 * replicas
    redundant = args.eplb
    if redundant is EPLB_PER_RANK:
        redundant = pcfg.ep
    elif redundant is not None and redundant < 0:   # (EplbConfig refused it inside every rank)
        raise ValueError(f"--eplb ({redundant}) must be >= 0 extra expert slots (the flag alone: one per EP rank)")
    if args.new_tokens < 0:
        raise ValueError(f"--new-tokens ({args.new_tokens}) must be >= 0")
    if args.ubatch < 1:
        raise ValueError(f"--ubatch ({args.ubatch}) must be >= 1 (1 = no micro-batches)")
    if args.corrupt_rank is not None and not 0 <= args.corrupt_rank < world_size:
        raise ValueError(f"--corrupt-rank ({args.corrupt_rank}) must be in [0, {world_size})")
    check_layout(cfg, pcfg, prompt_len=args.prompt_len, batch=batch, redundant_experts=redundant or 0)
    return DemoSpec(model=cfg, parallel=pcfg, batch=batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                    seed=args.seed, device=args.device, overlap=not args.no_overlap, ubatch=args.ubatch,
                    eplb_redundant=redundant, corrupt_rank=args.corrupt_rank)


def _run_torchrun(spec: DemoSpec, tolerance: float, timeout: float) -> int:
    import torch.distributed as dist

    from megapar.launch.env import init_from_env
    from megapar.parallel import destroy_parallel

    # --timeout as every collective's timeout: a hung rank makes the others raise after it
    groups = init_from_env(spec.parallel, backend="nccl" if spec.device == "cuda" else "gloo", timeout=timeout)
    try:
        result = run_rank(groups, spec)
        gathered: list[Any] = [None] * groups.world.size
        if groups.world.size > 1:
            dist.all_gather_object(gathered, result)
        else:
            gathered = [result]
        verdict = [None]
        if groups.rank == 0:
            check = check_results(spec, gathered, tolerance)
            print(format_report(spec, "torchrun", groups.backend, gathered, check), flush=True)
            verdict = [check.passed]
        if groups.world.size > 1:
            dist.broadcast_object_list(verdict, src=0)
        return 0 if verdict[0] else 1
    finally:
        destroy_parallel()


def main(argv: list[str] | None = None) -> int:
    """`megapar demo ARGS`; returns the exit code (0 PASS, 1 FAIL, 2 bad arguments, 3 job failed)."""
    from megapar.launch.local import RankError

    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if not args.timeout > 0:
        print(f"megapar demo: --timeout must be > 0 seconds, got {args.timeout:g}", file=sys.stderr)
        return 2
    if args.tolerance is not None and not 0 < args.tolerance < math.inf:
        print(f"megapar demo: --tolerance must be a finite number > 0, got {args.tolerance:g}", file=sys.stderr)
        return 2
    try:
        return _main(args)
    except RankError as e:
        print(f"megapar demo: the job failed: {e}", file=sys.stderr)
        return 3


def _main(args: argparse.Namespace) -> int:
    from megapar.launch.local import RankError

    launcher = args.launcher
    if launcher == "auto":
        launcher = "torchrun" if _torchrun_env() else "local"
    if launcher == "torchrun":
        if not _torchrun_env():
            print("megapar demo: --launcher torchrun needs the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, "
                  "MASTER_PORT); run it as: torchrun --nproc-per-node N -m launch.demo ...", file=sys.stderr)
            return 2
        env_world = int(os.environ["WORLD_SIZE"])
        if args.world_size not in (None, env_world):
            print(f"megapar demo: --world-size ({args.world_size}) != torchrun's WORLD_SIZE ({env_world})",
                  file=sys.stderr)
            return 2
        world = env_world
    else:
        world = 4 if args.world_size is None else args.world_size   # 0 is refused, not the default
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("megapar demo: --device cuda but CUDA is not available", file=sys.stderr)
            return 2
        if launcher == "local" and world > torch.cuda.device_count():
            print(f"megapar demo: --device cuda runs one rank per GPU; world size {world} > "
                  f"{torch.cuda.device_count()} GPU(s) here (NCCL refuses two ranks on one GPU)", file=sys.stderr)
            return 2
    try:
        spec = spec_from_args(args, world)
    except ValueError as e:
        print(f"megapar demo: {e}", file=sys.stderr)
        return 2
    tolerance = args.tolerance if args.tolerance is not None else DEFAULT_TOLERANCE[args.device]
    backend = "nccl" if args.device == "cuda" else "gloo"
    spec = dataclasses.replace(spec, progress=True)
    if launcher == "torchrun":
        return _run_torchrun(spec, tolerance, args.timeout)
    start = time.perf_counter()
    if launcher == "ray":
        from megapar.launch.ray_launcher import launch_on_ray

        # CPU ranks share the cores anyway: a fraction lets a small machine hold the job
        cpus = max(0.01, min(1.0, int(100 * (os.cpu_count() or 1) / world) / 100))
        resources = {"CPU": 1, "GPU": 1} if args.device == "cuda" else {"CPU": cpus}
        say(f"starting {world} Ray actor(s), backend {backend} ...")
        try:
            results = launch_on_ray(_rank_entry, world, parallel_config=spec.parallel,
                                    resources_per_worker=resources, args=(spec,), backend=backend,
                                    timeout=args.timeout)
        except (ValueError, ImportError) as e:   # the cluster cannot hold the job; Ray is not installed
            print(f"megapar demo: {e}", file=sys.stderr)
            return 2
    elif world == 1:
        say("one rank, in this process ...")
        try:
            results = [_rank_entry(0, spec)]
        except Exception as e:   # a failed job (exit 3), as launch_local reports a rank's error, not FAIL (1)
            text = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            raise RankError(f"rank 0 failed:\n{text}", rank=0, remote_traceback=text) from None
    else:
        from megapar.launch.local import launch_local

        say(f"starting {world} local processes, backend {backend} (timeout {args.timeout:g}s) ...")
        results = launch_local(_rank_entry, world, backend=backend, args=(spec,), timeout=args.timeout)
    say(f"ranks finished ({time.perf_counter() - start:.1f}s); checking every step against the float64 "
        f"reference ...")
    check = check_results(spec, results, tolerance)
    print(format_report(spec, launcher, backend, results, check), flush=True)
    return 0 if check.passed else 1


if __name__ == "__main__":
    sys.exit(main())
