"""The transfer, idle and scale sections: a pair of worker processes (:mod:`.worker`) moves a
synthetic model (:mod:`verl_fastsync.tools.models`) through each path, next to verl's path and the
raw mechanism for the same bytes, in the same run.

Each (path, model, size, bucket) is measured once per run: an untimed warm-up sync that also checks
the received bytes (the destination starts zeroed), then ``repeats`` timed syncs. The scale section
reuses a measurement the transfer section already made instead of measuring it again.
"""

from __future__ import annotations

import dataclasses
import functools
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

from verl_fastsync.tools.bench.baselines import NIXL_SHIMS
from verl_fastsync.tools.bench.measure import memcpy_seconds
from verl_fastsync.tools.bench.options import CPU_TRANSPORTS, GIB, GPU_TRANSPORTS, MIB, BenchOptions
from verl_fastsync.tools.bench.protocol import Child, free_port
from verl_fastsync.tools.bench.schema import ERROR, NOT_AVAILABLE, fill_ratios, make_row
from verl_fastsync.tools.bench.worker import available_transports

MEMCPY = "memcpy"
MEMCPY_PAIR = "memcpy both procs"
RAW_GLOO = "raw gloo broadcast"
RAW_NIXL = "raw nixl WRITE"


@dataclasses.dataclass(frozen=True)
class Path:
    """What a row runs: its label, provenance (``kind``), harness and same-run baseline."""

    impl: str
    label: str
    kind: str
    path: str
    baseline: str | None
    note: str
    copies: str = ""
    """Passes over every byte on this path (the limit next to its ratio); empty: not stated."""


def paths_for(transport: str) -> list[Path]:
    """Every path measured for ``transport``: fastsync's, verl's (labelled), the raw mechanism."""
    wire = {"shm": "", "gloo": " + gloo's socket copies", "nixl": " + the NIXL WRITE"}.get(
        transport, " + the transport"
    )
    fs_engine = Path(
        "fastsync-engine", f"fastsync engine {transport}", "fastsync", "engine", None,
        "verl_fastsync engine transport, verl's lifecycle per sync (prepare, build_topology, "
        "init_process_group, send/receive, finalize)",
        f"2: pack (sender), load (consumer){wire}; the receiver lends its buckets (no copy out)",
    )  # fmt: skip
    if transport == "shm":
        return [
            Path("raw-memcpy-pair", MEMCPY_PAIR, "raw", "raw", MEMCPY,
                 "both bench processes copy the same bytes at the same time through a warm bucket "
                 "(sender: weights -> bucket, receiver: bucket -> weights)",
                 "2, one in each process, at once: the floor of a path that packs and loads"),
            Path("fastsync-colocated", "fastsync colocated shm", "fastsync", "colocated", MEMCPY,
                 "verl_fastsync.colocated ColocatedSender/Receiver", "2: pack (sender), load (consumer)"),
            Path("verl-colocated", "verl colocated shm", "verl-stand-in", "colocated", MEMCPY,
                 "verl's BucketedWeightSender/Receiver(use_shm=True) with a CPU device module "
                 "standing in for the accelerator"),
            dataclasses.replace(fs_engine, baseline=MEMCPY),
            Path("fastsync-engine-zero-copy", "fastsync engine shm zc", "fastsync", "engine",
                 "fastsync engine shm",
                 "the same with engine_kwargs.fastsync.zero_copy=true (opt-in: tensors are views into "
                 "the bucket, valid until the next is requested); x baseline = what the safe default "
                 "(lent buckets: 'default') costs", "2: pack (sender), load (consumer)"),
            Path("fastsync-engine-two-slots", "fastsync engine shm 2slot", "fastsync", "engine",
                 "fastsync engine shm",
                 "the same with engine_kwargs.fastsync.slots=2 (the default is 3); x baseline = what "
                 "the third slot buys over uneven buckets", "2: pack (sender), load (consumer)"),
        ]  # fmt: skip
    if transport == "gloo":
        return [
            dataclasses.replace(fs_engine, baseline=RAW_GLOO),
            Path("verl-gloo", "verl gloo split/merge", "verl-reconstruction", "engine", RAW_GLOO,
                 "verl has no gloo engine: verl's split_weight_chunks/merge_weight_chunks (its "
                 "engines' bucketing, 0.8.0+) driven over a gloo broadcast by the bench"),
            Path("raw-gloo", RAW_GLOO, "raw", "raw", MEMCPY,
                 "torch.distributed.broadcast of the same bytes between the same two processes",
                 "0 (gloo's socket copies only: no pack, no load)"),
        ]  # fmt: skip
    if transport == "nixl":
        return [
            dataclasses.replace(fs_engine, baseline=RAW_NIXL),
            Path("verl-nixl", "verl nixl engine+shims", "verl", "engine", RAW_NIXL,
                 f"verl's NIXLCheckpointEngine(device='cpu'), {NIXL_SHIMS}"),
            Path("raw-nixl", RAW_NIXL, "raw", "raw", MEMCPY,
                 "NIXL WRITE (UCX, DRAM) of the same bytes between two agents in the same two processes",
                 "0 (the WRITE only: no pack, no load)"),
        ]  # fmt: skip
    if transport == "nccl":
        return [
            fs_engine,
            Path("verl-nccl", "verl nccl engine", "verl", "engine", None, "verl's NCCLCheckpointEngine"),
        ]
    if transport == "ipc":
        return [Path("fastsync-colocated", "fastsync colocated ipc", "fastsync", "colocated", None,
                     "verl_fastsync.colocated over CUDA IPC")]  # fmt: skip
    return [fs_engine]  # a third-party engine transport


