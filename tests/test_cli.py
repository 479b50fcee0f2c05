"""The ``verl-fastsync`` console script: bench options and help (the bench runs: test_bench.py), doctor.

Every run is a subprocess with a timeout; nothing here asserts on timings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _plugin_dist import write_plugin_dist

from verl_fastsync import __version__
from verl_fastsync.tools import bench, cli, doctor

KEY = "actor_rollout_ref.rollout.custom.fastsync"
ROUTE = doctor.ENV_ROUTE
"""The route that loads the plugin on every release (0.7.1/0.8.0 need it); harmless where not needed."""
ENV = "+" + doctor.RAY_ENV_PREFIX


def _run_cli(
    *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "verl_fastsync.tools.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


# ---------------------------------------------------------------------------------------------- bench


@pytest.mark.timeout(60)
def test_bench_bad_option_exits_2() -> None:
    proc = _run_cli("bench", "--model", "nonesuch", timeout=60)
    assert proc.returncode == 2
    assert "nonesuch" in proc.stderr and "dense-small" in proc.stderr
    proc = _run_cli("bench", "--sections", "transfer,bogus", timeout=60)
    allowed = "allowed: cleanup, transfer, idle, scale, e2e, crosshost, delta"
    assert proc.returncode == 2 and allowed in proc.stderr
    proc = _run_cli("bench", "--extra", "moe-small:2", timeout=60)
    assert proc.returncode == 2 and "MODEL:SIZE_GIB:BUCKET_MIB" in proc.stderr


def test_bench_presets_and_overrides() -> None:
    bench.BenchOptions().check()
    bench.full_options().check()
    parser = cli.build_parser()
    args = parser.parse_args(["bench"])
    assert args.preset is None and args.models is None  # quick preset, nothing overridden
    full = bench.full_options()
    assert ("moe-small", 2.0, 256) in full.configs()  # the README's 2 GiB MoE, 256 MiB bucket figure
    assert set(full.sections) == set(bench.SECTIONS)
    assert parser.parse_args(["bench", "--full", "--repeats", "2"]).repeats == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--full", "--quick"])


def test_bench_help_is_plain_text_with_allowed_values() -> None:
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    text = sub.choices["bench"].format_help()  # type: ignore[attr-defined]
    top = cli.build_parser().format_help()
    assert "``" not in text and "``" not in top
    flat = " ".join(text.split())
    assert "built-in: shm, gloo, nixl, nccl, ipc" in flat
    assert "allowed: cleanup, transfer, idle, scale, e2e, crosshost, delta" in flat
    assert "allowed: dense-small, moe-small" in flat
    seed = next(a for a in sub.choices["bench"]._actions if a.dest == "seed")  # type: ignore[attr-defined]
    assert seed.help and "seed" in seed.help
    helps = [a.help for a in sub.choices["bench"]._actions]  # type: ignore[attr-defined]
    assert all(helps), "every option has a help text"


@pytest.mark.timeout(60)
def test_plot_without_matplotlib_is_a_clear_error(tmp_path: Path) -> None:
    fake = tmp_path / "matplotlib"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('No module named matplotlib (hidden)')\n")
    pythonpath = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    proc = _run_cli("bench", "--plot", str(tmp_path / "x.png"), timeout=60, env={"PYTHONPATH": pythonpath})
    assert proc.returncode == 2
    assert "--plot needs matplotlib" in proc.stderr and "pip install matplotlib" in proc.stderr


@pytest.mark.timeout(30)
def test_cpu_device_stand_in() -> None:
    device = bench.CpuDevice()
    device.synchronize()
    device.empty_cache()
    assert device.memory_reserved() == 0 and not hasattr(device, "mem_get_info")


# ---------------------------------------------------------------------------------------------- doctor


def _doctor_json(*overrides: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any], str]:
    proc = _run_cli("doctor", "--json", *overrides, timeout=120, env=env)
    return proc.returncode, json.loads(proc.stdout), proc.stderr


@pytest.mark.verl
@pytest.mark.release
@pytest.mark.timeout(150)
def test_doctor_plugin_present(verl_version: tuple[int, int, int]) -> None:
    rc, report, err = _doctor_json(f"+{KEY}.enable=true", f"+{KEY}.pre_resume_cleanup=adaptive", ROUTE)
    assert rc == 0, (report["problems"], err)
    assert report["ok"] is True
    assert report["verl"]["version"].startswith(".".join(map(str, verl_version)))
    assert report["verl"]["imported"] is False, "the version is read without importing verl"
    # the route override is recognised as the route on every release, never "ignored"
    assert report["worker_env"] == {"VERL_USE_EXTERNAL_MODULES": "verl_fastsync"}
    assert report["verl"]["env_route_configured"] is True
    assert not any("ray_kwargs" in note for note in report["notes"]), report["notes"]
    if verl_version >= (0, 9, 0):
        assert report["verl"]["loads_verl_plugins_entry_points"] is True
        assert report["verl"]["env_route_needed"] is False
    else:
        assert report["verl"]["loads_verl_plugins_entry_points"] is False
        assert report["verl"]["env_route_needed"] is True
        assert "route configured" in report["verl"]["load_route"]
        # without the route: a problem, not an info line
        rc_bare, bare, _ = _doctor_json(f"+{KEY}.enable=true")
        assert rc_bare == 1
        assert any(ROUTE in p and "does not load verl.plugins" in p for p in bare["problems"])
    hooks = report["plugins"]["hooks"]
    assert "fastsync-cleanup" in hooks["pre_resume_cleanup"]
    assert "fastsync-cleanup" in hooks["post_transfer_cleanup"]
    assert "fastsync-transports" in hooks["weight_transport"]
    assert report["config"]["enable"] is True
    assert report["config"]["pre_resume_cleanup"] == "adaptive"
    assert report["config"]["post_transfer_cleanup"] == "light"
    assert set(report["cleanup_policies"]["pre_resume_cleanup"]) >= {
        "light",
        "adaptive",
        "aggressive",
        "none",
    }
    # on this CPU-only host CUDA transports are unavailable, with the reason
    colocated = report["transports"]["colocated"]
    if not report["dependencies"]["cuda"]["ok"]:
        assert "ipc" not in colocated["available"]
        assert "cuda" in colocated["unavailable"].get("ipc", "cuda")


@pytest.mark.timeout(150)
def test_doctor_text_output() -> None:
    proc = _run_cli("doctor", f"+{KEY}.enable=true", ROUTE, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "hook pre_resume_cleanup: " in proc.stdout
    assert f"{KEY}.enable = True" in proc.stdout
    assert "status: ok" in proc.stdout


@pytest.mark.timeout(150)
def test_doctor_plugin_blocked_transports() -> None:
    blocked = f"+{KEY}.disabled_plugins=[fastsync-transports]"
    # the trainer worker refuses a block list its checkpoint-engine workers do not get (startup.py)
    rc, report, _ = _doctor_json(f"+{KEY}.enable=true", blocked, ROUTE)
    assert rc == 1
    [problem] = report["problems"]
    assert "VERL_FASTSYNC_DISABLED_PLUGINS lacks fastsync-transports" in problem, problem
    assert f"{ENV}.VERL_FASTSYNC_DISABLED_PLUGINS=fastsync-transports" in problem, problem
    env = f"{ENV}.VERL_FASTSYNC_DISABLED_PLUGINS=fastsync-transports"
    rc, report, _ = _doctor_json(f"+{KEY}.enable=true", blocked, ROUTE, env)
    assert rc == 0, report["problems"]
    assert report["plugins"]["blocked"] == ["fastsync-transports"]
    assert "fastsync-transports" not in report["plugins"]["registered"]
    assert "fastsync-transports" not in report["plugins"]["hooks"]["weight_transport"]
    for kind in ("engine", "colocated"):
        assert report["transports"][kind]["available"] == []
        assert all("blocked" in why for why in report["transports"][kind]["unavailable"].values())


@pytest.mark.timeout(150)
def test_doctor_plugin_blocked_cleanup_fails_like_the_worker() -> None:
    rc, report, _ = _doctor_json(
        f"+{KEY}.enable=true",
        f"+{KEY}.disabled_plugins=[fastsync-cleanup]",
        ROUTE,
        f"{ENV}.VERL_FASTSYNC_DISABLED_PLUGINS=fastsync-cleanup",
    )
    assert rc == 1
    assert report["ok"] is False
    assert report["plugins"]["hooks"]["pre_resume_cleanup"] == []
    [problem] = report["problems"]
    # the same message the worker raises: the name, who provides it and that the block list hides it
    assert f"{KEY}.pre_resume_cleanup='light'" in problem, problem
    assert "cleanup policy blocked by disabled_plugins" in problem, problem
    assert "'fastsync-cleanup'" in problem and "unknown" not in problem, problem


@pytest.mark.timeout(150)
def test_doctor_bad_override_names_key_value_allowed() -> None:
    proc = _run_cli("doctor", f"+{KEY}.pre_resume_cleanup=bogus", timeout=120)
    assert proc.returncode == 1
    assert f"{KEY}.pre_resume_cleanup='bogus'" in proc.stdout
    assert "available: adaptive, aggressive, light, none" in proc.stdout

    rc, report, _ = _doctor_json(f"+{KEY}.enable=maybe")
    assert rc == 1
    assert any(f"{KEY}.enable='maybe'" in p and "allowed: true or false" in p for p in report["problems"])

    rc, report, _ = _doctor_json(f"+{KEY}.enabel=true")
    assert rc == 1
    assert any("enabel" in p and "unknown key" in p for p in report["problems"])


@pytest.mark.timeout(150)
def test_doctor_colocated_transport_that_cannot_work_here() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a host without CUDA")
    rc, report, _ = _doctor_json(f"+{KEY}.enable=true", f"+{KEY}.colocated_transport=ipc", ROUTE)
    assert rc == 1
    assert any("colocated_transport='ipc'" in p for p in report["problems"]), report["problems"]


@pytest.mark.timeout(150)
def test_doctor_reports_third_party_plugin(tmp_path: Path) -> None:
    """A third-party plugin installed through the ``verl_fastsync`` entry-point group shows up as the
    first implementation of its hook, and its policy is selectable."""
    write_plugin_dist(
        tmp_path,
        "thirdparty_twice",
        """
            from verl_fastsync import hookimpl
            from verl_fastsync.cleanup import CleanupOutcome

            def _twice(ctx):
                ctx.device.empty_cache()
                ctx.device.empty_cache()
                return CleanupOutcome()

            @hookimpl
            def pre_resume_cleanup():
                return {"twice": _twice}
            """,
        entry_name="twice",
    )
    pythonpath = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": pythonpath}
    rc, report, err = _doctor_json(f"+{KEY}.enable=true", f"+{KEY}.pre_resume_cleanup=twice", ROUTE, env=env)
    assert rc == 0, (report["problems"], err)
    assert report["plugins"]["hooks"]["pre_resume_cleanup"] == ["fastsync-cleanup", "twice"]
    assert "twice" in report["cleanup_policies"]["pre_resume_cleanup"]
    # blocking it by its entry-point name removes it, and the config naming its policy then fails
    rc, report, _ = _doctor_json(
        f"+{KEY}.pre_resume_cleanup=twice", f"+{KEY}.disabled_plugins=[twice]", env=env
    )
    assert rc == 1
    assert report["plugins"]["hooks"]["pre_resume_cleanup"] == ["fastsync-cleanup"]


_LIGHT_PLUGIN = """
    from verl_fastsync import hookimpl
    from verl_fastsync.cleanup import CleanupOutcome

    def _light(ctx):
        return CleanupOutcome()

    @hookimpl
    def pre_resume_cleanup():
        return {"light": _light, "NAME": _light}
    """


def _pythonpath(*paths: Path) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join(p for p in (*map(str, paths), os.environ.get("PYTHONPATH")) if p)}


@pytest.mark.timeout(200)
def test_doctor_lists_names_with_distribution_and_what_they_replace(tmp_path: Path) -> None:
    """A third-party distribution replacing the built-in ``light``: doctor lists, per hook, every name,
    the plugin and distribution providing it, and the built-in it replaced (JSON and text)."""
    write_plugin_dist(tmp_path, "better_light", _LIGHT_PLUGIN.replace("NAME", "better"))
    env = _pythonpath(tmp_path)
    rc, report, err = _doctor_json(f"+{KEY}.enable=true", ROUTE, env=env)
    assert rc == 0, (report["problems"], err)
    names = report["plugins"]["names"]
    assert set(names) == {"pre_resume_cleanup", "post_transfer_cleanup", "weight_transport"}
    pre = {entry["name"]: entry for entry in names["pre_resume_cleanup"]}
    assert [entry["name"] for entry in names["pre_resume_cleanup"]] == sorted(pre)
    assert pre["light"] == {
        "name": "light",
        "plugin": "better_light",
        "distribution": "better-light 1.0",
        "builtin": False,
        "replaced": {
            "name": "light",
            "plugin": "fastsync-cleanup",
            "distribution": f"verl-fastsync {__version__}",
        },
    }
    assert pre["better"]["distribution"] == "better-light 1.0" and pre["better"]["replaced"] is None
    assert pre["adaptive"]["plugin"] == "fastsync-cleanup" and pre["adaptive"]["replaced"] is None
    # the other boundary keeps the built-in light; transports are listed per kind
    post = {entry["name"]: entry for entry in names["post_transfer_cleanup"]}
    assert post["light"]["plugin"] == "fastsync-cleanup" and post["light"]["replaced"] is None
    assert set(names["weight_transport"]) == {"engine", "colocated"}
    engine = {entry["name"]: entry for entry in names["weight_transport"]["engine"]}
    assert engine["shm"]["distribution"] == f"verl-fastsync {__version__}"
    assert report["cleanup_policies"]["pre_resume_cleanup"] == [
        "adaptive",
        "aggressive",
        "better",
        "light",
        "none",
    ]

    proc = _run_cli("doctor", f"+{KEY}.enable=true", ROUTE, timeout=150, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    builtin = f"verl-fastsync {__version__}"
    start = lines.index("  hook pre_resume_cleanup: fastsync-cleanup, better_light")
    assert lines[start + 1 : start + 4] == [
        f"    adaptive, aggressive, none from fastsync-cleanup ({builtin})",
        "    better from better_light (better-light 1.0)",
        "    light from better_light (better-light 1.0), replacing the built-in light of "
        f"fastsync-cleanup ({builtin})",
    ], proc.stdout
    assert f"    adaptive, aggressive, light, none from fastsync-cleanup ({builtin})" in lines
    assert any(line.startswith("    engine: ") and "shm" in line for line in lines), proc.stdout


@pytest.mark.timeout(300)
def test_doctor_plugin_conflict_is_a_problem_naming_both_distributions(tmp_path: Path) -> None:
    """Two third-party distributions providing one name, or claiming one entry-point name: exit 1 and
    one problem line naming both distributions, never a traceback."""
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    write_plugin_dist(one, "light_one", _LIGHT_PLUGIN.replace("NAME", "one"))
    write_plugin_dist(two, "light_two", _LIGHT_PLUGIN.replace("NAME", "two"))
    env = _pythonpath(one, two)
    rc, report, err = _doctor_json(f"+{KEY}.enable=true", ROUTE, env=env)
    assert rc == 1 and report["ok"] is False
    assert "Traceback" not in err, err
    [problem] = report["problems"]
    assert problem.startswith("plugin conflict: pre_resume_cleanup(): the name 'light' is provided by"), (
        problem
    )
    assert "light-one 1.0" in problem and "light-two 1.0" in problem, problem
    assert report["plugins"]["error"] == problem
    proc = _run_cli("doctor", f"+{KEY}.enable=true", ROUTE, timeout=150, env=env)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    [line] = [line for line in proc.stdout.splitlines() if line.startswith("ERROR: ")]
    assert "light-one 1.0" in line and "light-two 1.0" in line, line
    assert proc.stdout.splitlines()[-1] == "status: 1 problem(s)"
    # blocking one of them by its entry-point name resolves it
    rc, report, _ = _doctor_json(f"+{KEY}.disabled_plugins=[light_two]", env=env)
    assert rc == 0, report["problems"]

    # one entry-point name claimed by two distributions
    three, four = tmp_path / "three", tmp_path / "four"
    three.mkdir()
    four.mkdir()
    write_plugin_dist(three, "dist_three", _LIGHT_PLUGIN.replace("NAME", "three"), entry_name="shared")
    write_plugin_dist(four, "dist_four", _LIGHT_PLUGIN.replace("NAME", "four"), entry_name="shared")
    proc = _run_cli(
        "doctor", "--json", f"+{KEY}.enable=true", ROUTE, timeout=150, env=_pythonpath(three, four)
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    [problem] = json.loads(proc.stdout)["problems"]
    assert "plugin name 'shared' is claimed by two distributions" in problem, problem
    assert "dist-three 1.0" in problem and "dist-four 1.0" in problem, problem


def test_parse_overrides_uses_yaml_values() -> None:
    parsed = doctor.parse_overrides(
        [
            f"+{KEY}.enable=true",
            f"++{KEY}.adaptive_headroom_gib=2.5",
            f"{KEY}.disabled_plugins=[a,b]",
            "trainer.total_epochs=3",
            f"{ENV}.VERL_USE_EXTERNAL_MODULES=verl_fastsync",
        ]
    )
    fs = parsed.tree["actor_rollout_ref"]["rollout"]["custom"]["fastsync"]
    assert fs == {"enable": True, "adaptive_headroom_gib": 2.5, "disabled_plugins": ["a", "b"]}
    assert parsed.ignored == ["trainer.total_epochs"]
    assert parsed.worker_env == {"VERL_USE_EXTERNAL_MODULES": "verl_fastsync"}
    # a fastsync key without the leading + is refused by Hydra (it is not in verl's config)
    [problem] = parsed.problems
    assert problem.startswith(f"'{KEY}.disabled_plugins=[a,b]': Hydra refuses it"), problem
    assert f"add the leading +: +{KEY}.disabled_plugins=[a,b]" in problem, problem
    with pytest.raises(doctor.OverrideError, match="allowed: \\[\\+\\|\\+\\+\\]key=value"):
        doctor.parse_overrides(["no-equals-sign"])


@pytest.mark.timeout(150)
def test_doctor_engine_transport_override() -> None:
    import torch

    key = doctor.ENGINE_KEY_PREFIX + ".transport"
    rc, report, _ = _doctor_json(f"+{key}=bogus", ROUTE)
    assert rc == 1
    # the engine's message (verl_fastsync.config.parse_engine_kwargs), plus what can run on this host
    [problem] = report["problems"]
    assert problem.startswith("engine_kwargs.fastsync.transport='bogus': unknown engine transport"), problem
    usable = report["transports"]["engine"]["available"]
    assert problem.endswith(f"; usable on this host: {', '.join(usable)}"), problem
    rc, report, _ = _doctor_json(f"+{key}=gloo", ROUTE)
    assert rc == 0, report["problems"]
    assert report["engine_kwargs"] == {"transport": "gloo"}
    assert report["engine_settings"]["transport"] == "gloo"
    if not torch.cuda.is_available():
        rc, report, _ = _doctor_json(f"+{key}=nccl", ROUTE)
        assert rc == 1
        assert any(f"{key}='nccl' cannot work here" in p for p in report["problems"]), report["problems"]


ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(30)
def test_gpu_check_script_is_valid_bash() -> None:
    script = ROOT / "benchmarks" / "gpu_check.sh"
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=20)
    assert proc.returncode == 0, proc.stderr
    usage = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=20)
    assert usage.returncode == 2 and "usage:" in usage.stderr


def _run_benchmark(script: str, tmp_path: Path, *args: str) -> Any:
    """Runs ``benchmarks/<script> --out <json> *args`` (it must succeed) and returns its JSON."""
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--out", str(out), *args],
        capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())


@pytest.mark.timeout(180)
def test_gpu_delta_check_runs_without_cuda(tmp_path: Path) -> None:
    """The delta part of the GPU check runs on a CPU host too (its dry run): a full sync, then a delta
    sync of real AdamW steps, through the device compare (on the CPU here) and the host compare; the
    script raises when a rebuilt tensor differs from the trainer's or the two sent different bytes."""
    doc = _run_benchmark(
        "gpu_delta_check.py", tmp_path, "--gib", "0.005", "--width", "128", "--steps", "1", "--lrs", "1e-6"
    )
    first, second = doc["rows"]
    for side in ("device_compare", "host_compare"):
        assert not first[side]["delta_sync"] and second[side]["delta_sync"]
        delta = second[side]
        assert 0.0 < delta["changed_fraction"] < 0.2 and delta["wire_bytes"] < 0.5 * delta["model_bytes"]
        assert delta["at_10gbit"]["full_link_s"] > 0.0
    assert second["device_compare"]["wire_xxh3"] == second["host_compare"]["wire_xxh3"]
    assert second["codec_host_s"] > 0.0


@pytest.mark.timeout(120)
def test_gpu_cleanup_check_runs_without_cuda(tmp_path: Path) -> None:
    """The Python part of the GPU check imports and runs on a host without CUDA (device cpu)."""
    doc = _run_benchmark(
        "gpu_cleanup_check.py", tmp_path, "--heap-objects", "3000", "--repeats", "1", "--cached-mib", "64",
        "--cycle-mib", "2",
    )  # fmt: skip
    rows = {(r["boundary"], r["policy"], r["cycle_mib"]) for r in doc["rows"]}
    assert ("pre_resume_cleanup", "aggressive", 2) in rows and ("post_transfer_cleanup", "light", 0) in rows
    assert all(r["gc_ran"] == (r["policy"] == "aggressive") for r in doc["rows"] if doc["device"] == "cpu")
