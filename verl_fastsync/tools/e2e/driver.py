"""The vLLM end-to-end driver: trainer process -> a real vLLM-CPU engine's worker process.

Run inside ``.venv-vllm`` (see ``scripts/setup_vllm.sh``)::

    python -m verl_fastsync.tools.e2e.driver --kind dense --out result.json [--syncs 12] \
        [--repeats 3] [--engine-transports shm,gloo,nixl] [--verl-oversize-check]

This process is the trainer: it holds verl 0.9.1's real ``ServerAdapter`` and sends through
``update_weights`` into the vLLM worker, where verl's real ``vLLMColocateWorkerExtension
.update_weights_from_ipc`` receives and calls vLLM's ``load_weights``. Paths:

``verl``      verl's own ``BucketedWeightSender``/``Receiver`` (shared memory; needs the test-side CPU
              platform for verl, :mod:`verl_fastsync.tools.e2e.cpu_shims`).
``fastsync``  the same call chain with ``VERL_FASTSYNC_COLOCATED=shm`` in both processes: fastsync's
              colocated transport replaces verl's classes (no CPU platform).
``engine``    the ``fastsync`` checkpoint engine (trainer in a spawned process, :mod:`.engine_trainer`)
              received by verl's ``CheckpointEngineWorker.update_weights`` body, which feeds the same
              ``ServerAdapter`` (fastsync colocated shm) into the same vLLM worker.

After every sync every vLLM parameter is read back (blake2b of its bytes) and compared with vLLM's own
load of the sent model's checkpoint file, and greedy generation is compared with transformers' greedy
on the sent model. The JSON written to ``--out`` holds every observation; tests assert on it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ENGINE_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
COLOCATED_ENV = "VERL_FASTSYNC_COLOCATED"
COLOCATED_TIMEOUT_ENV = "VERL_FASTSYNC_COLOCATED_TIMEOUT_S"
SEEDS = {"A": 1, "B": 2}
DELTA_PLAN = [("A", "plain"), ("A1", "reuse"), ("A2", "restore"), ("B", "plain"), ("B1", "plain")]
"""The delta run's syncs: a model tag is a seed's letter and how many delta-e2e steps it took
(``models.train_like``: 2% of every parameter's values); A -> B changes every value (raw)."""


def variant(tag: str) -> tuple[int, int]:
    """(seed, steps) of a model tag: ``"A"`` -> (1, 0), ``"A2"`` -> (1, 2)."""
    return SEEDS[tag[0]], int(tag[1:] or 0)


PROMPTS = [[1, 2, 3, 4, 5], [100, 200, 300], [7, 77, 777, 17]]
NEW_TOKENS = 8
VERL_BUCKET_MB = 32  # verl's shm path needs every tensor to fit one bucket (the 16 MiB embedding)
SMALL_BUCKET_MB = 8  # smaller than the dense embedding: fastsync chunks it, verl refuses it
SYNC_TIMEOUT_S = 180.0
PATHS = ("verl", "fastsync")


class Run:
    """One vLLM engine serving ``kind``; the trainer-side state of the e2e run."""

    def __init__(self, kind: str, workdir: Path, timeout_s: float, tags: tuple[str, ...] = ()) -> None:
        from verl_fastsync.tools.e2e import models

        self.kind = kind
        self.timeout_s = timeout_s
        self.job_id = f"fastsync-e2e-{os.getpid()}"
        os.environ["VERL_RAY_JOB_ID"] = self.job_id
        os.environ[COLOCATED_TIMEOUT_ENV] = str(int(timeout_s))
        tags = tuple(SEEDS) + tuple(t for t in tags if t not in SEEDS)
        self.models = {tag: models.build_variant(kind, *variant(tag)) for tag in tags}
        self.dirs = {tag: models.write_model(m, workdir / f"{kind}-{tag}") for tag, m in self.models.items()}
        self.state = {tag: models.state(m) for tag, m in self.models.items()}
        self.bytes = {tag: sum(t.nbytes for _, t in s) for tag, s in self.state.items()}
        self.greedy = {tag: models.greedy(m, PROMPTS, NEW_TOKENS) for tag, m in self.models.items()}
        self.llm: Any = None
        self.handle: Any = None
        self.reference: dict[str, dict[str, str]] = {}

    # -- engine ------------------------------------------------------------------------------

    def start(self) -> float:
        from vllm import LLM

        from verl_fastsync.tools.e2e.verl_side import InProcessServerHandle

        t0 = time.perf_counter()
        self.llm = LLM(
            model=str(self.dirs["A"]),
            dtype="float32",
            enforce_eager=True,
            skip_tokenizer_init=True,
            max_model_len=128,
            max_num_seqs=4,
            seed=0,
            worker_extension_cls="verl_fastsync.tools.e2e.worker.E2EWorkerExtension",
        )
        self.handle = InProcessServerHandle(self.llm)
        return time.perf_counter() - t0

    def rpc(self, method: str, *args: Any) -> Any:
        return self.llm.collective_rpc(method, timeout=self.timeout_s, args=args)[0]

    def load_references(self) -> None:
        for tag in ("B", "A"):
            self.rpc("e2e_load_checkpoint", str(self.dirs[tag]))
            self.reference[tag] = self.rpc("e2e_digests")
        differing = [n for n in self.reference["A"] if self.reference["A"][n] != self.reference["B"].get(n)]
        if len(differing) != len(self.reference["A"]):
            same = sorted(set(self.reference["A"]) - set(differing))
            raise AssertionError(f"models A and B share parameters {same}: a wrong sync could go unseen")
        for tag in self.dirs:
            if tag not in self.reference:
                self.rpc("e2e_load_checkpoint", str(self.dirs[tag]))
                self.reference[tag] = self.rpc("e2e_digests")

    def generate(self) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    # -- paths -------------------------------------------------------------------------------

    def select_path(self, path: str) -> None:
        """verl: verl's classes + test-side CPU platform; fastsync/engine: fastsync colocated shm on
        verl's stock platform. Set in this (trainer) process and in the vLLM worker."""
        from verl_fastsync.tools.e2e.cpu_shims import set_verl_platform

        value = None if path == "verl" else "shm"
        if value is None:
            os.environ.pop(COLOCATED_ENV, None)
        else:
            os.environ[COLOCATED_ENV] = value
        self.rpc("e2e_env", {COLOCATED_ENV: value, COLOCATED_TIMEOUT_ENV: str(int(self.timeout_s))})
        cpu = path == "verl"
        set_verl_platform(cpu)
        self.rpc("e2e_platform", cpu)

    def check(self, tag: str, previous: str | None = None) -> dict[str, Any]:
        """vLLM's parameters and greedy generation after a sync of ``tag`` (``previous``: the model
        synced before it; default the other seed's)."""
        digests = self.rpc("e2e_digests")
        want = self.reference[tag]
        other = self.reference[previous or ("B" if tag == "A" else "A")]
        wrong = sorted(n for n in want if digests.get(n) != want[n])
        still_other = sorted(n for n in want if digests.get(n) == other[n])
        got = self.generate()
        return {
            "params_total": len(want),
            "params_wrong": wrong,
            "params_equal_previous_model": still_other,
            "greedy": got,
            "greedy_want": self.greedy[tag],
            "greedy_ok": got == self.greedy[tag],
        }

    async def _colocated_sync(self, tag: str, producer: str, bucket_mb: int) -> float:
        from verl_fastsync.tools.e2e.producers import produce
        from verl_fastsync.tools.e2e.verl_side import make_server_adapter

        adapter = make_server_adapter(self.handle, bucket_mb, self.job_id)
        tensors = [(n, t.clone()) for n, t in self.state[tag]]
        t0 = time.perf_counter()
        await asyncio.wait_for(adapter.update_weights(produce(producer, tensors)), self.timeout_s)
        return time.perf_counter() - t0

    def colocated_sync(self, path: str, tag: str, producer: str, bucket_mb: int) -> dict[str, Any]:
        self.select_path(path)
        row: dict[str, Any] = {
            "path": path,
            "transport": "shm",
            "model": tag,
            "producer": producer,
            "bucket_mb": bucket_mb,
            "bytes": self.bytes[tag],
        }
        try:
            row["seconds"] = asyncio.run(self._colocated_sync(tag, producer, bucket_mb))
        except BaseException as exc:  # recorded; the test decides
            row["error"] = f"{type(exc).__name__}: {exc}"
            row["traceback"] = traceback.format_exc()
            return row
        row.update(self.check(tag))
        return row


# -- checkpoint engine ---------------------------------------------------------------------------


class EngineSide:
    """The rollout side of the checkpoint-engine e2e (this process) and its spawned trainer."""

    def __init__(self, run: Run) -> None:
        from verl_fastsync.tools.e2e.engine_trainer import trainer_main

        self.run = run
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=trainer_main, args=(child,), daemon=True)
        self.proc.start()

    def call(self, *cmd: Any) -> Any:
        self.conn.send(cmd)
        return self.reply()

    def reply(self) -> Any:
        if not self.conn.poll(self.run.timeout_s):
            raise TimeoutError(f"engine trainer did not answer within {self.run.timeout_s:.0f} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"engine trainer failed:\n{value}")
        return value

    def stop(self) -> None:
        try:
            self.call("stop")
        except Exception:
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()

    def handshake(self, engine: Any, trainer_meta: dict[str, Any]) -> None:
        """verl's manager's steps before a sync: both sides' ``prepare()`` metadata (the trainer's is
        ``trainer_meta``) into ``build_topology``, then ``init_process_group`` on both at once."""
        import concurrent.futures as cf

        actor_kw, rollout_kw = type(engine).build_topology(1, 1, [trainer_meta, engine.prepare()])
        with cf.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(engine.init_process_group, **{k: v[0] for k, v in rollout_kw.items()})
            self.call("init", {k: v[0] for k, v in actor_kw.items()})
            fut.result(self.run.timeout_s)

    def transport_run(
        self, transport: str, bucket_mb: int, plan: list[tuple[str, str]], delta: bool = False
    ) -> dict[str, Any]:
        """Syncs ``plan`` ([(model tag, producer)]) over ``transport``. ``delta``: engines with
        ``delta=true``, and before every sync the handshake verl's manager runs (``prepare``,
        ``build_topology``, ``init_process_group``; ``finalize`` after), so that they agree on the base;
        else one handshake for the whole plan."""
        from verl.checkpoint_engine.base import CheckpointEngineRegistry

        from verl_fastsync.tools.e2e.verl_side import checkpoint_worker_update, make_server_adapter

        out: dict[str, Any] = {"transport": transport, "bucket_mb": bucket_mb, "syncs": []}
        run = self.run
        bucket = bucket_mb << 20
        trainer_meta = self.call("engine", transport, bucket, run.timeout_s, delta)
        engine: Any = CheckpointEngineRegistry.new(
            "fastsync", bucket_size=bucket, transport=transport, timeout_s=run.timeout_s, delta=delta
        )
        previous: str | None = None
        try:
            self.handshake(engine, trainer_meta)
            run.select_path("engine")
            for i, (tag, producer) in enumerate(plan):
                row: dict[str, Any] = {"model": tag, "producer": producer, "bytes": run.bytes[tag]}
                try:
                    if delta and i:
                        self.handshake(engine, self.call("prepare"))
                    adapter = make_server_adapter(run.handle, bucket_mb, run.job_id)
                    self.conn.send(("send", run.kind, *variant(tag), producer))
                    t0 = time.perf_counter()
                    asyncio.run(asyncio.wait_for(checkpoint_worker_update(engine, adapter), run.timeout_s))
                    row["seconds"] = time.perf_counter() - t0
                    row["send_metrics"] = self.reply()
                    row["receive_metrics"] = dict(engine.last_metrics)
                    if delta:
                        engine.finalize()
                        self.call("end")
                except BaseException as exc:
                    row["error"] = f"{type(exc).__name__}: {exc}"
                    row["traceback"] = traceback.format_exc()
                    out["syncs"].append(row)
                    break
                row.update(run.check(tag, previous))
                out["syncs"].append(row)
                previous = tag
        finally:
            for fn in (engine.finalize, lambda: self.call("finalize")):
                try:
                    fn()
                except Exception as exc:
                    out.setdefault("finalize_errors", []).append(f"{type(exc).__name__}: {exc}")
        return out


# -- main ----------------------------------------------------------------------------------------


def colocated_plan(syncs: int) -> list[tuple[str, str, str]]:
    """(path, model, producer): models alternate every sync, paths every two, producers every four,
    so each (path, producer) pair sends both models."""
    from verl_fastsync.tools.e2e.producers import PRODUCERS

    plan = []
    for i in range(syncs):
        plan.append((PATHS[(i // 2) % 2], "AB"[i % 2], PRODUCERS[(i // 4) % len(PRODUCERS)]))
    return plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kind", choices=("dense", "moe"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--syncs", type=int, default=12, help="colocated correctness syncs")
    parser.add_argument("--repeats", type=int, default=0, help="timed syncs per path (plain producer)")
    parser.add_argument("--engine-transports", default="", help="comma list of fastsync engine transports")
    parser.add_argument(
        "--delta-transports", default="", help="comma list of engine transports to run delta=true syncs over"
    )
    parser.add_argument(
        "--verl-oversize-check",
        action="store_true",
        help="last step: verl's shm path with a bucket smaller than the embedding",
    )
    parser.add_argument("--timeout-s", type=float, default=SYNC_TIMEOUT_S)
    args = parser.parse_args(argv)
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)

    result: dict[str, Any] = {"kind": args.kind, "pid": os.getpid(), "python": sys.executable}
    out = Path(args.out)

    def dump() -> None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1, default=str))
        tmp.replace(out)

    t_run = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fastsync-e2e-") as tmp:
        delta_transports = [t for t in args.delta_transports.split(",") if t]
        delta_tags = tuple(tag for tag, _ in DELTA_PLAN) if delta_transports else ()
        run = Run(args.kind, Path(tmp), args.timeout_s, delta_tags)
        result["model_bytes"] = run.bytes["A"]
        result["largest_tensor_bytes"] = max(t.nbytes for _, t in run.state["A"])
        result["stacked_expert_tensors"] = [n for n, t in run.state["A"] if ".experts." in n and t.dim() == 3]
        result["engine_start_s"] = run.start()
        dump()
        run.load_references()
        result["params_total"] = len(run.reference["A"])
        result["reference_names"] = sorted(run.reference["A"])
        result["colocated"] = []
        for path, tag, producer in colocated_plan(args.syncs):
            bucket = VERL_BUCKET_MB if path == "verl" else SMALL_BUCKET_MB
            result["colocated"].append(run.colocated_sync(path, tag, producer, bucket))
            dump()
        result["timing"] = []
        variants = [("verl", VERL_BUCKET_MB), ("fastsync", VERL_BUCKET_MB), ("fastsync", SMALL_BUCKET_MB)]
        for i in range(args.repeats):
            for path, bucket in variants:
                result["timing"].append(run.colocated_sync(path, "AB"[i % 2], "plain", bucket))
            dump()
        transports = [t for t in args.engine_transports.split(",") if t]
        if transports or delta_transports:
            result["engine"] = []
            result["delta"] = []
            side = EngineSide(run)
            timed = [("B", "plain"), ("A", "plain")][: args.repeats]
            engine_plan = [("B", "reuse"), ("A", "restore"), *timed]
            runs = [("delta", t, DELTA_PLAN, True) for t in delta_transports]
            runs += [("engine", t, engine_plan, False) for t in transports]
            try:
                for key, transport, plan, delta in runs:
                    try:
                        row = side.transport_run(transport, SMALL_BUCKET_MB, plan, delta=delta)
                    except BaseException as exc:  # recorded; the test decides
                        row = {
                            "transport": transport,
                            "error": f"{type(exc).__name__}: {exc}",
                            "traceback": traceback.format_exc(),
                            "syncs": [],
                        }
                    result[key].append(row)
                    dump()
            finally:
                side.stop()
        result["wall_s"] = time.perf_counter() - t_run
        if args.verl_oversize_check:
            # verl's receiver blocks forever once its sender gave up: this must be the last step, and
            # the process exits without shutting the (stuck) engine down; the caller kills the group.
            row = run.colocated_sync("verl", "A", "plain", SMALL_BUCKET_MB)
            result["verl_oversize"] = {k: row.get(k) for k in ("error", "bucket_mb", "seconds")}
        result["done"] = True
        dump()
    _release_colocated()
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter shutdown: it would join the RPC thread a stuck verl receiver may still hold, and
    # the vLLM worker dies with this process anyway (verl's extension sets PR_SET_PDEATHSIG).
    os._exit(0)


def _release_colocated() -> None:
    """fastsync's persistent colocated slots are released at exit by an atexit hook that
    ``os._exit`` skips: release them here."""
    try:
        from verl_fastsync.colocated import release_colocated_resources
    except ImportError:
        return
    release_colocated_resources()


if __name__ == "__main__":
    raise SystemExit(main())
