"""``verl-fastsync doctor`` never says ``status: ok`` for a set-up that fails once verl starts.

Each case runs the CLI in a subprocess (timeouts generous for a loaded 2-core machine) and asserts the
exit status and the exact message parts, which are the workers' own where the workers have one.
Nothing here asserts on timings.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from verl_fastsync.selection import parse_engine_kwargs
from verl_fastsync.tools import doctor, doctor_env

ROOT = Path(__file__).resolve().parent.parent
RELEASES = ROOT / ".verl-releases"
KEY = "actor_rollout_ref.rollout.custom.fastsync"
ENGINE = doctor.ENGINE_KEY_PREFIX
ROUTE = doctor.ENV_ROUTE
NCCL_WARNING = "nccl library could not be loaded"


def _doctor(
    *overrides: str, env: dict[str, str] | None = None, json_out: bool = True
) -> tuple[int, dict[str, Any], str]:
    """``(exit status, report or {}, stdout + stderr)`` of ``verl-fastsync doctor [--json] overrides``."""
    args = ["doctor", *(["--json"] if json_out else []), *overrides]
    proc = subprocess.run(
        [sys.executable, "-m", "verl_fastsync.tools.cli", *args],
        capture_output=True,
        text=True,
        timeout=140,
        env={**os.environ, **(env or {})},
    )
    report = json.loads(proc.stdout) if json_out else {}
    return proc.returncode, report, proc.stdout + proc.stderr


def _release(version: str) -> Path:
    path = RELEASES / version
    if not (path / "verl" / "__init__.py").is_file():
        pytest.skip(f"verl {version} is not installed under {RELEASES} (scripts/setup.sh)")
    return path


def _lines(text: str, prefix: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(prefix)]


# -------------------------------------------------------------------------- 1. Hydra's leading +


@pytest.mark.timeout(150)
def test_fastsync_key_without_plus_is_refused_like_hydra() -> None:
    raw = f"{KEY}.enable=true"
    rc, _, text = _doctor(raw, ROUTE, json_out=False)
    assert rc == 1, text
    [problem] = _lines(text, "ERROR: ")
    assert problem == (
        f"ERROR: '{raw}': Hydra refuses it (\"Could not override '{KEY}.enable'\"): the key is not in "
        f"verl's config, so it can only be added, not overridden; add the leading +: +{raw} "
        "(allowed: +key=value or ++key=value)"
    )
    assert _lines(text, "status: ") == ["status: 1 problem(s)"]
    # the same for engine_kwargs.fastsync and for the Ray actors' environment; + and ++ are fine
    rc, report, _ = _doctor(f"{ENGINE}.transport=gloo", ROUTE[1:], f"++{KEY}.enable=true")
    assert rc == 1
    assert [p.split(":")[0] for p in report["problems"]] == [
        f"'{ENGINE}.transport=gloo'",
        f"'{ROUTE[1:]}'",
    ], report["problems"]
    assert all("add the leading +" in p for p in report["problems"])


@pytest.mark.timeout(150)
def test_overrides_composed_against_verls_own_ppo_trainer_config() -> None:
    """Any override verl's Hydra would refuse (here a typo in a verl key, which no fastsync check
    knows about) is a problem, with Hydra's own words; verl's real keys compose fine."""
    rc, report, _ = _doctor(f"+{KEY}.enable=true", "actor_rollout_ref.rolout.n=2", ROUTE)
    assert rc == 1
    [problem] = report["problems"]
    assert problem.startswith("verl's ppo_trainer config refuses these overrides (Hydra: "), problem
    assert "Could not override 'actor_rollout_ref.rolout.n'" in problem, problem
    rc, report, _ = _doctor(f"+{KEY}.enable=true", "actor_rollout_ref.rollout.n=2", ROUTE)
    assert rc == 0, report["problems"]


# ------------------------------------------------------------- 2. the engine's engine_kwargs check


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("override", "value"),
    [
        ("bucket_bytes=-3", {"bucket_bytes": -3}),
        ("bucket_bytes=lots", {"bucket_bytes": "lots"}),
        ("bucket_size=64MiB", {"bucket_size": "64MiB"}),
        ("timeout_s=-1", {"timeout_s": -1}),
        ("senders=0", {"senders": 0}),
        ("senders=some", {"senders": "some"}),
    ],
)
def test_engine_kwargs_rejected_with_the_engines_message(override: str, value: dict[str, Any]) -> None:
    with pytest.raises(ValueError) as caught:
        parse_engine_kwargs(value)  # what FastsyncCheckpointEngine.__init__ calls
    rc, report, _ = _doctor(f"+{ENGINE}.{override}", ROUTE)
    assert rc == 1
    assert report["problems"] == [str(caught.value)]
    assert report["ok"] is False


@pytest.mark.timeout(150)
def test_engine_kwargs_messages_say_what_is_allowed() -> None:
    rc, _, text = _doctor(f"+{ENGINE}.bucket_size=64MiB", ROUTE, json_out=False)
    assert rc == 1
    [problem] = _lines(text, "ERROR: ")
    assert "engine_kwargs.fastsync.bucket_size='64MiB' cannot be set" in problem
    assert "use bucket_bytes (e.g. bucket_bytes=64MiB)" in problem
    rc, report, _ = _doctor(f"+{ENGINE}.timeout_s=-1", ROUTE)
    assert rc == 1
    assert report["problems"] == [
        "engine_kwargs.fastsync.timeout_s=-1 is invalid: timeout_s must be a finite number > 0 of seconds"
    ]
    rc, report, _ = _doctor(f"+{ENGINE}.bucket_bytes=64MiB", f"+{ENGINE}.timeout_s=30", ROUTE)
    assert rc == 0, report["problems"]
    assert report["engine_settings"]["bucket_bytes"] == 64 << 20
    assert report["engine_settings"]["timeout_s"] == 30.0


# ---------------------------------------------------------------- 3. the route on 0.7.1 / 0.8.0


@pytest.mark.timeout(300)
def test_verl_071_needs_the_env_route_override() -> None:
    release = _release("0.7.1")
    env = {"PYTHONPATH": str(release)}
    rc, _, text = _doctor(f"+{KEY}.enable=true", env=env, json_out=False)
    assert rc == 1, text
    assert _lines(text, "verl ") == [f"verl 0.7.1 ({release / 'verl'})"]
    [problem] = _lines(text, "ERROR: ")
    assert problem.startswith(
        f"ERROR: {KEY}.enable=true, but this verl release does not load verl.plugins entry points: no verl "
        "process imports verl-fastsync"
    ), problem
    assert problem.endswith(f"add {ROUTE}"), problem
    assert _lines(text, "status: ") == ["status: 1 problem(s)"]

    # the variable in doctor's own shell does not reach the Ray actors: still a problem, said so
    rc, report, _ = _doctor(f"+{KEY}.enable=true", env={**env, "VERL_USE_EXTERNAL_MODULES": "verl_fastsync"})
    assert rc == 1
    [problem] = report["problems"]
    assert "VERL_USE_EXTERNAL_MODULES=verl_fastsync in this shell does not count" in problem, problem

    # with the override: recognised as the route, not "ignored (not fastsync keys)"
    rc, _, text = _doctor(f"+{KEY}.enable=true", ROUTE, env=env, json_out=False)
    assert rc == 0, text
    assert "ignored" not in text
    [loading] = _lines(text, "  plugin loading: ")
    assert "route configured: ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES=" in loading
    assert _lines(text, "status: ") == ["status: ok"]

    # an override that does not name verl_fastsync is not the route
    rc, report, _ = _doctor(f"+{KEY}.enable=true", ROUTE.replace("=verl_fastsync", "=other"), env=env)
    assert rc == 1
    [problem] = report["problems"]
    assert "VERL_USE_EXTERNAL_MODULES='other' does not name verl_fastsync" in problem, problem
    # the plugin not enabled: nothing to load, no problem
    rc, report, _ = _doctor(env=env)
    assert rc == 0, report["problems"]
    assert report["verl"]["imported"] is False


def test_version_read_without_importing_verl(monkeypatch: pytest.MonkeyPatch) -> None:
    for version in ("0.7.1", "0.8.0"):
        path = RELEASES / version
        if not (path / "verl").is_dir():
            continue
        spec = importlib.machinery.PathFinder.find_spec("verl", [str(path)])
        assert spec is not None
        monkeypatch.setattr(doctor_env, "_verl_spec", lambda spec=spec: spec)  # where verl_info finds verl
        info = doctor.verl_info({})
        assert info["version"] == version and "imported_because" not in info
        assert info["version_source"] == str(path / "verl" / "version" / "version")
        assert info["env_route_needed"] is True and info["env_route_configured"] is False
        info = doctor.verl_info({"VERL_USE_EXTERNAL_MODULES": "other,verl_fastsync"})
        assert info["env_route_configured"] is True
        # verl imports each comma-separated part as it is: a blank makes it another module
        assert (
            doctor.verl_info({"VERL_USE_EXTERNAL_MODULES": "other, verl_fastsync"})["env_route_configured"]
            is False
        )


def test_version_from_dist_info_next_to_the_package(tmp_path: Path) -> None:
    package = tmp_path / "verl"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('never executed')\n")
    assert doctor.verl_version_without_import(str(package)) is None
    dist = tmp_path / "verl-1.2.3.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: verl\nVersion: 1.2.3\n")
    found = doctor.verl_version_without_import(str(package))
    assert found is not None and found[0] == "1.2.3"


# ------------------------------------------------------------------ 4. unknown transport: usable


@pytest.mark.timeout(150)
def test_unknown_engine_transport_says_what_is_usable_here() -> None:
    rc, report, _ = _doctor(f"+{ENGINE}.transport=rdma", ROUTE)
    assert rc == 1
    [problem] = report["problems"]
    registered = report["transports"]["engine"]["registered"]
    usable = report["transports"]["engine"]["available"]
    assert problem == (
        f"engine_kwargs.fastsync.transport='rdma': unknown engine transport; available: "
        f"{', '.join(registered)}; usable on this host: {', '.join(usable)}"
    )
    for name in report["transports"]["engine"]["unavailable"]:
        assert name not in usable


@pytest.mark.timeout(150)
def test_unknown_colocated_transport_says_what_is_usable_here() -> None:
    rc, report, _ = _doctor(f"+{KEY}.enable=true", f"+{KEY}.colocated_transport=rdma", ROUTE)
    assert rc == 1
    usable = report["transports"]["colocated"]["available"]
    assert any(
        p.startswith(f"{KEY}.colocated_transport='rdma': unknown colocated transport")
        and p.endswith(f"; usable on this host: {', '.join(usable)}")
        for p in report["problems"]
    ), report["problems"]


# -------------------------------------------------------------------- 5. no scary CUDA driver text


def test_cupy_without_a_device_is_plain_words(monkeypatch: pytest.MonkeyPatch) -> None:
    class _Runtime:
        @staticmethod
        def getDeviceCount() -> int:
            raise RuntimeError(
                "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version"
            )

    class _Cupy:
        __version__ = "13.0"
        cuda = type("cuda", (), {"runtime": _Runtime})

    monkeypatch.setitem(sys.modules, "cupy", _Cupy)
    probe = doctor._probe_cupy(cuda_ok=False)
    assert probe == doctor.Probe(False, "no CUDA device/driver (cupy: cudaErrorInsufficientDriver)")
    # with a CUDA device that cupy cannot use, the whole error is what helps
    assert "driver version is insufficient" in doctor._probe_cupy(cuda_ok=True).detail


@pytest.mark.timeout(150)
def test_doctor_output_has_no_cuda_driver_text() -> None:
    rc, _, text = _doctor(json_out=False)
    assert rc == 0, text
    assert "driver version is insufficient" not in text
    assert NCCL_WARNING not in text


_IMPORT_CHECKPOINT_ENGINE = "import verl; import verl.checkpoint_engine"


def _import_stderr(env: dict[str, str]) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_CHECKPOINT_ENGINE],
        capture_output=True,
        text=True,
        timeout=250,
        env={**{k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_MODULES"}, **env},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stderr


@pytest.mark.verl
@pytest.mark.release
@pytest.mark.timeout(300)
def test_checkpoint_engine_import_with_plugin_has_no_cupy_nccl_warning() -> None:
    """cupy warns about libnccl when verl's checkpoint_engine imports its NCCL engine on a host
    without it; with the plugin loaded, its import hook ignores exactly that warning while verl's
    checkpoint_engine module executes."""
    pytest.importorskip("cupy")
    plain = _import_stderr({"VERL_USE_EXTERNAL_PLUGINS": "none"})  # no plugin in the process
    if NCCL_WARNING not in plain:
        pytest.skip(
            "cupy finds an NCCL library on this host (or verl does not import it): nothing to silence"
        )
    with_plugin = _import_stderr({"VERL_USE_EXTERNAL_MODULES": "verl_fastsync"})
    assert NCCL_WARNING not in with_plugin, with_plugin[-2000:]


def test_import_hook_ignores_only_the_named_warning() -> None:
    import warnings

    from verl_fastsync.verl import importhook

    [(message, category)] = importhook.QUIET_WARNINGS["verl.checkpoint_engine"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message=message, category=category)
        warnings.warn(
            "\n" + NCCL_WARNING + ".\nReason: ImportError (libnccl.so.2)", UserWarning, stacklevel=1
        )
        warnings.warn(NCCL_WARNING, DeprecationWarning, stacklevel=1)
        warnings.warn("something else", UserWarning, stacklevel=1)
    assert [(type(w.message), str(w.message)) for w in seen] == [
        (DeprecationWarning, NCCL_WARNING),
        (UserWarning, "something else"),
    ]


def test_delta_memory_is_checked_against_the_checkpoints_size(tmp_path: Path) -> None:
    """``delta=true`` keeps the model's bytes on the sending rank and every rollout rank, and verl puts
    a receiver on every rollout GPU: doctor reads the size from a local checkpoint and fails when this
    host cannot hold a rollout host's bases (one per rollout GPU, each with its undo journal)."""
    from verl_fastsync.delta.room import RESERVE_MIN
    from verl_fastsync.tools.doctor_checks import _delta_memory

    (tmp_path / "model-00001.safetensors").write_bytes(b"\0" * 3000)
    (tmp_path / "model-00002.safetensors").write_bytes(b"\0" * 2000)
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0" * 5000)  # the same weights again: not counted
    model = f"actor_rollout_ref.model.path={tmp_path}"
    one_gpu = [model, "trainer.n_gpus_per_node=1"]
    free = RESERVE_MIN  # what a side keeps free at run time (this much available: 4 GiB, not 1/8)
    problem, note = _delta_memory(one_gpu, available=free + 4000)
    assert problem is not None and "needs about 0.00 GiB" in problem and "set delta=false" in problem
    assert "of which 4.00 GiB stay free" in problem, problem
    assert str(tmp_path) in note
    problem, _ = _delta_memory(one_gpu, available=free + 5500)  # the base fits, its undo journal does not
    assert problem is not None and "undo journal" in problem
    problem, note = _delta_memory(one_gpu, available=free + 5625)  # 5000 + 625
    assert problem is None and "every rollout rank" in note and "undo journal" in note
    assert "a GPU trainer's page-locked, in just its pages, returned to the host when delta turns off" in note
    assert _delta_memory(one_gpu, available=5625)[0] is not None  # the bases fit, the reserve does not
    # verl's default: 8 rollout GPUs per host, each rank its own base
    problem, note = _delta_memory([model], available=free + 6000)
    assert problem is not None and "one per rollout GPU: 8" in problem, problem
    assert "verl's default" in problem, problem
    assert _delta_memory([model], available=free + 8 * 5625)[0] is None
    assert _delta_memory([model], available=free + 8 * 5625 - 1)[0] is not None
    # across hosts (gloo, nixl) each host's leader keeps the host's one base; hosts=off: one per GPU
    prefix = "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.fastsync"
    nixl = [model, f"{prefix}.transport=nixl"]
    problem, note = _delta_memory(nixl, available=free + 5625)
    assert problem is None and "one copy per host: nixl" in note, note
    assert _delta_memory([*nixl, f"{prefix}.hosts=off"], available=free + 5625)[0] is not None
    # rollout.n_gpus_per_node wins over the trainer's (verl's own fallback order), the last override wins
    four = [model, "trainer.n_gpus_per_node=8", "+actor_rollout_ref.rollout.n_gpus_per_node=4"]
    problem, note = _delta_memory(four, available=free + 4 * 5625)
    assert problem is None and "4 (actor_rollout_ref.rollout.n_gpus_per_node)" in note, note
    problem, _ = _delta_memory(
        [model, "actor_rollout_ref.rollout.n_gpus_per_node=4", "actor_rollout_ref.rollout.n_gpus_per_node=5"],
        available=free + 4 * 5625,
    )
    assert problem is not None and "one per rollout GPU: 5" in problem
    problem, note = _delta_memory(["+trainer.n_gpus_per_node=8"], available=6000)
    assert problem is None and "give actor_rollout_ref.model.path" in note
    assert "8 (trainer.n_gpus_per_node)" in note, note
    overrides = [model, "trainer.n_gpus_per_node=1"]
    report = doctor.diagnose([f"+{ENGINE}.delta=true", *overrides])
    assert any("delta=true keeps the model's bytes" in n for n in report["notes"]), report["notes"]
    one_host = [n for n in report["notes"] if "transport=shm" in n]  # shm is the default transport
    assert one_host and "keep delta=false with shm" in one_host[0], report["notes"]
    report = doctor.diagnose([f"+{ENGINE}.delta=true", f"+{ENGINE}.transport=gloo", *overrides])
    assert not [n for n in report["notes"] if "transport=shm" in n], report["notes"]