@dataclasses.dataclass(frozen=True)
class Trial:
    transport: str
    p: Path
    model: str
    size_bytes: int
    bucket_bytes: int
    pieces: int = 1

    def describe(self) -> str:
        x = f" x{self.pieces}" if self.pieces > 1 else ""
        return (
            f"{self.p.label}, {self.model} {self.size_bytes / MIB:.0f} MiB{x}, "
            f"bucket {self.bucket_bytes // MIB} MiB"
        )


def _unavailable(trial: Trial, has_cuda: bool) -> str | None:
    """Why this host cannot run the trial at all (None: try it)."""
    if trial.transport in GPU_TRANSPORTS and not has_cuda:
        return NOT_AVAILABLE + "needs CUDA (torch.cuda.is_available() is False)"
    if trial.p.impl == "verl-nccl":
        return NOT_AVAILABLE + "the bench does not drive verl's NCCL engine (it needs Ray collective groups)"
    if trial.p.impl.startswith("fastsync-engine") and trial.transport not in available_transports("engine"):
        return NOT_AVAILABLE + f"no fastsync engine transport {trial.transport!r} is registered on this host"
    if trial.p.impl == "fastsync-colocated" and trial.transport not in available_transports("colocated"):
        return (
            NOT_AVAILABLE + f"no fastsync colocated transport {trial.transport!r} is registered on this host"
        )
    return None


