"""Simulated hosts of the fanout bench are hosts for a shared-memory check: each has its own
``/dev/shm`` (:class:`~verl_fastsync.tools.netns_shm.ShmHosts`), shared by its ranks whatever their
network namespaces and by no other host's; everything is unmounted and removed on close, on a failed
open, and after a killed creator."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
from _shm_peer import peek

from verl_fastsync.tools import netns_shm
from verl_fastsync.tools.netns_shm import SHM_ROOT, ShmHosts
from verl_fastsync.tools.netns_star import NamespaceStar

REASON = netns_shm.unavailable_reason()
needs_shm_hosts = pytest.mark.skipif(
    REASON is not None, reason=f"simulated hosts with their own /dev/shm unavailable: {REASON}"
)

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
ENV = {"PYTHONPATH": os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")])}
HERE = "_shm_peer"
CALL_S = 120.0


# -- tests ------------------------------------------------------------------------------------------


def _mounts() -> str:
    with open("/proc/self/mountinfo") as fh:
        return "".join(line for line in fh if SHM_ROOT in line or "fastsync-shm" in line)


@needs_shm_hosts
@pytest.mark.timeout(300)
def test_ranks_of_one_host_share_its_dev_shm_and_no_other_hosts() -> None:
    """Host 0's ranks in two network namespaces (link per rank: one hostname, each resolving it to its
    own link) and in one (link per host) see each other's file; host 1's rank and this machine do
    not, and host 1's file stays on host 1."""
    marker = f"fanout-hosts-{os.getpid()}"
    with NamespaceStar(3, switch=True) as star, ShmHosts(2, 16) as hosts:
        name = f"{star.prefix}-{star.token}-host0"
        a = star.spawn(star.leaves[0], ENV, mount_ns=hosts.path(0), hostname=name)
        b = star.spawn(star.leaves[1], ENV, mount_ns=hosts.path(0), hostname=name)  # same host, other netns
        a2 = star.spawn(star.leaves[0], ENV, mount_ns=hosts.path(0))  # same host, same netns
        c = star.spawn(star.leaves[2], ENV, mount_ns=hosts.path(1))  # another host
        # one host's name, resolved by each rank to its own link's address (a NIC per GPU)
        assert a.call(f"{HERE}:whoami", {}, CALL_S) == [name, star.leaves[0].addr]
        assert b.call(f"{HERE}:whoami", {}, CALL_S) == [name, star.leaves[1].addr]
        a.call(f"{HERE}:put", {"name": marker, "text": "host 0"}, CALL_S)
        assert b.call(f"{HERE}:peek", {"name": marker}, CALL_S) == "host 0"
        assert a2.call(f"{HERE}:peek", {"name": marker}, CALL_S) == "host 0"
        assert c.call(f"{HERE}:peek", {"name": marker}, CALL_S) is None
        assert peek(marker) is None  # nothing reached this machine's /dev/shm
        c.call(f"{HERE}:put", {"name": marker, "text": "host 1"}, CALL_S)
        assert c.call(f"{HERE}:peek", {"name": marker}, CALL_S) == "host 1"
        assert b.call(f"{HERE}:peek", {"name": marker}, CALL_S) == "host 0"
        folder = hosts.dir
        assert folder in _mounts()
    assert not os.path.exists(folder) and folder not in _mounts()


@needs_shm_hosts
@pytest.mark.timeout(120)
def test_a_failed_open_leaves_nothing() -> None:
    """A tmpfs mount that fails (a size ``mount`` refuses) ends the open with the reason and removes
    what was made before it."""
    hosts = ShmHosts(2, 1)
    hosts.size_mib = "lots"  # type: ignore[assignment]  # only mount itself can refuse it
    with pytest.raises(RuntimeError, match="mount -t tmpfs"):
        hosts.open()
    assert not os.path.exists(hosts.dir) and hosts.dir not in _mounts()


@needs_shm_hosts
@pytest.mark.timeout(120)
def test_what_a_killed_creator_left_is_swept_by_the_next_open() -> None:
    code = textwrap.dedent(
        """
        import sys, time
        from verl_fastsync.tools.netns_shm import ShmHosts
        hosts = ShmHosts(2, 4).open()
        print(hosts.dir, flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env={**os.environ, **ENV}
    )
    try:
        assert proc.stdout is not None
        folder = proc.stdout.readline().strip()
        assert folder.startswith(SHM_ROOT) and os.path.isdir(folder)
    finally:
        proc.kill()  # no clean-up can run
        proc.wait(timeout=60)
    assert folder in _mounts()
    deadline = time.monotonic() + 30
    while folder in _mounts() and time.monotonic() < deadline:
        with ShmHosts(1, 1):
            pass
    assert not os.path.exists(folder) and folder not in _mounts()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match=r"hosts must be an int in \[1, 64\]"):
        ShmHosts(0, 8)
    with pytest.raises(ValueError, match="size_mib must be a positive int"):
        ShmHosts(1, 0)
    with pytest.raises(RuntimeError, match="before open"):
        ShmHosts(1, 8).path(0)
