"""The GPU recipes of ``examples/gpu/`` checked by ``verl-fastsync doctor`` (they cannot run on this CPU
host): each script hands its whole ``main_ppo`` command line to doctor, which composes every override
against the installed verl's own ``ppo_trainer`` config and validates the fastsync keys with the
workers' code. The only problems allowed are the ones a host without CUDA must report. The recipes are
written for verl 0.9.x (the v1 trainer's ``separate_async`` layout), so they run with the venv's verl only."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "examples" / "gpu"
ENGINE = "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.fastsync"


def _doctor(recipe: str, *extra: str) -> tuple[int, dict[str, Any]]:
    """Run ``recipe`` with doctor as its ``main_ppo`` (JSON report)."""
    main = f"{shlex.quote(sys.executable)} -m verl_fastsync.tools.cli doctor --json"
    env = {
        **os.environ,
        "VERL_MAIN": main,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        ["bash", str(RECIPES / recipe), *extra],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )
    assert proc.stdout.strip(), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _composed(report: dict[str, Any]) -> None:
    """Every override of the recipe composed against verl's config (doctor composes the non-fastsync
    ones only when there are some: check that it saw them)."""
    assert report["verl"].get("installed"), report["verl"]
    assert "actor_rollout_ref.model.path" in " ".join(report["notes"]), report["notes"]
    assert not [p for p in report["problems"] if "ppo_trainer config refuses" in p], report["problems"]


@pytest.mark.timeout(300)
def test_colocated_recipe_passes_doctor_but_for_cuda_ipc_on_a_host_without_cuda() -> None:
    rc, report = _doctor("colocated_vllm_8gpu.sh")
    _composed(report)
    assert report["config"]["enable"] is True and report["config"]["colocated_transport"] == "ipc"
    assert report["config"]["pre_resume_cleanup"] == "light"
    assert report["worker_env"]["VERL_FASTSYNC_COLOCATED"] == "ipc"
    if _cuda():
        assert rc == 0 and report["ok"], report["problems"]
    else:
        assert rc != 0
        assert report["problems"] and all("'ipc'" in p and "cuda" in p.lower() for p in report["problems"]), (
            report["problems"]
        )


@pytest.mark.timeout(300)
def test_separate_hosts_nixl_recipe_passes_doctor() -> None:
    rc, report = _doctor("separate_hosts_nixl.sh")
    _composed(report)
    assert rc == 0 and report["ok"], report["problems"]
    settings = report["engine_settings"]
    assert settings["transport"] == "nixl" and settings["senders"] is None and settings["bucket_auto"] is True


@pytest.mark.timeout(300)
def test_delta_recipe_passes_doctor() -> None:
    rc, report = _doctor("delta_slow_link.sh")
    _composed(report)
    assert rc == 0 and report["ok"], report["problems"]
    settings = report["engine_settings"]
    assert settings["transport"] == "gloo" and settings["delta"] is True and settings["timeout_s"] == 1800
    assert any("delta=true keeps the model's bytes" in note for note in report["notes"]), report["notes"]


@pytest.mark.timeout(300)
def test_a_recipe_with_a_broken_override_fails_doctor() -> None:
    """The check is real: an override appended by the user (the last one wins) that verl or fastsync
    refuses makes doctor fail, naming it."""
    rc, report = _doctor("separate_hosts_nixl.sh", f"+{ENGINE}.senders=some")
    assert rc != 0 and any("senders='some'" in p for p in report["problems"]), report["problems"]
    rc, report = _doctor("separate_hosts_nixl.sh", "trainer.n_gpus_per_nod=8")
    assert rc != 0 and any("ppo_trainer config refuses" in p for p in report["problems"]), report["problems"]
