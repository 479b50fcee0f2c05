"""Runs verl's own ``python -m verl.trainer.main_ppo`` (``examples/main_ppo_cpu/run_cpu.py`` builds the
command) and records what the tests judge: exit status, wall time, verl's step metrics (its ``file``
logger, one JSON line per step), every ``/dev/shm`` name created while it ran (inotify, so a segment
that lives for milliseconds is seen too), which of the run's processes mapped which segment, and what
the run left behind (processes, segments).

The run's processes are those of its session: the launcher starts ``main_ppo`` in a new session, and
Ray's local cluster, its actors and vLLM's processes all inherit it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import importlib.util
import json
import os
import signal
import struct
import subprocess
import time
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "main_ppo_cpu" / "run_cpu.py"
SHM = Path("/dev/shm")
FASTSYNC_SHM = "verl_fastsync_"
VERL_SHM = "verl_weights_"
VLLM_PROCESS = ("VLLM::",)
"""Process names (``comm``) of vLLM's own processes (engine core, workers)."""

_IN_CREATE = 0x00000100
_IN_NONBLOCK = 0o4000
_EVENT = struct.Struct("iIII")


def example() -> ModuleType:
    """``examples/main_ppo_cpu/run_cpu.py`` as a module (the examples are not a package)."""
    spec = importlib.util.spec_from_file_location("fastsync_example_run_cpu", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _ShmCreations:
    """Names created in /dev/shm from now on (inotify ``IN_CREATE``)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self._fd = libc.inotify_init1(_IN_NONBLOCK)
        if self._fd < 0 or libc.inotify_add_watch(self._fd, str(SHM).encode(), _IN_CREATE) < 0:
            raise OSError(ctypes.get_errno(), "inotify on /dev/shm")
        self.names: set[str] = set()

    def drain(self) -> None:
        while True:
            try:
                data = os.read(self._fd, 65536)
            except BlockingIOError:
                return
            offset = 0
            while offset < len(data):
                _wd, _mask, _cookie, length = _EVENT.unpack_from(data, offset)
                start = offset + _EVENT.size
                self.names.add(data[start : start + length].split(b"\0", 1)[0].decode())
                offset = start + length

    def close(self) -> None:
        self.drain()
        os.close(self._fd)


def _session_pids(sid: int) -> dict[int, str]:
    """pid -> comm of every live process in session ``sid``."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        comm = stat[stat.find("(") + 1 : stat.rfind(")")]
        fields = stat[stat.rfind(")") + 2 :].split()
        # fields: state ppid pgrp session ...; a zombie has exited already
        if len(fields) > 3 and int(fields[3]) == sid and fields[0] != "Z":
            found[int(entry)] = comm
    return found


def _mapped(pid: int) -> set[str]:
    names: set[str] = set()
    try:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            idx = line.find("/dev/shm/")
            if idx >= 0:
                names.add(line[idx + len("/dev/shm/") :].split(" ")[0])
    except OSError:
        pass
    return names


def _owner(name: str) -> int | None:
    """The creating pid a fastsync segment carries in its name (``verl_fastsync_<pid>_<hex>``)."""
    if not name.startswith(FASTSYNC_SHM):
        return None
    head = name[len(FASTSYNC_SHM) :].split("_", 1)[0]
    return int(head) if head.isdigit() else None


@dataclasses.dataclass
class Run:
    mode: str
    returncode: int | None
    wall_s: float
    timed_out: bool
    log: Path
    steps: list[dict[str, Any]]
    created: set[str]
    """/dev/shm names created while the run lived (by anyone on the host)."""
    mapped_by: dict[str, set[str]]
    """/dev/shm name -> names (``comm``) of the run's processes seen mapping it."""
    mappers: dict[str, set[int]]
    """/dev/shm name -> pids of the run's processes seen mapping it."""
    names_of: dict[int, list[str]]
    """pid -> every name (``comm``) the process was seen under, in order (processes rename themselves:
    vLLM's to ``VLLM::...``, Ray's to ``ray::...``)."""
    run_pids: set[int]
    left_processes: dict[int, str]
    left_segments: dict[str, set[str]]
    """Segments of the run still in /dev/shm after it ended, with the processes that mapped them."""

    def log_tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def ours(self, name: str) -> bool:
        return name in self.mapped_by or _owner(name) in self.run_pids

    def mapper_names(self, name: str) -> dict[int, list[str]]:
        """pid -> every name it was seen under, for each process seen mapping segment ``name``."""
        return {pid: self.names_of.get(pid, []) for pid in sorted(self.mappers.get(name, ()))}

    def metric(self, key: str) -> list[float | None]:
        return [step["data"].get(key) for step in self.steps]

    def fastsync_keys(self) -> list[list[str]]:
        return [sorted(k for k in step["data"] if k.startswith("fastsync/")) for step in self.steps]


def run_main_ppo(mode: str, workdir: Path, steps: int, timeout_s: float) -> Run:
    """One ``main_ppo`` run of the example's ``mode``; kills whatever of it outlives ``timeout_s``."""
    argv, env = example().command(mode, workdir, steps)
    metrics = Path(env["VERL_FILE_LOGGER_PATH"])
    metrics.unlink(missing_ok=True)
    log = workdir / f"main_ppo-{mode}.log"
    before = set(os.listdir(SHM))
    watch = _ShmCreations()
    mapped_by: dict[str, set[str]] = {}
    mappers: dict[str, set[int]] = {}
    names_of: dict[int, list[str]] = {}
    run_pids: set[int] = set()
    start = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True
        )
    sid = proc.pid
    timed_out = False
    try:
        while proc.poll() is None:
            watch.drain()
            for pid, comm in _session_pids(sid).items():
                run_pids.add(pid)
                seen = names_of.setdefault(pid, [])
                if not seen or seen[-1] != comm:
                    seen.append(comm)
                for name in _mapped(pid):
                    mapped_by.setdefault(name, set()).add(comm)
                    mappers.setdefault(name, set()).add(pid)
            if time.monotonic() - start > timeout_s:
                timed_out = True
                break
            time.sleep(0.5)
    finally:
        wall = time.monotonic() - start
        if proc.poll() is None:
            os.killpg(sid, signal.SIGKILL)
            proc.wait()
        # Ray tears its cluster down when the driver exits; give it a moment, then whatever of the
        # session still lives is left behind
        deadline = time.monotonic() + 30
        left = _session_pids(sid)
        while left and time.monotonic() < deadline:
            time.sleep(1)
            left = _session_pids(sid)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        watch.close()
    now = set(os.listdir(SHM))
    run = Run(
        mode=mode,
        returncode=proc.returncode,
        wall_s=wall,
        timed_out=timed_out,
        log=log,
        steps=[json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else [],
        created=watch.names,
        mapped_by=mapped_by,
        mappers=mappers,
        names_of=names_of,
        run_pids=run_pids,
        left_processes=left,
        left_segments={},
    )
    run.left_segments = {n: mapped_by.get(n, set()) for n in sorted(now - before) if run.ours(n)}
    return run


def is_vllm_message_queue(mappers: dict[int, list[str]]) -> bool:
    """A segment only vLLM's own processes mapped (``mappers``: pid -> the names it was seen under, as
    :meth:`Run.mapper_names` gives them): its shared-memory message queues (``psm_*``, 160 and 240 MiB),
    unlinked in a destructor that never runs when Ray kills the engine at the end of ``main_ppo``.
    Stock verl leaves the same two per vLLM engine. A process is judged by its last name: vLLM's start
    as ``python`` and rename themselves, and a sample can read the old name and the new mapping."""
    return bool(mappers) and all(names and names[-1].startswith(VLLM_PROCESS) for names in mappers.values())


def remove(names: list[str]) -> None:
    for name in names:
        try:
            (SHM / name).unlink()
        except FileNotFoundError:
            pass
