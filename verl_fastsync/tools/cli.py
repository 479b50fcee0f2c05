"""The verl-fastsync console script: bench and doctor.

Exit status: 0 when the run completed (bench: a row with an error is a result, not a failure) or
the environment can do what was asked (``doctor``); 1 when something requested cannot work; 2 for
a bad command line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any


def _csv(kind: type, name: str) -> Callable[[str], tuple[Any, ...]]:
    def parse(text: str) -> tuple[Any, ...]:
        try:
            values = tuple(kind(part) for part in text.split(",") if part.strip())
        except ValueError as exc:
            raise argparse.ArgumentTypeError(
                f"{name}: {text!r} is not a comma-separated list of {kind.__name__}"
            ) from exc
        if not values:
            raise argparse.ArgumentTypeError(f"{name}: empty list")
        return values

    return parse


def _both(quick: Any, full: Any) -> str:
    def show(v: Any) -> str:
        if isinstance(v, tuple):
            return ",".join(":".join(map(str, x)) if isinstance(x, tuple) else str(x) for x in v) or "none"
        return f"{v:,}" if isinstance(v, int) and v >= 10_000 else str(v)

    if quick == full:
        return f"default {show(quick)}"
    return f"default {show(quick)}; with --full {show(full)}"


def build_parser() -> argparse.ArgumentParser:
    from verl_fastsync.tools import bench
    from verl_fastsync.tools.models import PRESETS

    q, f = bench.BenchOptions(), bench.full_options()
    parser = argparse.ArgumentParser(prog="verl-fastsync", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser(
        "bench",
        help="weight sync and cleanup measured next to stock verl and the raw limit, in one run",
        description=(bench.__doc__ or "").split("\n\nPackage layout")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    preset = b.add_mutually_exclusive_group()
    preset.add_argument(
        "--quick",
        dest="preset",
        action="store_const",
        const="quick",
        help="the quick preset (the default): one MoE-shaped model, about a minute on a 2-core CPU host",
    )
    preset.add_argument(
        "--full",
        dest="preset",
        action="store_const",
        const="full",
        help="the full preset: every figure of docs/benchmarks.md, including the 2 GiB MoE-shaped model "
        "with 256 MiB buckets and the fanout shapes; about 35-40 minutes on a 2-core CPU host. Options given "
        "next to it override it",
    )
    b.add_argument(
        "--model",
        dest="models",
        type=_csv(str, "--model"),
        help=f"model presets, comma-separated; allowed: {', '.join(PRESETS)} ({_both(q.models, f.models)})",
    )
    b.add_argument("--size-gib", type=float, help=f"model size in GiB ({_both(q.size_gib, f.size_gib)})")
    b.add_argument(
        "--bucket-mib",
        type=_csv(int, "--bucket-mib"),
        help=f"bucket sizes in MiB, comma-separated ({_both(q.bucket_mib, f.bucket_mib)})",
    )
    b.add_argument(
        "--extra",
        action="append",
        metavar="MODEL:SIZE_GIB:BUCKET_MIB",
        help=f"one more transfer configuration, repeatable, e.g. moe-small:2:256 ({_both(q.extra, f.extra)})",
    )
    b.add_argument(
        "--repeats",
        type=int,
        help="timed repeats per measurement, after an untimed warm-up that checks the bytes "
        f"({_both(q.repeats, f.repeats)})",
    )
    b.add_argument(
        "--heap-objects",
        type=int,
        help=f"GC-tracked objects in the cleanup child's heap ({_both(q.heap_objects, f.heap_objects)})",
    )
    b.add_argument(
        "--transports",
        type=_csv(str, "--transports"),
        help=f"transports, comma-separated; built-in: {', '.join(bench.TRANSPORTS)}, or any registered "
        "engine transport (default: every built-in one; those this host cannot run are reported "
        "as not available)",
    )
    b.add_argument(
        "--sections",
        type=_csv(str, "--sections"),
        help=f"sections, comma-separated; allowed: {', '.join(bench.SECTIONS)} "
        f"({_both(q.sections, f.sections)})",
    )
    b.add_argument(
        "--scale-sizes",
        type=_csv(float, "--scale-sizes"),
        help=f"scale section: model sizes as multiples of --size-gib ({_both(q.scale_sizes, f.scale_sizes)})",
    )
    b.add_argument(
        "--scale-pieces",
        type=_csv(int, "--scale-pieces"),
        help="scale section: tensor-count multipliers at equal bytes "
        f"({_both(q.scale_pieces, f.scale_pieces)})",
    )
    b.add_argument(
        "--idle-s",
        type=float,
        help=f"idle section: seconds each transport sits idle ({_both(q.idle_s, f.idle_s)})",
    )
    b.add_argument(
        "--seed",
        type=int,
        help=f"seed of the synthetic model's contents, which every transfer checks ({_both(q.seed, f.seed)})",
    )
    b.add_argument(
        "--timeout",
        dest="timeout_s",
        type=float,
        help=f"seconds any child process or transfer may take ({_both(q.timeout_s, f.timeout_s)})",
    )
    b.add_argument(
        "--json", dest="json_path", metavar="PATH", help="write the results as JSON (docs/bench-schema.md)"
    )
    b.add_argument(
        "--plot",
        dest="plot_path",
        metavar="PATH.png",
        help="draw GB/s per bucket size, fastsync next to verl and the raw limit (needs matplotlib)",
    )
    b.add_argument("--quiet", action="store_true", help="no progress display on stderr")

    doc = sub.add_parser(
        "doctor",
        help="how the plugin loads into verl, hooks, transports, and the resolved fastsync config",
        description="Check this environment; overrides are Hydra-style, e.g. "
        "+actor_rollout_ref.rollout.custom.fastsync.enable=true",
    )
    doc.add_argument("overrides", nargs="*", help="Hydra-style overrides ([+|++]key=value)")
    doc.add_argument("--json", dest="json_out", action="store_true", help="print the report as JSON")
    return parser


def _bench(args: argparse.Namespace) -> int:
    from verl_fastsync.tools import bench

    if args.plot_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(
                "verl-fastsync bench: --plot needs matplotlib, which is not installed; "
                "`pip install matplotlib`, or drop --plot",
                file=sys.stderr,
            )
            return 2
    opts = bench.full_options() if args.preset == "full" else bench.BenchOptions()
    fields = ("models", "size_gib", "bucket_mib", "repeats", "heap_objects", "transports", "sections",
              "scale_sizes", "scale_pieces", "idle_s", "seed", "timeout_s")  # fmt: skip
    for name in fields:
        if getattr(args, name) is not None:
            setattr(opts, name, getattr(args, name))
    try:
        if args.extra is not None:
            opts.extra = tuple(bench.parse_config(text) for text in args.extra)
    except bench.BenchOptionError as exc:
        print(f"verl-fastsync bench: {exc}", file=sys.stderr)
        return 2
    try:
        opts.check()
    except bench.BenchOptionError as exc:
        print(f"verl-fastsync bench: {exc}", file=sys.stderr)
        return 2
    progress = bench.Progress(enabled=not args.quiet)
    result = bench.run_bench(opts, progress)
    progress.done()
    print(bench.render_table(result))
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        print(f"results written to {args.json_path}", file=sys.stderr)
    if args.plot_path:
        bench.write_plot(result, args.plot_path)
        print(f"plot written to {args.plot_path}", file=sys.stderr)
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from verl_fastsync.tools import doctor

    report = doctor.diagnose(args.overrides)
    if args.json_out:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(doctor.render(report))
    return 0 if report.get("ok") else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``verl-fastsync`` console script."""
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.command == "bench":
        return _bench(args)
    return _doctor(args)


if __name__ == "__main__":
    sys.exit(main())
