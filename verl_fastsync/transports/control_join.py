"""A rollout rank that cannot join a controlled transport's group (see
:mod:`~verl_fastsync.transports.controlled`) tells the sender's handshake why, and the sender tells
every receiver, so nobody waits out ``timeout_s`` for a rank that will never come:

* :func:`send_abort_once`: the rank that cannot join (it has no control connection to the sender yet)
  sends its ``Abort`` on a short-lived connection to the sender's control endpoint.
* :func:`answer_late_hellos`: the sender whose handshake failed relays the cause to every receiver
  that already said hello, then answers the hellos that still come for a moment with it (a receiver
  that says hello after the sender closed would otherwise wait for its welcome until ``timeout_s``).
"""

from __future__ import annotations

import time

from verl_fastsync.io.control import ControlChannel
from verl_fastsync.wire import Abort, decode, encode

__all__ = ["JOIN_GRACE_S", "answer_late_hellos", "send_abort_once"]

JOIN_GRACE_S = 1.0
"""How long a sender whose handshake failed still answers late hellos with the cause."""


def send_abort_once(endpoint: str, abort: Abort, linger_ms: int) -> None:
    """Connect to the sender's control ``endpoint``, send ``abort`` and close, letting it out for at
    most ``linger_ms``."""
    once = ControlChannel()
    try:
        once.connect(endpoint)
        once.send_quietly(encode(abort))
    finally:
        once.close(linger_ms=linger_ms)


def answer_late_hellos(
    channel: ControlChannel, abort: Abort, heard: set[int | None], world_size: int
) -> None:
    """Sender: answer with ``abort`` every introduction from a receiver (transfer ranks 1 to
    ``world_size - 1``) not in ``heard`` (the ranks that said hello or aborted), until all were heard
    or :data:`JOIN_GRACE_S` passed."""
    data, ranks, end = encode(abort), range(1, world_size), time.monotonic() + JOIN_GRACE_S
    while not heard.issuperset(ranks) and time.monotonic() < end:
        try:
            got = channel.recv(end)
            if got is None:
                return
            message = decode(got[1], peer="a rollout rank")
        except Exception:  # a peer gone or garbage: the others got what there is
            return
        heard.add(getattr(message, "rank", None))
        if not isinstance(message, Abort):  # its introduction
            channel.send_quietly(data, got[0])
