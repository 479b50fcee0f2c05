"""The CPU ``main_ppo`` example switches fastsync on with exactly the overrides of the guide's recipes page
(``docs/recipes.md``), and that page lists exactly the example's modes (the runs themselves are
``tests/e2e/test_main_ppo.py``)."""

from __future__ import annotations

import re
from pathlib import Path

from _main_ppo_harness import example, is_vllm_message_queue

README = (Path(__file__).resolve().parent.parent / "docs" / "recipes.md").read_text()


def _bash_block_with(needle: str) -> list[str]:
    """The override lines of the README's first ```bash block that contains ``needle``."""
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        if needle in block:
            return [line.strip().rstrip("\\").strip() for line in block.splitlines() if line.strip()]
    raise AssertionError(f"no bash block in the README contains {needle!r}")


def test_the_colocated_modes_use_the_readmes_colocated_overrides() -> None:
    run_cpu = example()
    readme = _bash_block_with("custom.fastsync.colocated_transport=shm")
    for mode in ("colocated", "colocated-v0"):
        _layout, fastsync = run_cpu.MODES[mode]
        assert fastsync == readme, (mode, fastsync, readme)


def test_the_engine_modes_use_the_readmes_engine_overrides() -> None:
    run_cpu = example()
    readme = _bash_block_with("checkpoint_engine.backend=fastsync")
    for transport in ("shm", "gloo", "nixl"):
        _layout, fastsync = run_cpu.MODES[f"separate-{transport}"]
        # the README's block with the transport named, and the bucket size the test sets
        want = [line.replace("transport=shm", f"transport={transport}") for line in readme]
        assert fastsync[:2] == want[:2], (transport, fastsync, want)
        assert [o.split("=")[0] for o in fastsync] == [o.split("=")[0] for o in want], (fastsync, want)


def test_the_delta_mode_is_the_gloo_engine_mode_plus_the_readmes_delta_override() -> None:
    run_cpu = example()
    readme = _bash_block_with("fastsync.delta=true")
    assert readme == ["+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.fastsync.delta=true"]
    gloo_layout, gloo = run_cpu.MODES["separate-gloo"]
    layout, fastsync = run_cpu.MODES["separate-gloo-delta"]
    assert fastsync == gloo + readme, fastsync
    # the run differs only in its learning rate; the layout follows the run (Hydra takes the last)
    assert layout == gloo_layout + run_cpu.DELTA_RUN, layout
    lr = [o for o in run_cpu.RUN if o.startswith("actor_rollout_ref.actor.optim.lr=")]
    assert len(lr) == 1 and run_cpu.DELTA_RUN == ["actor_rollout_ref.actor.optim.lr=1e-10"], lr


def test_the_readme_lists_every_mode_and_stock_switches_nothing_on() -> None:
    run_cpu = example()
    line = next(x for x in README.splitlines() if x.startswith("# CPU: "))
    assert line.split("# CPU: ")[1].split(" (")[0].split(" | ") == list(run_cpu.MODES)
    assert run_cpu.MODES["stock"] == ([], [])


def test_a_segment_is_vllms_when_every_process_that_mapped_it_ended_up_named_as_vllms() -> None:
    """The e2e runs remove vLLM's leaked message queues and fail on any other leak: a vLLM process seen
    under its start-up name ``python`` still counts as vLLM's (CI once failed on that sample race); a
    process that stayed ``python`` (a driver, a trainer worker) makes the segment someone else's."""
    renamed = {101: ["python", "VLLM::EngineCor"], 102: ["python", "VLLM::Worker"]}
    assert is_vllm_message_queue(renamed)
    assert not is_vllm_message_queue({**renamed, 103: ["python"]})
    assert not is_vllm_message_queue({101: ["VLLM::EngineCor", "python"]})
    assert not is_vllm_message_queue({})
