"""The `megapar` command: plan a layout, inspect the environment, run the demo and benchmarks.

    megapar groups --world-size 16 --tp 4 --pcp 2 --dcp 2     # rank layout, no processes started
    megapar env                                               # what is available here
    megapar demo [...]                                        # the main job (see launch/demo.py)
    megapar bench SUITE [--quick] [--device cpu|cuda] [--out DIR] [--summary]   # benchmarks -> DIR
    megapar bench SUITE --compare OLD.json    # ... then new/old per row -> DIR/SUITE-compare.md
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import shlex
import sys
from pathlib import Path

SUITES = ("gemm", "quant", "route", "moe", "ep", "cp", "merge", "sp", "mhc", "ubatch", "eplb")


def _add_layout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", type=int, required=True)
    for axis in ("tp", "pp", "pcp", "dcp"):
        p.add_argument(f"--{axis}", type=int, default=1)
    p.add_argument("--dp", type=int, default=None)
    p.add_argument("--ep", type=int, default=None)


def cmd_groups(args: argparse.Namespace) -> int:
    from megapar.parallel.config import ParallelConfig
    from megapar.parallel.layout import format_layout

    try:
        cfg = ParallelConfig(world_size=args.world_size, tp=args.tp, pp=args.pp, pcp=args.pcp, dcp=args.dcp,
                             dp=args.dp, ep=args.ep)
    except ValueError as e:
        print(f"megapar groups: {e}", file=sys.stderr)
        return 2
    print(format_layout(cfg))
    return 0


def _probe(module: str) -> str:
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # missing or broken
        return f"not available ({type(e).__name__})"
    return str(getattr(mod, "__version__", "available"))


def cmd_env(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    rows = [("torch", torch.__version__)]
    if torch.cuda.is_available():
        rows.append(("cuda", f"{torch.version.cuda}, {torch.cuda.device_count()} device(s)"))
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            rows.append((f"  cuda:{i}", f"{p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB"))
    else:
        rows.append(("cuda", "not available"))
    rows.append(("gloo", str(dist.is_gloo_available())))
    nccl = dist.is_nccl_available()
    if nccl and torch.cuda.is_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            pass
    rows.append(("nccl", str(nccl)))
    try:
        from torch.distributed import _symmetric_memory as symm

        rows.append(("symmetric memory (torch)", "available" + (
            f", nvshmem: {symm.is_nvshmem_available()}" if hasattr(symm, "is_nvshmem_available") else "")))
    except Exception as e:
        rows.append(("symmetric memory (torch)", f"not available ({type(e).__name__})"))
    for label, module in (("triton", "triton"), ("nvshmem4py", "nvshmem.core"), ("deep_ep", "deep_ep"),
                          ("deep_gemm", "deep_gemm"), ("ray", "ray")):
        rows.append((label, _probe(module)))
    from megapar.moe.kernels.deep_gemm import libstdcxx_problem
    rows.append(("libstdc++ (for deep_gemm)", libstdcxx_problem() or "no problem found"))
    width = max(len(r[0]) for r in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    # every op with several implementations: which can run here (for this machine's default device)
    # by their megapar names: a user's moe.py or model.py in the working directory shadows the short ones
    import megapar.model.mhc  # noqa: F401
    import megapar.moe.kernels.ffn  # noqa: F401  (importing the modules registers their ops)
    import megapar.parallel.cp  # noqa: F401
    import megapar.parallel.ep  # noqa: F401
    import megapar.parallel.ep.static  # noqa: F401
    import megapar.parallel.sp  # noqa: F401
    from megapar.parallel import impl

    print(f"\nimplementations ({'cuda' if torch.cuda.is_available() else 'cpu'} tensors; '-' = cannot run here):")
    for op, usable in impl.report().items():
        if op.startswith("test."):
            continue
        parts = [name if why is None else f"-{name} ({why})" for name, why in usable.items()]
        print(f"  {op:<18} {'; '.join(parts)}")
    return 0


class _Stopped(Exception):
    """SIGTERM (e.g. from `timeout`) during a suite: keep and write the rows measured so far."""


def _stop_on_sigterm(signum, frame):
    raise _Stopped("SIGTERM")


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the suites; the recorded command is rebuilt from the parsed arguments."""
    import signal
    import threading

    import torch

    from megapar.launch.bench.common import default_out_dir

    if args.suite is None and args.summary is None:
        print("megapar bench: give a suite (" + ", ".join(SUITES + ("all",)) + ") or --summary", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("megapar bench: --device cuda but CUDA is not available here (torch.cuda.is_available() is False); "
              "use --device cpu", file=sys.stderr)
        return 2
    if args.compare is not None and (args.suite in (None, "all") or not Path(args.compare).is_file()):
        why = "needs one suite" if args.suite in (None, "all") else f"{args.compare} is not a file"
        print(f"megapar bench: --compare {why} (megapar bench SUITE --compare OLD.json)", file=sys.stderr)
        return 2
    if args.world_size is not None and args.world_size < 1:
        print(f"megapar bench: --world-size must be >= 1, got {args.world_size}", file=sys.stderr)
        return 2
    if args.plot:
        # before the suites: the ImportError came after the first suite had run, as a traceback
        # that ended the run (`bench all --plot` never ran the other suites)
        from megapar.launch.bench.plot import _pyplot

        try:
            _pyplot()
        except ImportError as e:
            print(f"megapar bench: {e}", file=sys.stderr)
            return 2
    args.compare_old = None
    if args.compare is not None:
        # read now: the run writes OUT/SUITE-DEVICE.json, which may be this very file (comparing with
        # the last run in the same folder); read after the run, it compared the new rows with themselves
        from megapar.launch.bench.compare import _load

        try:
            args.compare_old = _load(args.compare)
        except ValueError as e:
            print(f"megapar bench: --compare: {e}", file=sys.stderr)
            return 2
    out = Path(args.out) if args.out else default_out_dir()
    # only while the suites run: a caller's process (a test, a notebook) keeps its own handler
    previous = None
    if threading.current_thread() is threading.main_thread():   # signal.signal works only there
        previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        return _run_suites(args, out)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _run_suites(args: argparse.Namespace, out: Path) -> int:
    import torch

    from megapar.launch.bench.clocks import ClockSampler
    from megapar.launch.bench.clocks import finish as finish_clocks
    from megapar.launch.bench.common import BenchContext, columns, format_table, write_results

    suites = () if args.suite is None else SUITES if args.suite == "all" else (args.suite,)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    command = "megapar " + " ".join(shlex.quote(a) for a in args.argv)
    failed = []
    stopped = False
    for i, name in enumerate(suites):
        print(f"== bench {name} on {device}{' (quick)' if args.quick else ''}", flush=True)
        try:
            module = importlib.import_module(f"megapar.launch.bench.{name}")
        except ModuleNotFoundError as e:
            print(f"   suite {name!r} is not available: {e}", file=sys.stderr)
            failed.append(name)
            continue
        ctx = BenchContext(suite=name, device=device, quick=args.quick,
                           options={k: v for k, v in vars(args).items() if k not in ("func", "argv", "compare_old")})
        ctx.clocks = ClockSampler.start(device)
        try:
            module.run(ctx)
        except _Stopped as e:
            ctx.note(f"stopped by {e} before the suite finished: the rows above are partial")
            failed.append(name)
            stopped = True
        except Exception:
            import traceback

            traceback.print_exc()
            failed.append(name)
        finally:
            if ctx.clocks is not None:
                finish_clocks(ctx)
        if ctx.wrong:
            print(f"   {name}: {len(ctx.wrong)} row(s) did not match their reference: {', '.join(ctx.wrong)}",
                  file=sys.stderr)
            failed.append(f"{name} (wrong results)")
        if ctx.rows:
            print("\n" + format_table(ctx.rows, columns(ctx.rows, extra=4)) + "\n", flush=True)
        if ctx.rows or ctx.notes:
            path = write_results(ctx, out, command)
            print(f"   wrote {path}")
            if args.plot:
                from megapar.launch.bench.plot import plot_results

                print(f"   wrote {plot_results(path)}")
            if args.compare is not None:
                from megapar.launch.bench.compare import compare, to_markdown, write_comparison

                try:
                    result = compare(path, args.compare_old)
                    replaced = Path(args.compare).resolve() == path.resolve()
                    result = dataclasses.replace(result, old_path=str(args.compare) + (
                        " (as it was before this run, which replaced it)" if replaced else ""))
                except ValueError as e:
                    print(f"megapar bench: --compare: {e}", file=sys.stderr)
                    failed.append(f"{name} (compare)")
                else:
                    print("\n" + to_markdown(result))
                    print(f"   wrote {write_comparison(result, out / f'{name}-compare.md')}")
        if stopped:   # SIGTERM stops the run, not only the suite it hit
            rest = suites[i + 1:]
            if rest:
                print(f"   not run (SIGTERM): {', '.join(rest)}", file=sys.stderr)
                failed += [f"{n} (not run)" for n in rest]
            break
    if args.summary is not None:
        from megapar.launch.bench.summary import write_summary

        print(f"   wrote {write_summary(out, args.summary or None)}")
    if failed:
        print(f"megapar bench: failed suites: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def cmd_demo(args: list[str]) -> int:
    from megapar.launch.demo import main as demo_main

    return demo_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megapar", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("groups", help="print the rank layout of a job without starting it")
    _add_layout_args(p)
    p.set_defaults(func=cmd_groups)
    p = sub.add_parser("env", help="print what is available: torch, CUDA, NCCL, NVSHMEM, triton, deep_ep, ...")
    p.set_defaults(func=cmd_env)
    p = sub.add_parser("bench", help="run a benchmark suite and write its results to --out")
    p.add_argument("suite", nargs="?", choices=SUITES + ("all",), help="the suite (optional with --summary)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (seconds on CPU)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None)
    p.add_argument("--out", default=None, help="result folder, the only place written (default $MEGAPAR_BENCH_DIR, "
                                              "else ./megapar-bench; the recorded results: --out bench/results)")
    p.add_argument("--summary", nargs="?", const="", default=None, metavar="PATH",
                   help="also regenerate the summary of the folder's results (default PATH: OUT/BENCHMARKS.md)")
    p.add_argument("--plot", action="store_true", help="also write a PNG where the suite supports it")
    p.add_argument("--world-size", type=int, default=None, help="ranks for multi-process cases")
    p.add_argument("--compare", default=None, metavar="OLD.json",
                   help="compare the new results with an earlier result file of the suite, row by row (new/old "
                        "per timing column, > 5%% slower in time_us flagged) -> OUT/SUITE-compare.md")
    p.set_defaults(func=cmd_bench)
    sub.add_parser("demo", help="the main job: prefill + decode on a small DeepSeek-V4-style model",
                   add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":
        return cmd_demo(argv[1:])
    args = build_parser().parse_args(argv)
    args.argv = argv
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
