"""The shape of a one-copy-per-host sync (:mod:`verl_fastsync.transports.hosts`): which rollout ranks
are one host, who leads each, the chain of hosts, and every group's ``init_process_group`` kwargs.

* **Hosts**: rollout ranks reporting the same shared-memory identity
  (:func:`verl_fastsync.io.hostid.host_identity`) are one host; a rank without one is a host alone.
* **Leaders and the chain**: hosts in the order of their lowest rollout rank, rotated by the lane
  (lane ``k`` of ``K`` senders enters the fleet at host ``k mod H``); a host's leader is its
  ``k mod R``-th rank, so on hosts with a link per GPU the lanes use different rails.
* **Groups**, each an ordinary group of the wrapped transport (one sender, receivers): *hop 0*
  (the sending trainer rank -> leader of the first host), *hop i* (leader ``i-1`` -> leader ``i``),
  and per host with more than one rank a *local* ``shm`` group (leader -> the host's other ranks).
* **Fleet ranks**: each group lists the fleet rank of each of its members (0: the sender, ``j + 1``:
  rollout rank ``j``); its ``rank_labels`` are built from the fleet's labels at join time, and a
  failure relayed from group to group keeps naming the rank where it happened.
* **Direct**: a lane some rollout rank has not prepared host endpoints for (the first sync of a
  lane with several senders) runs as before: every rollout rank a receiver of one group.
"""

from __future__ import annotations

import hashlib
from typing import Any

from verl_fastsync.transports.base import EngineTransportFactory, TransportError, rank_labels

__all__ = ["HOSTS_KEY", "chain_of_hosts", "hosts_fingerprint", "hosts_layout", "hosts_topology"]

HOSTS_KEY = "hosts"
"""The key of a rollout rank's host endpoints in its prepare metadata."""


def chain_of_hosts(keys: list[str | None], lane: int = 0) -> list[list[int]]:
    """Rollout ranks grouped by identity (``None``: alone), in chain order for ``lane``; each host's
    leader first."""
    groups: dict[object, list[int]] = {}
    for rank, key in enumerate(keys):
        groups.setdefault(key if key is not None else ("alone", rank), []).append(rank)
    hosts = sorted(groups.values(), key=min)
    start = lane % len(hosts)
    ordered = hosts[start:] + hosts[:start]
    chain = []
    for ranks in ordered:
        first = lane % len(ranks)
        chain.append(ranks[first:] + ranks[:first])
    return chain


def hosts_fingerprint(chain: list[list[int]]) -> str:
    """A short name of who leads which host (delta sync keeps one base per host: a base is reused
    only while the same ranks lead)."""
    text = ";".join(",".join(map(str, ranks)) for ranks in chain)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def _one(kwargs: dict[str, list[Any]], index: int) -> dict[str, Any]:
    return {key: values[index] for key, values in kwargs.items()}


