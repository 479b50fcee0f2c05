"""The plugin reaches every verl process: real local Ray actors, both loading routes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.release, pytest.mark.timeout(240)]

TESTS_DIR = str(Path(__file__).resolve().parent)


def _probe(ray: Any, env: dict[str, str]) -> dict[str, Any]:
    from _ray_probe import Probe

    pythonpath = os.pathsep.join(p for p in (os.environ.get("VERL_FASTSYNC_VERL_PATH"), TESTS_DIR) if p)
    env_vars = {"PYTHONPATH": pythonpath, **env}
    actor = ray.remote(num_cpus=0)(Probe).options(runtime_env={"env_vars": env_vars}).remote()
    try:
        return ray.get(actor.report.remote(), timeout=180)  # type: ignore[no-any-return]
    finally:
        ray.kill(actor)


def test_env_route_every_release(ray_cluster: Any, verl_version_string: str) -> None:
    report = _probe(
        ray_cluster, {"VERL_USE_EXTERNAL_MODULES": "verl_fastsync", "VERL_USE_EXTERNAL_PLUGINS": "none"}
    )
    assert report["verl_version"] == verl_version_string  # the same release in the actor
    assert report["installed_at_construction"] and report["update_weights_wrapped"]


def test_entry_point_route(ray_cluster: Any) -> None:
    report = _probe(ray_cluster, {"VERL_USE_EXTERNAL_MODULES": ""})
    # 0.9.0+ imports every `verl.plugins` entry point in `import verl`; older releases need the env
    # route. Decided by what the release's `import verl` does, not by its version number.
    from verl_fastsync.tools.doctor import verl_loads_entry_points

    loads_entry_points = verl_loads_entry_points()
    assert report["installed_at_construction"] is loads_entry_points
    assert report["update_weights_wrapped"] is loads_entry_points
