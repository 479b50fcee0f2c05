"""``limits.host_memory_available`` inside a memory cgroup: a container's limit, not the host's
``MemAvailable``, is where the kernel kills. Checked in a real cgroup (created here, when this
machine lets a test make one) and on cgroup trees laid out as the kernel shows them (v2 with and
without a cgroup namespace, v1, nested limits), since a test machine has only one of those."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from _cgroups import memory_cgroup  # type: ignore[import-not-found]

from verl_fastsync import limits

MIB = 1 << 20


@pytest.fixture
def limited_cgroup() -> Iterator[tuple[str, int, int]]:
    """A new child of this process's memory cgroup limited to 512 MiB: (directory, version, limit)."""
    with memory_cgroup(512 * MIB) as (directory, version):
        yield directory, version, 512 * MIB


def test_a_process_in_a_limited_cgroup_sees_the_limit_not_the_host(
    limited_cgroup: tuple[str, int, int],
) -> None:
    directory, _version, limit = limited_cgroup
    child = textwrap.dedent(
        f"""
        import json, os
        from pathlib import Path
        Path({directory!r}, "cgroup.procs").write_text(str(os.getpid()))
        from verl_fastsync import limits
        before = limits.host_memory_available()
        cgroup = limits.cgroup_memory_available()
        held = bytearray(200 << 20)
        for at in range(0, len(held), 4096):
            held[at] = 1
        after = limits.host_memory_available()
        print(json.dumps({{"before": before, "cgroup": cgroup, "after": after}}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    seen = json.loads(out.strip().splitlines()[-1])
    host = Path("/proc/meminfo").read_text()
    assert limit < int(host.split("MemTotal:")[1].split()[0]) * 1024  # (else the test proves nothing)
    # the interpreter itself is charged to the group: less than the limit, not by much; the two
    # reads came a moment apart (the process allocates in between: 248 KiB once, on a busy host)
    assert limit - 128 * MIB < seen["before"] <= limit and limit - 128 * MIB < seen["cgroup"] <= limit, seen
    assert abs(seen["before"] - seen["cgroup"]) < 4 * MIB, seen
    # 200 MiB touched: what is left shrinks by that much
    assert 150 * MIB < seen["before"] - seen["after"] < 260 * MIB, seen


def _tree(tmp_path: Path, cgroup: str, mountinfo: list[str]) -> str:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text("\n".join(mountinfo) + "\n")
    return str(proc)


def _group(directory: Path, version: int, limit: str, usage: int, inactive: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    if version == 2:
        (directory / "memory.max").write_text(limit + "\n")
        (directory / "memory.current").write_text(f"{usage}\n")
        (directory / "memory.stat").write_text(f"anon 1\nfile 5\ninactive_file {inactive}\nactive_file 3\n")
    else:
        (directory / "memory.limit_in_bytes").write_text(limit + "\n")
        (directory / "memory.usage_in_bytes").write_text(f"{usage}\n")
        (directory / "memory.stat").write_text(
            f"cache 1\ninactive_file 999999\ntotal_cache 5\ntotal_inactive_file {inactive}\n"
        )


def test_cgroup_v2_nested_limits_take_the_least(tmp_path: Path) -> None:
    mnt = tmp_path / "sys"
    proc = _tree(
        tmp_path,
        "0::/kubepods/pod1/ctr\n",
        [f"41 23 0:38 / {mnt} rw,relatime - cgroup2 cgroup2 rw", "31 23 0:28 / /tmp rw - tmpfs tmpfs rw"],
    )
    _group(mnt, 2, "max", 0, 0)  # the root: no limit
    _group(mnt / "kubepods", 2, "max", 0, 0)
    _group(mnt / "kubepods" / "pod1", 2, str(1000 * MIB), 900 * MIB, 50 * MIB)  # 150 MiB left
    _group(mnt / "kubepods" / "pod1" / "ctr", 2, str(800 * MIB), 500 * MIB, 20 * MIB)  # 320 MiB left
    assert limits.cgroup_memory_available(proc) == 150 * MIB
    _group(mnt / "kubepods" / "pod1", 2, "max", 900 * MIB, 50 * MIB)
    assert limits.cgroup_memory_available(proc) == 320 * MIB
    _group(mnt / "kubepods" / "pod1" / "ctr", 2, "max", 500 * MIB, 20 * MIB)
    assert limits.cgroup_memory_available(proc) is None  # nothing limits it


def test_cgroup_v2_in_a_cgroup_namespace(tmp_path: Path) -> None:
    """Inside a container with its own cgroup namespace the process's cgroup reads "/" and the
    container's group is mounted as the root of /sys/fs/cgroup."""
    mnt = tmp_path / "sys"
    proc = _tree(tmp_path, "0::/\n", [f"900 800 0:30 / {mnt} ro,nosuid - cgroup2 cgroup2 rw,nsdelegate"])
    _group(mnt, 2, str(2048 * MIB), 2100 * MIB, 10 * MIB)  # over the limit: nothing left, not negative
    assert limits.cgroup_memory_available(proc) == 0


def test_cgroup_v1_memory_hierarchy_and_other_mounts(tmp_path: Path) -> None:
    memory, cpu = tmp_path / "memory", tmp_path / "cpu"
    proc = _tree(
        tmp_path,
        "5:cpu,cpuacct:/other\n4:memory:/job/7\n0::/\n",
        [
            f"32 31 0:29 / {cpu} rw,relatime - cgroup cgroup rw,cpu,cpuacct",
            f"35 31 0:32 / {memory} rw,relatime - cgroup cgroup rw,memory",
        ],
    )
    _group(cpu / "other", 1, str(MIB), 0, 0)  # (not a memory controller: ignored)
    _group(memory, 1, "9223372036854771712", 0, 0)  # v1's "no limit"
    _group(memory / "job", 1, "9223372036854771712", 0, 0)
    _group(memory / "job" / "7", 1, str(4096 * MIB), 3000 * MIB, 200 * MIB)
    assert limits.cgroup_memory_available(proc) == (4096 - 3000 + 200) * MIB


def test_a_mount_of_another_subtree_or_no_cgroup_files_means_no_limit(tmp_path: Path) -> None:
    mnt = tmp_path / "sys"
    proc = _tree(tmp_path, "4:memory:/job/7\n", [f"35 31 0:32 /elsewhere {mnt} rw - cgroup cgroup rw,memory"])
    _group(mnt, 1, str(MIB), 0, 0)
    assert limits.cgroup_memory_available(proc) is None  # the mount shows another part of the tree
    assert limits.cgroup_memory_available(str(tmp_path / "missing")) is None
    proc2 = tmp_path / "p2"
    proc2.mkdir()
    (proc2 / "cgroup").write_text("0::/a\n")
    (proc2 / "mountinfo").write_text(f"41 23 0:38 / {tmp_path / 'empty'} rw - cgroup2 cgroup2 rw\n")
    assert limits.cgroup_memory_available(str(proc2)) is None  # no memory.max anywhere


def test_host_memory_available_is_the_smaller_of_host_and_cgroup(monkeypatch: pytest.MonkeyPatch) -> None:
    host = limits.meminfo_available()
    monkeypatch.setattr(limits, "cgroup_memory_available", lambda proc="/proc/self": 123 * MIB)
    assert limits.host_memory_available() == min(host, 123 * MIB)
    monkeypatch.setattr(limits, "cgroup_memory_available", lambda proc="/proc/self": None)
    assert abs(limits.host_memory_available() - host) < 512 * MIB
