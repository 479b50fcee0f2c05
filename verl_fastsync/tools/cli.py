"""The ``verl-fastsync`` console script: ``bench`` and ``doctor``.

Exit status: 0 when the run completed (``bench``: a ``failed`` row is a result, not an error) or
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


def build_parser() -> argparse.ArgumentParser:
    from verl_fastsync.tools import bench
    from verl_fastsync.tools.models import PRESETS

    d = bench.BenchOptions()
    parser = argparse.ArgumentParser(prog="verl-fastsync", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser(
        "bench",
        help="cleanup policies, transports and scaling side by side, against stock verl",
        description=(bench.__doc__ or "").split("\n\n")[0],
    )
    b.add_argument(
        "--model",
        dest="models",
        type=_csv(str, "--model"),
        default=d.models,
        help=f"model presets, comma-separated (default {','.join(d.models)}; allowed {','.join(PRESETS)})",
    )
    b.add_argument(
        "--size-gib", type=float, default=d.size_gib, help=f"model size in GiB (default {d.size_gib})"
    )
    b.add_argument(
        "--bucket-mib",
        type=_csv(int, "--bucket-mib"),
        default=d.bucket_mib,
        help=f"bucket sizes in MiB, comma-separated (default {','.join(map(str, d.bucket_mib))})",
    )
    b.add_argument(
        "--repeats",
        type=int,
        default=d.repeats,
        help=f"timed repeats per measurement, after an untimed warm-up run (default {d.repeats})",
    )
    b.add_argument(
        "--heap-objects",
        type=int,
        default=d.heap_objects,
        help=f"GC-tracked objects in the cleanup child's heap (default {d.heap_objects:,})",
    )
    b.add_argument(
        "--transports",
        type=_csv(str, "--transports"),
        default=None,
        help="transports to run, comma-separated (default: every one this host can run)",
    )
    b.add_argument(
        "--sections",
        type=_csv(str, "--sections"),
        default=d.sections,
        help=f"sections to run (default {','.join(d.sections)})",
    )
    b.add_argument(
        "--scale-sizes",
        type=_csv(float, "--scale-sizes"),
        default=d.scale_sizes,
        help="scale section: model sizes as multiples of --size-gib (default "
        f"{','.join(map(str, d.scale_sizes))})",
    )
    b.add_argument(
        "--scale-pieces",
        type=_csv(int, "--scale-pieces"),
        default=d.scale_pieces,
        help="scale section: tensor-count multipliers at equal bytes (default "
        f"{','.join(map(str, d.scale_pieces))})",
    )
    b.add_argument("--seed", type=int, default=d.seed)
    b.add_argument(
        "--timeout",
        dest="timeout_s",
        type=float,
        default=d.timeout_s,
        help=f"seconds any child process or transfer may take (default {d.timeout_s:g})",
    )
    b.add_argument(
        "--json", dest="json_path", metavar="PATH", help="write the results as JSON (docs/bench-schema.md)"
    )
    b.add_argument(
        "--plot",
        dest="plot_path",
        metavar="PATH.png",
        help="draw GB/s and peak memory against bucket size per transport (needs matplotlib)",
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
                "`pip install matplotlib` (or verl-fastsync[plot]), or drop --plot",
                file=sys.stderr,
            )
            return 2
    opts = bench.BenchOptions(
        models=args.models,
        size_gib=args.size_gib,
        bucket_mib=args.bucket_mib,
        repeats=args.repeats,
        heap_objects=args.heap_objects,
        transports=args.transports,
        sections=args.sections,
        scale_sizes=args.scale_sizes,
        scale_pieces=args.scale_pieces,
        seed=args.seed,
        timeout_s=args.timeout_s,
    )
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
