"""The per-release runs: which tests ``scripts/test.sh`` runs again on verl 0.7.1, 0.8.0 and 0.9.0.

Every test runs on verl 0.9.1. The ``release`` marker selects those whose behaviour depends on the verl
release: what calls verl's own code or is called by it (the adapter's wrapping of the release's worker
methods, the engine's registration and protocol, verl's ``CheckpointEngineManager`` and
``CheckpointEngineWorker.update_weights`` body, the loading routes, verl's own modules read by doctor
and the bench). Where such a test is parametrized over transports, the release runs take one
transport (:data:`RELEASE_TRANSPORT`): verl's calling code is the same whatever moves the bytes, and
each transport's own behaviour does not change with the release (it runs on 0.9.1 on every transport).
"""

from __future__ import annotations

from typing import Any

import pytest

RELEASE_TRANSPORT = "gloo"


def transports(*names: str) -> list[Any]:
    """``names`` as ``parametrize`` values, :data:`RELEASE_TRANSPORT` marked ``release``."""
    release = pytest.mark.release
    return [pytest.param(name, marks=release) if name == RELEASE_TRANSPORT else name for name in names]
