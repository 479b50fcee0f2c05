"""The ``verl-fastsync`` console script: ``bench`` end to end (tiny model) and ``doctor``.

Every run is a subprocess with a timeout; nothing here asserts on timings.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _plugin_dist import write_plugin_dist

from verl_fastsync.tools import bench, cli, doctor, models

KEY = "actor_rollout_ref.rollout.custom.fastsync"


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


@pytest.fixture(scope="module")
def tiny_bench(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    proc = _run_cli(
        "bench",
        "--model", "dense-small,moe-small",
        "--size-gib", "0.004",
        "--bucket-mib", "1",
        "--repeats", "1",
        "--heap-objects", "30000",
        "--transports", "shm,gloo,nixl",
        "--scale-sizes", "1",
        "--scale-pieces", "1,2",
        "--json", str(out),
        timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


@pytest.mark.verl
@pytest.mark.timeout(300)
def test_bench_tiny_model_json_validates(
    tiny_bench: tuple[subprocess.CompletedProcess[str], dict[str, Any]],
) -> None:
    proc, doc = tiny_bench
    bench.validate_bench_json(doc)
    assert doc["schema_version"] == bench.SCHEMA_VERSION
    assert doc["memcpy_gbps"] > 0
    # the readable table is on stdout, the progress display on stderr
    assert "CLEANUP" in proc.stdout and "TRANSFER" in proc.stdout and "SCALE" in proc.stdout
    assert "cleanup:" in proc.stderr and "transfer:" in proc.stderr


@pytest.mark.verl
@pytest.mark.timeout(300)
def test_bench_cleanup_rows(tiny_bench: tuple[subprocess.CompletedProcess[str], dict[str, Any]]) -> None:
    _, doc = tiny_bench
    rows = {(r["boundary"], r["policy"]): r for r in doc["cleanup"]}
    assert set(rows) == {(b, p) for b in bench.BOUNDARIES for p in bench.POLICIES}
    for row in rows.values():
        assert row["status"] == "ok", row
        assert row["device"] == "cpu"
    for boundary in bench.BOUNDARIES:
        assert rows[(boundary, "aggressive")]["gc_ran"] is True
        assert rows[(boundary, "light")]["gc_ran"] is False
    # the heap child really held the requested objects
    assert doc["cleanup_info"]["objects"] >= 30000


@pytest.mark.verl
@pytest.mark.timeout(300)
def test_bench_transfer_rows(
    tiny_bench: tuple[subprocess.CompletedProcess[str], dict[str, Any]], verl_version: tuple[int, int, int]
) -> None:
    _, doc = tiny_bench
    rows = doc["transfer"]
    for model in ("dense-small", "moe-small"):
        verl_shm = [
            r for r in rows if r["impl"] == "verl" and r["transport"] == "shm" and r["model"] == model
        ]
        assert len(verl_shm) == 1
        row = verl_shm[0]
        spec = models.model_spec(model, int(0.004 * bench.GIB))
        assert row["model_bytes"] == spec.nbytes
        if spec.largest_tensor_bytes > row["bucket_bytes"]:
            # verl's shared-memory sender cannot carry a tensor larger than its bucket: its own error
            assert row["status"] == "failed"
            assert "too large to fit in the bucket" in row["error"]
        elif verl_version < (0, 8, 0):
            # 0.7.x acks a shared-memory bucket before reading it: on a CPU host the bytes race
            assert row["status"] == "ok" or "received bytes differ" in row["error"]
        else:
            assert row["status"] == "ok" and row["verified"] is True
    # verl's chunk/merge (0.8.0+) over gloo carries every model; 0.7.1 has no chunking
    for row in [r for r in rows if r["impl"] == "verl" and r["transport"] == "gloo"]:
        if verl_version >= (0, 8, 0):
            assert row["status"] == "ok" and row["verified"] is True, row
        else:
            assert row["status"] == "failed" and "split_weight_chunks" in row["error"]
    for row in rows:
        if row["status"] == "ok":
            assert row["verified"] is not False
            assert row["gbps"] > 0 and 0 < row["fraction_of_memcpy"]
        else:
            assert row["error"]
    # every registered fastsync engine transport this host can run carries every model, bytes verified
    from verl_fastsync import plugins

    registered = plugins.available_transports(plugins.get_plugin_manager(), "engine")
    engine = set(registered) & {"shm", "gloo", "nixl"}
    for row in rows:
        if row["impl"] == "fastsync" and row["kind"] == "engine" and row["transport"] in engine:
            assert row["status"] == "ok" and row["verified"] is True, row
            assert row["setup_seconds"] >= 0
    # fastsync's colocated shm transport carries every model (oversize tensors are chunked)
    fast = [
        r for r in rows if r["impl"] == "fastsync" and r["kind"] == "colocated" and r["transport"] == "shm"
    ]
    assert fast and all(r["status"] == "ok" and r["verified"] for r in fast), fast
    scale_axes = {r["axis"] for r in doc["scale"]}
    assert scale_axes == {"model_bytes", "tensor_count"}


def _minimal_doc() -> dict[str, Any]:
    return {
        "schema_version": bench.SCHEMA_VERSION,
        "verl_version": "0.9.1",
        "memcpy_gbps": 10.0,
        "cleanup": [{"boundary": "pre_resume_cleanup", "policy": "light", "status": "ok", "seconds": 0.1,
                     "gc_ran": False}],
        "transfer": [{"transport": "shm", "impl": "verl", "model": "dense-small", "model_bytes": 10,
                      "bucket_bytes": 4, "status": "failed", "error": "verl: too large", "seconds": None,
                      "gbps": None, "fraction_of_memcpy": None, "peak_sender_bytes": None,
                      "peak_receiver_bytes": None}],
        "scale": [],
    }  # fmt: skip


def test_validate_bench_json_accepts_minimal() -> None:
    bench.validate_bench_json(_minimal_doc())


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("schema_version"), "schema_version"),
        (lambda d: d.update(schema_version=99), "schema_version=99"),
        (lambda d: d.update(memcpy_gbps=0), "memcpy_gbps"),
        (lambda d: d["cleanup"][0].pop("gc_ran"), "cleanup[0] lacks required key 'gc_ran'"),
        (lambda d: d["transfer"][0].update(status="maybe"), "allowed: ok, failed"),
        (lambda d: d["transfer"][0].update(error=None), "failed needs an error"),
        (lambda d: d["transfer"][0].update(impl="other"), "allowed: fastsync, verl"),
        (lambda d: d["transfer"][0].update(model_bytes="10"), "transfer[0].model_bytes"),
        (lambda d: d.update(scale={}), "scale must be a list"),
    ],
)
def test_validate_bench_json_rejects(mutate: Any, message: str) -> None:
    doc = copy.deepcopy(_minimal_doc())
    mutate(doc)
    with pytest.raises(bench.BenchSchemaError, match=message.replace("[", r"\[").replace("]", r"\]")):
        bench.validate_bench_json(doc)


@pytest.mark.timeout(60)
def test_bench_bad_option_exits_2() -> None:
    proc = _run_cli("bench", "--model", "nonesuch", timeout=60)
    assert proc.returncode == 2
    assert "nonesuch" in proc.stderr and "dense-small" in proc.stderr


def test_bench_options_defaults_are_valid() -> None:
    bench.BenchOptions().check()
    parser = cli.build_parser()
    args = parser.parse_args(["bench"])
    assert args.models == bench.BenchOptions().models
    assert args.heap_objects == 3_000_000


def test_cpu_device_stand_in() -> None:
    device = bench.CpuDevice()
    device.synchronize()
    device.empty_cache()
    assert device.memory_reserved() == 0 and not hasattr(device, "mem_get_info")


# ---------------------------------------------------------------------------------------------- models


@pytest.mark.parametrize("preset", models.PRESETS)
@pytest.mark.parametrize("size_mib", [4, 64, 256])
def test_model_presets_hit_size(preset: str, size_mib: int) -> None:
    spec = models.model_spec(preset, size_mib * models_mib())
    assert abs(spec.nbytes - size_mib * models_mib()) / (size_mib * models_mib()) < 0.15
    names = [t.name for t in spec.tensors]
    assert len(names) == len(set(names))
    assert "model.embed_tokens.weight" in names
    if preset == "moe-small":
        stacked = [t for t in spec.tensors if t.name.endswith("experts.gate_up_proj")]
        assert stacked and all(t.shape[0] == 32 for t in stacked)
        # expert-stacked tensors are the largest: larger than the bench's smaller default bucket at 256 MiB
        assert spec.largest_tensor_bytes == stacked[0].nbytes
        if size_mib == 256:
            assert stacked[0].nbytes > min(bench.BenchOptions().bucket_mib) * bench.MIB


def models_mib() -> int:
    return 1 << 20


def test_split_spec_keeps_bytes_and_materialize_is_deterministic() -> None:
    spec = models.model_spec("moe-small", 2 * models_mib())
    split = models.split_spec(spec, 4)
    assert split.nbytes == spec.nbytes and len(split.tensors) > len(spec.tensors)
    a = models.build_model(spec, seed=1)
    b = models.build_model(spec, seed=1)
    c = models.build_model(spec, seed=2)
    assert [n for n, _ in a] == [t.name for t in spec.tensors]
    assert all(models.fingerprint(x) == models.fingerprint(y) for (_, x), (_, y) in zip(a, b, strict=True))
    assert any(models.fingerprint(x) != models.fingerprint(y) for (_, x), (_, y) in zip(a, c, strict=True))


def test_unknown_preset() -> None:
    with pytest.raises(models.UnknownModelPresetError, match="allowed: dense-small, moe-small"):
        models.model_spec("huge", 1 << 20)


# ---------------------------------------------------------------------------------------------- doctor


def _doctor_json(*overrides: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any], str]:
    proc = _run_cli("doctor", "--json", *overrides, timeout=120, env=env)
    return proc.returncode, json.loads(proc.stdout), proc.stderr


@pytest.mark.verl
@pytest.mark.timeout(150)
def test_doctor_plugin_present(verl_version: tuple[int, int, int]) -> None:
    rc, report, err = _doctor_json(f"+{KEY}.enable=true", f"+{KEY}.pre_resume_cleanup=adaptive")
    assert rc == 0, (report["problems"], err)
    assert report["ok"] is True
    assert report["verl"]["version"].startswith(".".join(map(str, verl_version)))
    if verl_version >= (0, 9, 0):
        assert report["verl"]["loads_verl_plugins_entry_points"] is True
        assert report["verl"]["env_route_needed"] is False
    else:
        assert report["verl"]["loads_verl_plugins_entry_points"] is False
        assert report["verl"]["env_route_needed"] is True
        assert "VERL_USE_EXTERNAL_MODULES=verl_fastsync" in report["verl"]["load_route"]
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
    proc = _run_cli("doctor", f"+{KEY}.enable=true", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "hook pre_resume_cleanup: " in proc.stdout
    assert f"{KEY}.enable = True" in proc.stdout
    assert "status: ok" in proc.stdout


@pytest.mark.timeout(150)
def test_doctor_plugin_blocked_transports() -> None:
    rc, report, _ = _doctor_json(f"+{KEY}.enable=true", f"+{KEY}.disabled_plugins=[fastsync-transports]")
    assert rc == 0, report["problems"]
    assert report["plugins"]["blocked"] == ["fastsync-transports"]
    assert "fastsync-transports" not in report["plugins"]["registered"]
    assert "fastsync-transports" not in report["plugins"]["hooks"]["weight_transport"]
    for kind in ("engine", "colocated"):
        assert report["transports"][kind]["available"] == []
        assert all("blocked" in why for why in report["transports"][kind]["unavailable"].values())


@pytest.mark.timeout(150)
def test_doctor_plugin_blocked_cleanup_fails_like_the_worker() -> None:
    rc, report, _ = _doctor_json(f"+{KEY}.enable=true", f"+{KEY}.disabled_plugins=[fastsync-cleanup]")
    assert rc == 1
    assert report["ok"] is False
    assert report["plugins"]["hooks"]["pre_resume_cleanup"] == []
    [problem] = report["problems"]
    assert f"{KEY}.pre_resume_cleanup='light'" in problem and "unknown cleanup policy" in problem


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
    rc, report, _ = _doctor_json(f"+{KEY}.enable=true", f"+{KEY}.colocated_transport=ipc")
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
    rc, report, err = _doctor_json(f"+{KEY}.enable=true", f"+{KEY}.pre_resume_cleanup=twice", env=env)
    assert rc == 0, (report["problems"], err)
    assert report["plugins"]["hooks"]["pre_resume_cleanup"] == ["fastsync-cleanup", "twice"]
    assert "twice" in report["cleanup_policies"]["pre_resume_cleanup"]
    # blocking it by its entry-point name removes it, and the config naming its policy then fails
    rc, report, _ = _doctor_json(
        f"+{KEY}.pre_resume_cleanup=twice", f"+{KEY}.disabled_plugins=[twice]", env=env
    )
    assert rc == 1
    assert report["plugins"]["hooks"]["pre_resume_cleanup"] == ["fastsync-cleanup"]


def test_parse_overrides_uses_yaml_values() -> None:
    tree, ignored = doctor.parse_overrides(
        [
            f"+{KEY}.enable=true",
            f"++{KEY}.adaptive_headroom_gib=2.5",
            f"{KEY}.disabled_plugins=[a,b]",
            "trainer.total_epochs=3",
        ]
    )
    fs = tree["actor_rollout_ref"]["rollout"]["custom"]["fastsync"]
    assert fs == {"enable": True, "adaptive_headroom_gib": 2.5, "disabled_plugins": ["a", "b"]}
    assert ignored == ["trainer.total_epochs"]
    with pytest.raises(doctor.OverrideError, match="allowed: \\[\\+\\|\\+\\+\\]key=value"):
        doctor.parse_overrides(["no-equals-sign"])


def test_write_plot_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    doc = _minimal_doc()
    ok = dict(doc["transfer"][0], status="ok", error=None, seconds=0.5, gbps=2.0, fraction_of_memcpy=0.2,
              peak_sender_bytes=1 << 20, peak_receiver_bytes=2 << 20, kind="colocated")  # fmt: skip
    doc["transfer"] = [ok, dict(ok, bucket_bytes=8, gbps=3.0), dict(ok, impl="fastsync")]
    out = tmp_path / "plot.png"
    bench.write_plot(doc, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(60)
def test_plot_without_matplotlib_is_a_clear_error(tmp_path: Path) -> None:
    fake = tmp_path / "matplotlib"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('No module named matplotlib (hidden)')\n")
    pythonpath = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    proc = _run_cli("bench", "--plot", str(tmp_path / "x.png"), timeout=60, env={"PYTHONPATH": pythonpath})
    assert proc.returncode == 2
    assert "--plot needs matplotlib" in proc.stderr and "pip install matplotlib" in proc.stderr


@pytest.mark.timeout(150)
def test_doctor_engine_transport_override() -> None:
    import torch

    key = doctor.ENGINE_KEY_PREFIX + ".transport"
    rc, report, _ = _doctor_json(f"+{key}=bogus")
    assert rc == 1
    assert any(f"{key}='bogus'" in p and "unknown engine transport" in p for p in report["problems"])
    rc, report, _ = _doctor_json(f"+{key}=gloo")
    assert rc == 0, report["problems"]
    assert report["engine_kwargs"] == {"transport": "gloo"}
    if not torch.cuda.is_available():
        rc, report, _ = _doctor_json(f"+{key}=nccl")
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


@pytest.mark.timeout(120)
def test_gpu_cleanup_check_runs_without_cuda(tmp_path: Path) -> None:
    """The Python part of the GPU check imports and runs on a host without CUDA (device cpu)."""
    out = tmp_path / "cleanup.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_cleanup_check.py"), "--out", str(out),
         "--heap-objects", "3000", "--repeats", "1", "--cached-mib", "64", "--cycle-mib", "2"],
        capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    rows = {(r["boundary"], r["policy"], r["cycle_mib"]) for r in doc["rows"]}
    assert ("pre_resume_cleanup", "aggressive", 2) in rows and ("post_transfer_cleanup", "light", 0) in rows
    assert all(r["gc_ran"] == (r["policy"] == "aggressive") for r in doc["rows"] if doc["device"] == "cpu")


def test_schema_doc_lists_every_required_key() -> None:
    """docs/bench-schema.md is the contract: every key the validator requires is documented there."""
    text = (ROOT / "docs" / "bench-schema.md").read_text()
    required = {"schema_version", "verl_version", "memcpy_gbps", "cleanup", "transfer", "scale"}
    for fields in (bench._CLEANUP_FIELDS, bench._TRANSFER_FIELDS, bench._SCALE_FIELDS):
        required |= set(fields)
    missing = sorted(key for key in required if f"`{key}`" not in text)
    assert not missing, f"undocumented keys: {missing}"
    assert f"(version {bench.SCHEMA_VERSION})" in text
