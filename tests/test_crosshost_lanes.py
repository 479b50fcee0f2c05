"""The multi-sender bench: K trainer namespaces, each on its own shaped link to the rollout
namespace; every sync's bytes are checked by digest, each sender's share crosses its own link, and
nothing is left behind."""

from __future__ import annotations

from typing import Any

import pytest

from verl_fastsync.tools.crosshost_lanes import LanesOptions, _both, format_lanes, run_lanes
from verl_fastsync.tools.crosshost_peer import MIB
from verl_fastsync.tools.netns import list_netns, unavailable_reason
from verl_fastsync.tools.netns_star import NamespaceStar

REASON = unavailable_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable: {REASON}")


@needs_netns
def test_a_star_gives_each_leaf_its_own_shaped_link_and_leaves_nothing() -> None:
    before = list_netns()
    with NamespaceStar(3, rate_gbit=2.0) as star:
        names = {star.hub_netns, *(leaf.netns for leaf in star.leaves)}
        assert names <= list_netns()
        assert len({leaf.addr for leaf in star.leaves} | set(star.hub_addrs)) == 6
        counts = star.rx_bytes()
        assert len(counts) == 3 and all(isinstance(c, int) and c >= 0 for c in counts)
    assert list_netns() == before
    with pytest.raises(ValueError, match="leaves must be an int"):
        NamespaceStar(0)


@needs_netns
@pytest.mark.timeout(900)
def test_each_sender_crosses_its_own_link_and_every_byte_arrives() -> None:
    """``senders=1`` moves the whole payload over link 0; ``senders=2`` half of it over each of links
    0 and 1 (the veth counters, not only what the senders report); digests are checked every sync."""
    before = list_netns()
    nbytes = 16 * MIB
    opts = LanesOptions(
        payload_mib=16, bucket_mib=2, repeats=1, gbit=4.0, senders=(1, 2), transports=("gloo",)
    )
    result = run_lanes(opts)
    assert list_netns() == before
    assert {"raw TCP, 1 stream", "raw gloo broadcast"} <= set(result["raw"])
    rows = {row["senders"]: row for row in result["rows"]}
    assert rows[1]["bytes_per_link"] == [nbytes, 0]
    assert rows[2]["bytes_per_link"][0] + rows[2]["bytes_per_link"][1] == nbytes
    assert min(rows[2]["bytes_per_link"]) >= nbytes // 4  # byte-balanced within one 16 MiB tensor...
    one, two = rows[1]["link_bytes_per_sync"], rows[2]["link_bytes_per_sync"]
    assert one[0] >= nbytes and one[1] < nbytes / 10  # ... and each share crossed its own link
    assert min(two) >= min(rows[2]["bytes_per_link"]) and max(two) < nbytes
    assert rows[1]["speedup"] == 1.0
    assert "gloo" in format_lanes(result)


class _Worker:
    """A bench worker whose one call ends as ``outcome`` (this test drives _both's waiting only)."""

    def __init__(self, outcome: Any, waited: list[int], index: int) -> None:
        self.outcome, self.waited, self.index = outcome, waited, index

    def submit(self, fn: str, kwargs: dict[str, Any]) -> int:
        return self.index

    def result(self, call: int, timeout_s: float) -> Any:
        self.waited.append(call)
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


def test_a_failed_row_names_every_rank_that_failed_not_only_the_first_in_order() -> None:
    waited: list[int] = []
    ranks = [
        _Worker(RuntimeError("trainer rank 0: timed out waiting for every rank to join"), waited, 0),
        _Worker({"ok": 1}, waited, 1),
        _Worker(ValueError("rollout rank 1: Failed to recv, got 0 bytes\ntraceback..."), waited, 2),
    ]
    with pytest.raises(RuntimeError) as caught:
        _both([(w, "peer:fn", {}) for w in ranks], 1.0)  # type: ignore[misc]
    assert str(caught.value) == (
        "2 of 3 calls failed: call 0: RuntimeError: trainer rank 0: timed out waiting for every rank "
        "to join | call 2: ValueError: rollout rank 1: Failed to recv, got 0 bytes"
    )
    assert waited == [0, 1, 2]  # every call waited for
    one = [_Worker({"ok": 1}, [], 0), _Worker(KeyError("only"), [], 1)]
    with pytest.raises(KeyError, match="only"):  # one failure: raised as it is
        _both([(w, "peer:fn", {}) for w in one], 1.0)  # type: ignore[misc]
    assert _both([(w, "peer:fn", {}) for w in one[:1]], 1.0) == [{"ok": 1}]  # type: ignore[misc]