def hosts_topology(
    factory: EngineTransportFactory,
    shm_factory: EngineTransportFactory,
    actor_world_size: int,
    rollout_world_size: int,
    metadata: list[dict[str, Any]],
    lane: int = 0,
) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """Per-rank kwargs of one sender's sync over the host structure (see the module docstring)."""
    actor_meta, rollout_meta = metadata[:actor_world_size], metadata[actor_world_size:]
    if len(rollout_meta) != rollout_world_size:
        raise ValueError(
            f"hosts topology: {len(rollout_meta)} rollout entries for {rollout_world_size} ranks"
        )
    hosts = []
    stale = any(meta.get("fresh") for meta in rollout_meta)
    for rank, meta in enumerate(rollout_meta):
        entry = meta.get(HOSTS_KEY)
        if not isinstance(entry, dict):
            raise TransportError(f"fastsync hosts: rollout rank {rank} did not prepare host endpoints")
        hosts.append(entry)
    world = 1 + rollout_world_size
    labels = rank_labels(rollout_world_size)
    actor: dict[str, list[Any]] = {
        "rank": [-1] * actor_world_size,
        "world_size": [world] * actor_world_size,
        "role": ["trainer"] * actor_world_size,
        "bucket_size": [m.get("bucket_size") for m in actor_meta],
        "rank_labels": [labels] * actor_world_size,
        "hosts_plan": [None] * actor_world_size,
    }
    rollout: dict[str, list[Any]] = {
        "rank": list(range(1, world)),
        "world_size": [world] * rollout_world_size,
        "role": ["rollout"] * rollout_world_size,
        "bucket_size": [h["up"].get("bucket_size") for h in hosts],
        "rank_labels": [labels] * rollout_world_size,
        "hosts_plan": [{} for _ in range(rollout_world_size)],
    }
    if stale:
        # a rank holds no endpoints of its own for this lane yet: every rank receives directly
        direct = [*actor_meta, *(h["up"] for h in hosts)]
        a_kw, r_kw = factory.build_topology(actor_world_size, rollout_world_size, direct)
        fleet = list(range(world))
        for index in range(actor_world_size):
            actor["rank"][index] = a_kw["rank"][index]
            actor["hosts_plan"][index] = {"down": _one(a_kw, index), "down_fleet": fleet}
        for j in range(rollout_world_size):
            rollout["hosts_plan"][j] = {"direct": _one(r_kw, j), "up_fleet": fleet, "fingerprint": "direct"}
        return actor, rollout
    chain = chain_of_hosts([h.get("key") for h in hosts], lane)
    fingerprint = hosts_fingerprint(chain)
    leaders = [ranks[0] for ranks in chain]
    # hop 0: the trainer's sending rank -> the first leader
    a_kw, r_kw = factory.build_topology(actor_world_size, 1, [*actor_meta, hosts[leaders[0]]["up"]])
    for index in range(actor_world_size):
        actor["rank"][index] = a_kw["rank"][index]
        actor["hosts_plan"][index] = {
            "down": _one(a_kw, index),
            "down_fleet": [0, leaders[0] + 1],
            "chain": len(chain),
        }
    plans = rollout["hosts_plan"]
    plans[leaders[0]].update(up=_one(r_kw, 0), up_fleet=[0, leaders[0] + 1])
    for hop in range(1, len(leaders)):
        before, after = leaders[hop - 1], leaders[hop]
        s_kw, r_kw = factory.build_topology(1, 1, [hosts[before]["relay"], hosts[after]["up"]])
        fleet = [before + 1, after + 1]
        plans[before].update(down=_one(s_kw, 0), down_fleet=fleet)
        plans[after].update(up=_one(r_kw, 0), up_fleet=fleet)
    for ranks in chain:
        if len(ranks) == 1:
            continue
        leader, members = ranks[0], ranks[1:]
        # the shared-memory identity proved these ranks one host, whatever their hostnames say (a
        # multi-NIC host may give each rail's rank its own name)
        name = hosts[leader]["fanout"].get("host")
        local = [dict(hosts[m]["local"], host=name) for m in members]
        s_kw, r_kw = shm_factory.build_topology(1, len(members), [hosts[leader]["fanout"], *local])
        fleet = [r + 1 for r in ranks]
        plans[leader].update(fanout=_one(s_kw, 0), local_fleet=fleet)
        for index, member in enumerate(members):
            plans[member].update(local=_one(r_kw, index), local_fleet=fleet)
    for plan in plans:
        plan["fingerprint"] = fingerprint
        plan["chain"] = len(chain)  # the hops' bucket follows the chain's length (hosts.chain_bucket)
    return actor, rollout


def hosts_layout(rollout: dict[str, list[Any]]) -> str:
    """Who leads which host, every lane (a delta base lives on the leaders: reused only while the
    same ranks lead); "" without the hosts layer."""
    found: list[Any] = list(rollout.get("hosts_plan", []))
    for lanes in rollout.get("lane_kwargs", []):
        found += [kw.get("hosts_plan") for kw in lanes or [] if isinstance(kw, dict)]
    plans = [p for p in found if isinstance(p, dict)]
    prints = sorted({str(p.get("fingerprint")) for p in plans})
    return ",".join(prints)[:64] if prints else ""
