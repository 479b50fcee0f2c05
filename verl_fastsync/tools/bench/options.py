"""What a bench run measures: constants, the two presets (quick, the default, and full) and the
validation of every option with a message that says what is allowed."""

from __future__ import annotations

import dataclasses
import math

SCHEMA_VERSION = 2
MIB = 1 << 20
GIB = 1 << 30

POLICIES = ("light", "adaptive", "aggressive")
BOUNDARIES = ("pre_resume_cleanup", "post_transfer_cleanup")
CPU_TRANSPORTS = ("shm", "gloo", "nixl")
GPU_TRANSPORTS = ("nccl", "ipc")
TRANSPORTS = CPU_TRANSPORTS + GPU_TRANSPORTS
SECTIONS = ("cleanup", "transfer", "idle", "scale", "e2e", "crosshost", "delta", "fanout")
"""Every section, in the order they run. ``e2e``, ``crosshost``, ``delta`` and ``fanout`` come from
other modules (``verl_fastsync.tools.e2e``, ``.crosshost``, ``.delta_bench``, ``.fanout``) and are
skipped, with the reason, where those are missing or cannot run on the host."""
EXTERNAL = ("e2e", "crosshost", "delta", "fanout")
"""The sections measured by other modules (:mod:`verl_fastsync.tools.bench.external`)."""
KINDS = ("fastsync", "verl", "raw", "verl-reconstruction", "verl-stand-in")
"""What a row measures: fastsync's code; verl's own code; the raw mechanism (memcpy, a plain gloo
broadcast, a plain NIXL WRITE: the limit); fastsync's re-implementation of something verl does
(verl has no such engine, or its own code does nothing on this host); verl's own code with a
stand-in for a part the host lacks (a CPU device module in place of an accelerator)."""


class BenchSchemaError(ValueError):
    """A bench JSON document that does not follow ``docs/bench-schema.md``."""


class BenchOptionError(ValueError):
    """A bench option with a value that cannot work."""


Config = tuple[str, float, int]
"""One transfer configuration: (model preset, size in GiB, bucket size in MiB)."""


@dataclasses.dataclass
class BenchOptions:
    """What ``verl-fastsync bench`` runs. The defaults are the quick preset (about a minute on a
    2-core CPU host); :func:`full_options` is the preset behind docs/benchmarks.md's figures."""

    models: tuple[str, ...] = ("moe-small",)
    size_gib: float = 0.125
    bucket_mib: tuple[int, ...] = (8, 32)
    extra: tuple[Config, ...] = ()
    """Transfer configurations run in addition to models x size x buckets."""
    repeats: int = 3
    heap_objects: int = 500_000
    transports: tuple[str, ...] | None = None
    """None: every built-in transport (what the host cannot run gets a ``not available`` row)."""
    sections: tuple[str, ...] = ("cleanup", "transfer", "idle")
    scale_sizes: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0)
    """Model sizes of the scale section, as multiples of ``size_gib``."""
    scale_pieces: tuple[int, ...] = (1, 4, 16)
    """Tensor-count multipliers of the scale section (equal bytes)."""
    idle_s: float = 2.0
    """Idle window per transport of the idle section (seconds)."""
    seed: int = 0
    """Seed of the synthetic model's contents (the bytes every transfer checks)."""
    timeout_s: float = 300.0
    """Upper bound for every child process / transfer."""
    preset: str = "quick"

    def configs(self) -> list[Config]:
        """Every transfer configuration, in run order, without duplicates."""
        out: list[Config] = []
        for model in self.models:
            for bucket in self.bucket_mib:
                out.append((model, self.size_gib, bucket))
        for cfg in self.extra:
            if cfg not in out:
                out.append(cfg)
        return out

    def check(self) -> None:
        from verl_fastsync.tools.models import PRESETS

        for m in list(self.models) + [c[0] for c in self.extra]:
            if m not in PRESETS:
                raise BenchOptionError(f"--model {m!r}: unknown preset; allowed: {', '.join(PRESETS)}")
        sizes = [self.size_gib] + [c[1] for c in self.extra]
        if not all(isinstance(s, int | float) and s > 0 and math.isfinite(s) for s in sizes):
            raise BenchOptionError(f"--size-gib {sizes!r}: must be positive numbers")
        buckets = list(self.bucket_mib) + [c[2] for c in self.extra]
        if not buckets or any(b <= 0 for b in buckets):
            raise BenchOptionError(f"--bucket-mib {buckets!r}: must be positive integers (MiB)")
        if self.repeats < 1:
            raise BenchOptionError(f"--repeats {self.repeats}: must be >= 1")
        if self.heap_objects < 0:
            raise BenchOptionError(f"--heap-objects {self.heap_objects}: must be >= 0")
        for s in self.sections:
            if s not in SECTIONS:
                raise BenchOptionError(f"--sections {s!r}: unknown section; allowed: {', '.join(SECTIONS)}")
        if self.transports is not None:
            # any registered name works (third-party transports too); these are the built-in ones
            for t in self.transports:
                if not t or not t.replace("-", "").replace("_", "").isalnum():
                    raise BenchOptionError(
                        f"--transports {t!r}: not a transport name; built-in: {', '.join(TRANSPORTS)}"
                    )
        if any(p < 1 for p in self.scale_pieces) or any(s <= 0 for s in self.scale_sizes):
            raise BenchOptionError("--scale-sizes and --scale-pieces must be positive")
        if not (self.idle_s > 0 and math.isfinite(self.idle_s)):
            raise BenchOptionError(f"--idle-s {self.idle_s}: must be a positive number of seconds")
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise BenchOptionError(f"--timeout {self.timeout_s}: must be a positive number of seconds")


def full_options() -> BenchOptions:
    """The ``--full`` preset: every figure of docs/benchmarks.md (about 55-60 minutes on a 2-core CPU
    host, 40-45 of them in the fanout section: 83 rows, gloo and nixl with and without one copy per
    host)."""
    return BenchOptions(
        models=("dense-small", "moe-small"),
        size_gib=0.25,
        bucket_mib=(16, 64, 256),
        extra=(("moe-small", 2.0, 256),),
        repeats=5,
        heap_objects=3_000_000,
        sections=SECTIONS,
        idle_s=10.0,
        preset="full",
    )


def parse_config(text: str) -> Config:
    """``MODEL:SIZE_GIB:BUCKET_MIB`` (e.g. ``moe-small:2:256``) -> a transfer configuration."""
    parts = text.split(":")
    try:
        if len(parts) != 3:
            raise ValueError
        return parts[0], float(parts[1]), int(parts[2])
    except ValueError:
        raise BenchOptionError(
            f"--extra {text!r}: expected MODEL:SIZE_GIB:BUCKET_MIB, e.g. moe-small:2:256"
        ) from None
