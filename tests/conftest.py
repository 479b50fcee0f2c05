"""Test configuration shared by the whole suite.

``VERL_FASTSYNC_VERL_PATH`` points at a ``pip install --target`` directory holding an older verl
release (0.7.1, 0.8.0, 0.9.0); it is put first on ``sys.path`` (and ``PYTHONPATH`` for child
processes) before anything imports verl, so the suite runs against that release. Unset: the verl
installed in the venv (0.9.1). ``scripts/test.sh`` runs the suite once per release.
"""

from __future__ import annotations

import os
import sys

# Helper modules of this suite (``_verl_fakes`` etc.) import as top-level modules; the directory
# itself is not a package, so it cannot collide with the ``tests`` package verl's wheels install.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_VERL_PATH = os.environ.get("VERL_FASTSYNC_VERL_PATH")
if _VERL_PATH:
    sys.path.insert(0, _VERL_PATH)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_VERL_PATH, os.environ.get("PYTHONPATH")) if p)

import pytest  # noqa: E402


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak", action="store_true", help="run the full-length soak tests")


def pytest_report_header(config: pytest.Config) -> str:
    try:
        import verl

        return f"verl {verl.__version__} from {os.path.dirname(verl.__file__)}"
    except Exception as exc:  # pragma: no cover - informational only
        return f"verl not importable: {exc!r}"


@pytest.fixture(scope="session")
def verl_version() -> tuple[int, int, int]:
    """The release of verl under test, as a tuple."""
    import verl

    major, minor, patch = (int(part) for part in verl.__version__.split(".")[:3])
    return (major, minor, patch)
