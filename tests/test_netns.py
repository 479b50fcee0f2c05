"""Simulated hosts: namespaces are made and always deleted, addresses exist only inside them, and
the JSON-lines worker protocol reports results, errors and deaths."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from verl_fastsync.tools import netns
from verl_fastsync.tools.netns import NamespacePair, NetnsUnavailableError, WorkerError, list_netns

REASON = netns.unavailable_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable: {REASON}")

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
ENV = {"PYTHONPATH": os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")])}
HERE = "test_netns"
CALL_S = 120.0


# -- functions the workers run (imported by name inside the namespace) --------------------------


def whoami() -> dict[str, object]:
    host = socket.gethostname()
    return {"hostname": host, "addr": socket.gethostbyname(host), "pid": os.getpid()}


def listen(addr: str) -> int:
    srv = socket.create_server((addr, 0))
    globals()["_srv"] = srv
    return int(srv.getsockname()[1])


def echo_once() -> str:
    srv = globals()["_srv"]
    srv.settimeout(60)
    conn, _ = srv.accept()
    data = conn.recv(64)
    conn.sendall(data[::-1])
    conn.close()
    return data.decode()


def connect(addr: str, port: int, text: str) -> str:
    with socket.create_connection((addr, port), timeout=60) as conn:
        conn.sendall(text.encode())
        return conn.recv(64).decode()


def noisy(n: int) -> int:
    print("library chatter on stdout " * 3)
    os.write(1, b"raw fd-1 chatter\n")
    return n + 1


def fail(message: str) -> None:
    raise KeyError(message)


def not_json() -> object:
    return {1, 2}


def die() -> None:
    os._exit(7)


# -- helpers -------------------------------------------------------------------------------------


def root_links() -> str:
    return subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout


def root_addrs() -> str:
    return subprocess.run(
        ["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, check=True
    ).stdout


def ns_run(ns: str, *args: str) -> str:
    return subprocess.run(
        ["ip", "netns", "exec", ns, *args], capture_output=True, text=True, check=True
    ).stdout


def ours(pair: NamespacePair) -> set[str]:
    return {pair.a.netns, pair.b.netns}


# -- tests ---------------------------------------------------------------------------------------


def test_unavailable_reason_names_the_missing_tool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "ip" else "/usr/sbin/" + tool)
    reason = netns.unavailable_reason()
    assert reason is not None and "`ip`" in reason
    before = list_netns() if REASON is None else set()
    with pytest.raises(NetnsUnavailableError, match="`ip`"):
        NamespacePair().open()
    if REASON is None:
        assert list_netns() == before


def test_bad_arguments_say_what_is_allowed() -> None:
    with pytest.raises(ValueError, match=r"rate_gbit .*\(0, 400\]"):
        NamespacePair(rate_gbit=0)
    with pytest.raises(ValueError, match="prefix"):
        NamespacePair(prefix="too-long")
    with pytest.raises(ValueError, match="side must be 'a' or 'b'"):
        NamespacePair().endpoint("c")


@needs_netns
def test_pair_is_made_and_deleted() -> None:
    before = list_netns()
    with NamespacePair() as pair:
        assert ours(pair) <= list_netns()
        assert ours(pair).isdisjoint(before)
        # the link exists only inside the namespaces, with the addresses on it
        assert pair.a.dev not in root_links() and pair.b.dev not in root_links()
        assert f"inet {pair.a.addr}/" in ns_run(
            pair.a.netns, "ip", "-4", "-o", "addr", "show", "dev", pair.a.dev
        )
        assert f"inet {pair.b.addr}/" in ns_run(
            pair.b.netns, "ip", "-4", "-o", "addr", "show", "dev", pair.b.dev
        )
        assert pair.a.addr not in root_addrs() and pair.b.addr not in root_addrs()
        assert os.path.exists(f"/etc/netns/{pair.a.netns}/hosts")
    assert list_netns() == before
    assert not os.path.exists(f"/etc/netns/{pair.a.netns}")
    assert pair.a.dev not in root_links()


@needs_netns
def test_deleted_when_the_body_raises() -> None:
    before = list_netns()
    with pytest.raises(RuntimeError, match="boom"), NamespacePair() as pair:
        worker = pair.spawn("a", env=ENV)
        raise RuntimeError("boom")
    assert list_netns() == before
    assert worker.proc.poll() is not None  # the worker was stopped too


# The driver inherits the test process's SIGINT disposition and mask; Python keeps an inherited
# SIG_IGN (a shell's background job, or a library in the pytest process, can leave one). Twice in
# full runs the driver never reacted to this test's SIGINT while it always did alone, so it installs
# Python's own handler and unblocks SIGINT, as an interactive driver has them.
_DRIVER = textwrap.dedent(
    """
    import signal, sys, time
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    from verl_fastsync.tools.netns import NamespacePair
    pair = NamespacePair().open()
    pair.spawn("b", env={env!r})
    print(pair.a.netns, pair.b.netns, flush=True)
    time.sleep(600)
    """
)


def _start_driver() -> tuple[subprocess.Popen[str], list[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _DRIVER.format(env=ENV)],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=ENV["PYTHONPATH"]),
    )
    assert proc.stdout is not None
    names = proc.stdout.readline().split()  # blocks until the pair and its worker are up
    assert len(names) == 2, f"driver printed {names!r}"
    assert set(names) <= list_netns()
    return proc, names


@needs_netns
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_deleted_on_ctrl_c_and_sigterm(sig: signal.Signals) -> None:
    proc, names = _start_driver()
    with open(f"/proc/{proc.pid}/status") as fh:
        masks = [line.strip() for line in fh if line.startswith(("SigBlk", "SigIgn"))]
    proc.send_signal(sig)
    try:
        code = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
        raise AssertionError(
            f"the driver ignored signal {sig!r} for 120 s; its masks: {masks}; this process's SIGINT "
            f"handler: {signal.getsignal(signal.SIGINT)!r}"
        ) from None
    assert code != 0
    assert set(names).isdisjoint(list_netns())
    assert not any(os.path.exists(f"/etc/netns/{n}") for n in names)


@needs_netns
@pytest.mark.timeout(300)
def test_namespaces_of_a_killed_driver_are_swept_by_the_next_pair() -> None:
    proc, names = _start_driver()
    proc.kill()  # no cleanup can run
    proc.wait(timeout=60)
    deadline = time.monotonic() + 60  # its worker notices the driver is gone and exits
    while set(names) & list_netns() and time.monotonic() < deadline:
        with NamespacePair():
            pass
        time.sleep(0.5)
    assert set(names).isdisjoint(list_netns())


@needs_netns
@pytest.mark.timeout(300)
def test_each_side_is_a_host_and_the_link_is_reachable_only_between_them() -> None:
    with NamespacePair() as pair:
        a, b = pair.spawn("a", env=ENV), pair.spawn("b", env=ENV)
        assert a.call(f"{HERE}:whoami", timeout_s=CALL_S)["addr"] == pair.a.addr
        who_b = b.call(f"{HERE}:whoami", timeout_s=CALL_S)
        assert (who_b["hostname"], who_b["addr"]) == (pair.b.hostname, pair.b.addr)
        assert socket.gethostname() not in (pair.a.hostname, pair.b.hostname)  # root's name untouched

        port = b.call(f"{HERE}:listen", {"addr": pair.b.addr}, timeout_s=CALL_S)
        # the root namespace cannot reach the listener ...
        with pytest.raises(OSError), socket.create_connection((pair.b.addr, port), timeout=3):
            pass
        # ... host a can
        pending = b.submit(f"{HERE}:echo_once")
        assert (
            a.call(f"{HERE}:connect", {"addr": pair.b.addr, "port": port, "text": "ping"}, CALL_S) == "gnip"
        )
        assert b.result(pending, CALL_S) == "ping"


@needs_netns
@pytest.mark.timeout(300)
def test_worker_protocol_results_errors_and_death() -> None:
    with NamespacePair() as pair:
        w = pair.spawn("a", env=ENV)
        assert w.info["netns"] == pair.a.netns and w.info["hostname"] == pair.a.hostname
        assert w.call(f"{HERE}:noisy", {"n": 41}, CALL_S) == 42  # chatter never reaches the protocol
        deadline = time.monotonic() + 60  # stderr is drained by its own thread: wait for it
        while "raw fd-1 chatter" not in w.stderr_tail() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "library chatter" in w.stderr_tail() and "raw fd-1 chatter" in w.stderr_tail()
        with pytest.raises(WorkerError, match=r"KeyError: 'missing thing'"):
            w.call(f"{HERE}:fail", {"message": "missing thing"}, CALL_S)
        with pytest.raises(WorkerError, match="TypeError: Object of type set is not JSON serializable"):
            w.call(f"{HERE}:not_json", timeout_s=CALL_S)
        with pytest.raises(WorkerError, match=r"package\.module:function"):
            w.call("no_colon_here", timeout_s=CALL_S)
        assert w.call(f"{HERE}:noisy", {"n": 1}, CALL_S) == 2  # still serving after the errors
        with pytest.raises(WorkerError, match="exited with code 7"):
            w.call(f"{HERE}:die", timeout_s=CALL_S)
        with pytest.raises(WorkerError, match="exited"):
            w.submit(f"{HERE}:noisy", {"n": 1})


@needs_netns
@pytest.mark.timeout(300)
def test_tc_shaping_is_applied_and_removed() -> None:
    with NamespacePair(rate_gbit=10) as pair:
        for end in (pair.a, pair.b):
            qdisc = ns_run(end.netns, "tc", "qdisc", "show", "dev", end.dev)
            assert "tbf" in qdisc and "10Gbit" in qdisc, qdisc
        pair.shape(None)
        assert "tbf" not in ns_run(pair.a.netns, "tc", "qdisc", "show", "dev", pair.a.dev)