class WorkerPair:
    """A sender and a receiver process, reused across trials (models are built once)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.sender: Child | None = None
        self.receiver: Child | None = None
        self.gloo_port = free_port()

    def _ensure(self) -> tuple[Child, Child]:
        if self.sender is None or self.sender.proc.poll() is not None:
            self.sender = Child(["_worker", "sender"], self.timeout_s)
            self.sender.recv()
        if self.receiver is None or self.receiver.proc.poll() is not None:
            self.receiver = Child(["_worker", "receiver"], self.timeout_s)
            self.receiver.recv()
        return self.sender, self.receiver

    def _both(
        self, cmd_r: dict[str, Any], cmd_s: dict[str, Any], world: bool = False
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Send a command to both workers and wait for both answers. When one fails while the other
        still waits for it, the other is told to abandon its transfer (or, for ``world`` paths that
        share a gloo default group a failure leaves unusable, both processes are replaced)."""

        sender, receiver = self._ensure()
        receiver.send(cmd_r)
        sender.send(cmd_s)
        answers: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + self.timeout_s
        children = {"s": sender, "r": receiver}
        while len(answers) < 2:
            for key, child in children.items():
                if key not in answers:
                    msg = child.try_recv()
                    if msg is not None:
                        answers[key] = msg
            failed = [a for a in answers.values() if not a["ok"]]
            if failed and len(answers) < 2:
                other = children["r" if "s" in answers else "s"]
                if world:
                    self.reset()
                else:
                    other.send({"op": "abandon"})
                    while other.recv().get("event") != "abandon":
                        pass  # a result that raced the abandon
                return failed[0], failed[0]
            if len(answers) < 2:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"workers gave no answer to {cmd_s.get('op')!r} in {self.timeout_s:.0f} s"
                    )
                (receiver if "r" not in answers else sender).wait_any(0.05)
        return answers["s"], answers["r"]

    def preload(self, impls: list[str]) -> None:
        """Start both workers and let them import what the trials need (not waited for here)."""
        for child in self._ensure():
            child.send({"op": "preload", "impls": impls})
        self.preloading = True

    def wait_preload(self) -> None:
        if getattr(self, "preloading", False):
            self.preloading = False
            for child in self._ensure():
                child.recv()

    def sync(self, payload: dict[str, Any]) -> dict[str, Any]:
        """One sync of the trial in ``payload``: setup, connect, timed transfer, teardown."""
        world = payload["impl"] in ("verl-gloo", "raw-gloo")
        s, r = self._both({"op": "prepare", "trial": payload}, {"op": "prepare", "trial": payload}, world)
        for answer in (s, r):
            if not answer["ok"]:
                return answer
        metas = [s["meta"], r["meta"]]
        s, r = self._both({"op": "init", "metas": metas}, {"op": "init", "metas": metas}, world)
        for answer in (s, r):
            if not answer["ok"]:
                return answer
        together = payload["impl"] == "raw-memcpy-pair"
        if together:  # both copy at the same instant (CLOCK_MONOTONIC is system-wide), until both end
            payload = {**payload, "start_at": time.perf_counter() + 0.2}
        s, r = self._both({"op": "run", "trial": payload}, {"op": "run", "trial": payload}, world)
        for answer in (s, r):
            if not answer["ok"]:
                return answer
        seconds = max(s["t_end"], r["t_end"]) - payload["start_at"] if together else r["t_end"] - s["t_start"]
        return {
            "ok": True,
            "seconds": seconds,
            "peak_sender": s["peak_extra_bytes"],
            "peak_receiver": r["peak_extra_bytes"],
            "verified": (s.get("fingerprint") == r.get("fingerprint")) if payload["verify"] else None,
            "setup_seconds": max(s.get("setup_seconds") or 0.0, r.get("setup_seconds") or 0.0),
            "transport_peak_sender": s.get("transport_peak_bytes"),
            "transport_peak_receiver": r.get("transport_peak_bytes"),
        }

    def idle(self, seconds: float) -> dict[str, Any]:
        s, r = self._both({"op": "idle", "seconds": seconds}, {"op": "idle", "seconds": seconds})
        if not (s["ok"] and r["ok"]):
            return s if not s["ok"] else r
        wall = max(s["wall_seconds"], r["wall_seconds"])
        return {"ok": True, "cpu_seconds": s["cpu_seconds"] + r["cpu_seconds"], "wall_seconds": wall}

    def end_trial(self) -> None:
        if self.sender is not None and self.receiver is not None:
            self._both({"op": "end"}, {"op": "end"})

    def reset(self) -> None:
        """Replace both processes (after a failure one of them may be blocked on the other)."""
        for child in (self.sender, self.receiver):
            if child is not None:
                child.kill()
        self.sender = self.receiver = None
        self.gloo_port = free_port()

    def close(self) -> None:
        for child in (self.sender, self.receiver):
            if child is not None:
                child.close()


