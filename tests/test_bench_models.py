"""Synthetic model presets of ``verl-fastsync bench`` (verl_fastsync/tools/models.py)."""

from __future__ import annotations

import pytest

from verl_fastsync.tools import bench, models


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
