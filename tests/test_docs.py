"""The site's configuration reference is rendered from the code (``docs/_ext/fastsync_reference.py``):
every key the code accepts appears with its default, its meaning and the validator's own answer, and a
key the code adds without its description fails the build instead of going missing."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

import fastsync_reference  # noqa: E402

from verl_fastsync import config  # noqa: E402


@pytest.mark.timeout(120)
def test_the_reference_lists_every_key_with_the_validators_answer() -> None:
    text = fastsync_reference.render()
    for field in dataclasses.fields(config.FastsyncConfig):
        assert f"| `{field.name}` |" in text, field.name
    for key in config.ENGINE_KEYS:
        assert f"| `{key}` |" in text, key
    assert "| `shm` | `slots` |" in text  # a transport's own option (engine_options)
    assert "allowed: an integer from 2 to 4" in text  # ... with its validator's message
    assert "engine_kwargs.fastsync.senders='?' is invalid; allowed: a positive int" in text
    assert "| `bucket_size` |" in text and "| `is_master` |" in text  # verl's own keywords
    for variable in (config.ENV_COLOCATED, config.ENV_COLOCATED_TIMEOUT, "VERL_FASTSYNC_DISABLED_PLUGINS"):
        assert f"| `{variable}` |" in text, variable
    assert "`adaptive`, `aggressive`, `light`, `none`" in text


@pytest.mark.timeout(60)
def test_an_engine_key_without_its_description_fails_the_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "ENGINE_KEYS", (*config.ENGINE_KEYS, "new_key"))
    with pytest.raises(fastsync_reference.ReferenceError, match="'new_key' is missing from the bullet list"):
        fastsync_reference.render()


@pytest.mark.timeout(60)
def test_a_config_field_without_a_docstring_fails_the_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = (ROOT / "verl_fastsync" / "config.py").read_text()
    doc = '    """Colocated transport: an xxhash checksum per chunk'
    assert doc in real
    start = real.index(doc)
    end = real.index('"""', start + len(doc)) + 3
    (tmp_path / "verl_fastsync").mkdir()
    (tmp_path / "verl_fastsync" / "config.py").write_text(real[:start] + real[end:])
    monkeypatch.setattr(fastsync_reference, "ROOT", tmp_path)
    with pytest.raises(fastsync_reference.ReferenceError, match=r"FastsyncConfig\.verify has no docstring"):
        fastsync_reference.custom_table()


def test_every_page_is_in_the_table_of_contents() -> None:
    index = (ROOT / "docs" / "index.md").read_text()
    pages = sorted(p.stem for p in (ROOT / "docs").glob("*.md") if p.stem != "index")
    assert [p for p in pages if f"\n{p}\n" not in index] == []


CUSTOM = "+actor_rollout_ref.rollout.custom.fastsync"
ENGINE_KW = "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.fastsync"
RAY_ENV = "+ray_kwargs.ray_init.runtime_env.env_vars"

# (overrides, a fragment of doctor's problem that the troubleshooting page must quote)
PROBLEMS = [
    ([f"{CUSTOM[1:]}.enable=true"], "Hydra refuses it"),
    (["trainer.n_gpus_per_nod=8"], "ppo_trainer config refuses these overrides"),
    ([f"{CUSTOM}.enable=maybe"], "is invalid; allowed"),
    ([f"{CUSTOM}.enabel=true"], "unknown key; allowed keys"),
    ([f"{CUSTOM}.enable=true", f"{CUSTOM}.pre_resume_cleanup=turbo"], "unknown cleanup policy; available"),
    (
        [f"{CUSTOM}.enable=true", f"{CUSTOM}.disabled_plugins=[x]"],
        "must reach every verl process",
    ),
    ([f"{CUSTOM}.enable=true", f"{CUSTOM}.colocated_transport=shm"], "needs VERL_FASTSYNC_COLOCATED=shm"),
    ([f"{CUSTOM}.enable=true", f"{RAY_ENV}.VERL_FASTSYNC_COLOCATED=shm"], "set both or neither"),
    (
        [
            f"{CUSTOM}.enable=true",
            f"{CUSTOM}.colocated_transport=shm",
            f"{RAY_ENV}.VERL_FASTSYNC_COLOCATED=shm",
            f"{CUSTOM}.timeout_s=30",
        ],
        "must also bound vLLM's receivers",
    ),
    ([f"{ENGINE_KW}.transprot=shm"], "unknown engine_kwargs.fastsync key(s)"),
    ([f"{ENGINE_KW}.bucket_size=1"], "cannot be set: verl passes"),
    ([f"{ENGINE_KW}.transport=rdma"], "unknown engine transport; available"),
]


@pytest.mark.timeout(300)
def test_every_problem_doctor_reports_is_in_troubleshooting(tmp_path: Path) -> None:
    """Each kind of problem doctor reports, triggered for real, is quoted on the troubleshooting page
    (with its fix next to it): a new kind of problem needs its entry."""
    from verl_fastsync.tools.doctor import diagnose

    page = " ".join((ROOT / "docs" / "troubleshooting.md").read_text().split())
    cases = list(PROBLEMS)
    import torch

    if not torch.cuda.is_available():
        ipc = [
            f"{CUSTOM}.enable=true",
            f"{CUSTOM}.colocated_transport=ipc",
            f"{RAY_ENV}.VERL_FASTSYNC_COLOCATED=ipc",
        ]
        cases += [(ipc, "cannot work here"), (ipc, "selects CUDA IPC, which this worker cannot use")]
    model = tmp_path / "model"
    model.mkdir()
    with open(model / "model.safetensors", "wb") as f:  # sparse: larger than any host's memory
        f.truncate(1 << 42)  # 4 TiB
    cases.append(
        (
            [
                f"{ENGINE_KW}.transport=gloo",
                f"{ENGINE_KW}.delta=true",
                f"actor_rollout_ref.model.path={model}",
            ],
            "a rollout host needs about",
        )
    )
    for overrides, fragment in cases:
        problems = diagnose(overrides)["problems"]
        assert any(fragment in p for p in problems), (overrides, fragment, problems)
        assert fragment in page, f"docs/troubleshooting.md does not quote doctor's {fragment!r}"