class Runner:
    """Runs trials on one worker pair and remembers every measurement of the run (by trial)."""

    def __init__(self, opts: BenchOptions, progress: Callable[[str], None], device: str = "cpu") -> None:
        import torch

        self.opts, self.progress, self.device = opts, progress, device
        self.has_cuda = torch.cuda.is_available()
        self.pair = WorkerPair(opts.timeout_s)
        self.measured: dict[Trial, dict[str, Any]] = {}

    def preload(self) -> None:
        impls = sorted({p.impl for t in wanted_transports(self.opts) for p in paths_for(t)})
        self.progress("starting the transfer workers (importing verl's modules)")
        self.pair.preload(impls)

    def payload(self, trial: Trial, trial_id: str, zmq: str, verify: bool) -> dict[str, Any]:
        return {
            "id": trial_id, "impl": trial.p.impl, "transport": trial.transport, "model": trial.model,
            "size_bytes": trial.size_bytes, "bucket_bytes": trial.bucket_bytes, "pieces": trial.pieces,
            "seed": self.opts.seed, "zmq": zmq, "timeout_s": self.opts.timeout_s, "device": self.device,
            "verify": verify, "gloo_port": self.pair.gloo_port,
        }  # fmt: skip

    def _call(self, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        try:
            return fn()
        except (TimeoutError, RuntimeError) as exc:
            self.pair.close()
            self.pair = WorkerPair(self.opts.timeout_s)
            return {"ok": False, "error": str(exc)}

    def row(self, trial: Trial, idle_s: float | None = None) -> dict[str, Any]:
        """The trial's row (measured now, or the measurement already made in this run)."""
        if trial in self.measured and idle_s is None:
            return dict(self.measured[trial])
        why = _unavailable(trial, self.has_cuda)
        timed: list[dict[str, Any]] = []
        verified: bool | None = None
        idle: dict[str, Any] | None = None
        if why is None:
            trial_id = uuid.uuid4().hex[:12]
            # one socket path per trial, reused by its syncs (as a trainer reuses it every sync)
            zmq = f"ipc://{tempfile.gettempdir()}/verl-fastsync-bench-{trial_id}.sock"
            reps = 1 if idle_s is not None else self.opts.repeats + 1
            for rep in range(reps):
                what = f"repeat {rep}/{self.opts.repeats}" if rep else "warm-up + byte check"
                self.progress(f"{'idle' if idle_s else 'transfer'}: {trial.describe()}, {what}")
                payload = self.payload(trial, trial_id, zmq, verify=rep == 0 and trial.p.path != "raw")
                res = self._call(functools.partial(self.pair.sync, payload))
                if not res["ok"]:
                    err = str(res["error"])
                    why = err if err.startswith(NOT_AVAILABLE) else ERROR + err
                    break  # failures here are deterministic (e.g. verl: a tensor larger than the bucket)
                if res["verified"] is not None:
                    verified = res["verified"]
                    if not verified:
                        why = ERROR + "received bytes differ from the sent model"
                        break
                if rep:
                    timed.append(res)
            if why is None and idle_s is not None:
                self.progress(f"idle: {trial.p.label}, {idle_s:g} s")
                idle = self._call(lambda: self.pair.idle(idle_s))
                if not idle["ok"]:
                    why = ERROR + str(idle["error"])
            if why is None or self.pair.sender is not None:
                self._call(self._end_trial)
        row = self._make_row(trial, why, timed, verified)
        if idle is not None and idle.get("ok"):
            row["idle_cpu_seconds"] = idle["cpu_seconds"]
            row["idle_wall_seconds"] = idle["wall_seconds"]
        if idle_s is None:
            self.measured[trial] = row
        return dict(row)

    def _end_trial(self) -> dict[str, Any]:
        self.pair.end_trial()
        return {"ok": True}

    def _make_row(
        self, trial: Trial, why: str | None, timed: list[dict[str, Any]], verified: bool | None
    ) -> dict[str, Any]:
        from verl_fastsync.tools.models import model_spec, split_spec

        spec = model_spec(trial.model, trial.size_bytes)
        if trial.pieces > 1:
            spec = split_spec(spec, trial.pieces)
        seconds = [t["seconds"] for t in timed]
        status = why or "ok"
        row = make_row(
            trial.p.label, trial.p.kind, trial.transport, seconds if status == "ok" else [], spec.nbytes,
            status, trial.p.baseline, trial.p.note,
            model=trial.model, bucket_bytes=trial.bucket_bytes, path=trial.p.path, copies=trial.p.copies,
            tensor_count=len(spec.tensors), largest_tensor_bytes=spec.largest_tensor_bytes,
            verified=verified if status == "ok" else None,
        )  # fmt: skip
        ok = status == "ok" and bool(timed)

        def most(key: str) -> int | None:
            values = [t[key] for t in timed if t.get(key) is not None]
            return max(values) if ok and values else None

        row["gbps"] = spec.nbytes / row["median_s"] / 1e9 if ok and row["median_s"] else None
        row["peak_sender_bytes"] = most("peak_sender")
        row["peak_receiver_bytes"] = most("peak_receiver")
        if trial.p.impl.startswith("fastsync-engine") and ok:
            import statistics

            row["setup_seconds"] = statistics.median(t["setup_seconds"] for t in timed)
            row["transport_peak_sender_bytes"] = most("transport_peak_sender")
            row["transport_peak_receiver_bytes"] = most("transport_peak_receiver")
        return row

    def close(self) -> None:
        self.pair.close()


def wanted_transports(opts: BenchOptions) -> tuple[str, ...]:
    return opts.transports or (CPU_TRANSPORTS + GPU_TRANSPORTS)


def memcpy_row(model: str, size_bytes: int, repeats: int, bucket_bytes: int | None = None) -> dict[str, Any]:
    from verl_fastsync.tools.models import model_spec

    spec = model_spec(model, size_bytes)
    seconds = memcpy_seconds(spec.nbytes, repeats)
    row = make_row(
        MEMCPY, "raw", "memory", seconds, spec.nbytes, "ok", None,
        "torch.Tensor.copy_ of the same bytes in this process (256 MiB pieces), one transfer "
        "process's thread count",
        model=model, bucket_bytes=bucket_bytes, path="raw", tensor_count=len(spec.tensors),
        largest_tensor_bytes=spec.largest_tensor_bytes, verified=None,
        peak_sender_bytes=None, peak_receiver_bytes=None,
    )  # fmt: skip
    row["gbps"] = spec.nbytes / row["median_s"] / 1e9 if row["median_s"] else None
    return row


def run_transfer_section(runner: Runner) -> list[dict[str, Any]]:
    opts = runner.opts
    rows: list[dict[str, Any]] = []
    memcpy_done: set[tuple[str, int]] = set()
    for model, size_gib, bucket_mib in opts.configs():
        size = int(size_gib * GIB)
        if (model, size) not in memcpy_done:
            runner.progress(f"transfer: memcpy of {model} {size / MIB:.0f} MiB")
            rows.append(memcpy_row(model, size, opts.repeats))
            memcpy_done.add((model, size))
        for transport in wanted_transports(opts):
            for p in paths_for(transport):
                rows.append(runner.row(Trial(transport, p, model, size, bucket_mib * MIB)))
    fill_ratios(rows)
    return rows


def run_idle_section(runner: Runner) -> list[dict[str, Any]]:
    """CPU seconds per idle minute of each path's two processes, after one sync, with the path's
    resources alive (what a rollout engine sharing the host pays between syncs)."""
    opts = runner.opts
    model = opts.models[0] if opts.models else "moe-small"
    size, bucket = min(int(opts.size_gib * GIB), 32 * MIB), 16 * MIB
    floor = Path(
        "none", "bench workers alone", "raw", "raw", None, "the two worker processes with no transport"
    )
    runner.progress(f"idle: {floor.label}, {opts.idle_s:g} s")
    res = runner._call(lambda: runner.pair.idle(opts.idle_s))
    rows = [
        _idle_row(floor, "-", res if res["ok"] else None, opts.idle_s, None if res["ok"] else res["error"])
    ]
    for transport in wanted_transports(opts):
        for p in paths_for(transport):
            if p.path == "raw" or p.impl in ("verl-gloo", "verl-colocated"):
                continue  # nothing of these lives between syncs (verl makes its sender per update)
            row = runner.row(Trial(transport, p, model, size, bucket), idle_s=opts.idle_s)
            idle = {"cpu_seconds": row["idle_cpu_seconds"], "wall_seconds": row["idle_wall_seconds"]} if (
                row["status"] == "ok") else None  # fmt: skip
            rows.append(_idle_row(p, transport, idle, opts.idle_s, None if idle else row["status"]))
    return rows


def _idle_row(
    p: Path, transport: str, idle: dict[str, Any] | None, window: float, why: str | None
) -> dict[str, Any]:
    status = "ok" if idle else (why if why and why.startswith((NOT_AVAILABLE, ERROR)) else ERROR + str(why))
    per_min = idle["cpu_seconds"] / idle["wall_seconds"] * 60 if idle else None
    return make_row(
        p.label, p.kind, transport, [], None, status, None,
        p.note + "; CPU seconds of both processes (user + system, every thread) over the idle window",
        cpu_seconds_per_minute=per_min, idle_seconds=window,
    )  # fmt: skip


def run_scale_section(runner: Runner, transfer_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Seconds against model bytes and against tensor count (equal bytes), for the fastest working
    fastsync path and verl's colocated path, first preset, largest bucket."""
    opts = runner.opts
    model, bucket, size = opts.models[0], max(opts.bucket_mib) * MIB, int(opts.size_gib * GIB)
    ok = [
        r
        for r in transfer_rows
        if r["status"] == "ok" and r["model"] == model and r["bucket_bytes"] == bucket
    ]
    fast = [r for r in ok if r["kind"] == "fastsync"]
    chosen = [min(fast, key=lambda r: r["median_s"])["row"]] if fast else ["fastsync colocated shm"]
    chosen.append("verl colocated shm")
    rows = []
    for transport in wanted_transports(opts):
        for p in paths_for(transport):
            if p.label not in chosen:
                continue
            for f in opts.scale_sizes:
                rows.append(
                    {"axis": "model_bytes", **runner.row(Trial(transport, p, model, int(size * f), bucket))}
                )
            for n in opts.scale_pieces:
                rows.append(
                    {"axis": "tensor_count", **runner.row(Trial(transport, p, model, size, bucket, n))}
                )
    return rows
