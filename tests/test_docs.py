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
