"""Trainer rank 0 of the checkpoint-engine e2e: a spawned process that owns a ``fastsync`` checkpoint
engine (built through verl's ``CheckpointEngineRegistry``) and sends a seeded model on request.

Commands over a ``multiprocessing`` pipe (every reply is ``("ok", value)`` or ``("error", text)``):
``("engine", transport, bucket_bytes, timeout_s, delta)`` -> the engine's ``prepare()`` metadata;
``("prepare",)`` -> ``prepare()`` again (the next sync's handshake, as verl's manager runs it);
``("init", kwargs)`` -> ``init_process_group(**kwargs)``; ``("send", kind, seed, steps, producer)`` ->
the send metrics (the model of ``seed`` after ``steps`` delta-e2e steps); ``("end",)`` -> ``finalize()``,
keeping the engine for the next sync; ``("finalize",)`` -> the same, dropping it; ``("stop",)``.
"""

from __future__ import annotations

import asyncio
import traceback
from multiprocessing.connection import Connection
from typing import Any


def trainer_main(conn: Connection) -> None:
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    import verl_fastsync  # noqa: F401  (installs the plugin, as verl's entry point would)
    from verl_fastsync.tools.e2e import models
    from verl_fastsync.tools.e2e.producers import produce
    from verl_fastsync.verl.engine import register_engine

    register_engine()
    engine: Any = None
    cache: dict[tuple[str, int, int], list[Any]] = {}
    while True:
        cmd = conn.recv()
        try:
            op = cmd[0]
            if op == "stop":
                conn.send(("ok", None))
                return
            if op == "engine":
                _, transport, bucket, timeout_s, delta = cmd
                engine = CheckpointEngineRegistry.new(
                    "fastsync",
                    is_master=True,
                    bucket_size=bucket,
                    transport=transport,
                    timeout_s=timeout_s,
                    delta=delta,
                )
                conn.send(("ok", engine.prepare()))
            elif op == "prepare":
                conn.send(("ok", engine.prepare()))
            elif op == "init":
                engine.init_process_group(**cmd[1])
                conn.send(("ok", None))
            elif op == "send":
                _, kind, seed, steps, producer = cmd
                if (kind, seed, steps) not in cache:
                    cache[(kind, seed, steps)] = models.state(models.build_variant(kind, seed, steps))
                tensors = [(n, t.clone()) for n, t in cache[(kind, seed, steps)]]
                metrics = asyncio.run(engine.send_weights(produce(producer, tensors)))
                conn.send(("ok", metrics))
            elif op in ("end", "finalize"):
                engine.finalize()
                if op == "finalize":
                    engine = None
                conn.send(("ok", None))
            else:
                conn.send(("error", f"unknown command {op!r}"))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
