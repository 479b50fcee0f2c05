"""Colocated weight sync: trainer -> inference-engine workers on the same devices.

This replaces verl's ``verl/workers/rollout/vllm_rollout/bucketed_weight_transfer.py``
(``BucketedWeightSender`` / ``BucketedWeightReceiver``) with a transport that

* keeps a **persistent, double-buffered bucket** (two slots) per process and socket path: the slots
  are allocated - and for CUDA IPC exported - once, re-allocated only when the bucket size changes,
  and released at process exit (:func:`release_colocated_resources`). verl allocates (and on ROCm
  leaks) one bucket per sync.
* **pipelines** the two slots: the trainer packs one slot while the receiver loads the other; a slot
  is packed again only after the receiver acknowledged it.
* **fences** every handover: the sender waits for its copies into a slot (a device event on the
  current stream, through verl's ``get_torch_device()`` when verl is importable, else
  ``torch.<device type>``) before the slot is announced; the receiver synchronizes its device, drops
  every view into the slot and only then acknowledges. Oversize tensors go through the slots too, so
  no per-tensor IPC handle is ever exported (verl exports oversize weights without a fence).
* handles **oversize weights on both paths** (shm and IPC) by chunking them through the slots
  (:mod:`verl_fastsync.chunks`) and merging them on the receiver's device; tensors stacked along a
  leading expert dimension (MoE ``...experts.<param>`` shaped ``[E, ...]``) are chunked on expert
  boundaries so every chunk is a valid ``[e0:e1]`` slice.
* never calls ``gc.collect()``; never pickles: control messages are msgspec structs with a
  ``schema_version``, over pyzmq on the same ``ipc://`` path verl uses (the socket file is made
  ``0600``): the sender binds a ROUTER, the receiver connects a DEALER with a fresh routing id and
  announces itself (``Ready``, resent until the ``Hello`` arrives), so a receiver of the previous
  sync that is still closing can neither take nor inject a message of this one.
* costs, by design, ``2 x bucket`` bytes held for the process lifetime on the sender (device
  memory for ``ipc``, ``/dev/shm`` for ``shm``) and one mapping of them in the receiver; pick the
  bucket with that in mind (verl's default of 2048 MiB means 4 GiB; 256-512 MiB buckets already
  keep the pipeline busy).
* puts a timeout on every blocking wait; the error names the peer, the phase, the bucket and the
  tensors in flight.

Expert slices and vLLM
----------------------
vLLM's ``FusedMoE.weight_loader(param, loaded_weight, weight_name, shard_id, expert_id)`` loads one
expert at a time, and the model ``load_weights`` of checkpoints with stacked experts (gpt-oss, Llama 4,
Qwen3-VL-MoE: ``experts.gate_up_proj`` shaped ``[E, ...]``) iterate ``for expert_id in
range(num_experts)`` over the *whole* stacked tensor. Handing such a loader an ``[e0:e1]`` slice under
the original name would load it as experts ``0..e1-e0-1``: the generic ``load_weights`` path does
**not** accept slices, so by default the receiver merges a chunked tensor into one full-size buffer
on its device before calling the engine's callback (peak extra memory: the largest chunked tensor).
Where the caller can route a slice itself (e.g. calling ``FusedMoE.weight_loader`` per expert id),
pass ``expert_slice_loader=fn(name, first_expert, stop_expert, slice_tensor)`` to the receiver:
expert-aligned chunks are then handed to ``fn`` straight from the slot, without any merge buffer.

Enabling, per process
---------------------
The decision is made **per process, when a sender/receiver object is constructed**, from the
environment variable :data:`ENV_ENABLE` (``VERL_FASTSYNC_COLOCATED``):

* unset, ``""``, ``0``, ``false``, ``off``: verl's original classes are used, untouched;
* ``1``, ``true``, ``on``, ``auto``: fastsync; the slot memory follows verl's ``use_shm`` argument
  (``shm`` when verl would use shared memory, else ``ipc``);
* ``shm`` or ``ipc``: fastsync with that colocated transport (any name registered through the
  ``weight_transport`` hook with ``kind="colocated"`` is accepted).

Why an environment variable: the receiver runs inside vLLM's worker subprocesses, which verl spawns
through the vLLM server actor; they see neither the trainer's config nor Ray actor options, but they
inherit the environment of the server actor. The user therefore sets both the config key and the
variable, which reaches every actor::

    +actor_rollout_ref.rollout.custom.fastsync.colocated_transport=shm
    +ray_kwargs.ray_init.runtime_env.env_vars.VERL_FASTSYNC_COLOCATED=shm

and the adapter checks at trainer-worker start that the two agree
(:func:`verl_fastsync.verl.startup.check_colocated_switch`), so a forgotten half fails before the first
sync. The receiver follows the transport named by the sender's first message, so only the on/off
decision must agree; when it does not, the fastsync side fails with a timeout that says so (the
socket types differ: no hang).

Hooking verl
------------
:func:`install_colocated` takes verl's imported ``bucketed_weight_transfer`` module and replaces
its two classes by switches that build the fastsync objects when enabled and verl's own otherwise.
The adapter calls it when ``verl.workers.rollout.vllm_rollout.bucketed_weight_transfer`` is
imported (in the trainer worker and in every vLLM worker process). Both verl call sites are then
served unchanged: the full sync (``update_weights_from_ipc``) and, on 0.9.1, the delta flushes
(``delta_weight_transfer``), whose callbacks take ``(weights, is_last)``.

Timeouts: every wait is bounded by ``timeout_s`` (default :data:`DEFAULT_TIMEOUT_S`, or
:data:`ENV_TIMEOUT` in the environment, which the adapter can set from ``custom.fastsync.timeout_s``).

Modules: :mod:`.protocol` (constants, errors, control messages, the per-process switch),
:mod:`.planner` (buckets: whole tensors stay whole, oversize ones are chunked), :mod:`.memory` (slot
memory: shm, CUDA IPC; a transport name is resolved by the lookup it is handed, this process's plugin
registry once the adapter has wired it: this package sits below the registry), :mod:`.slots` (the
persistent slots of this process), :mod:`.channel` (the zmq control channel), :mod:`.sender`,
:mod:`.receiver`, :mod:`.switch` (verl's
``bucketed_weight_transfer`` substitution) and :mod:`.sglang` (the SGLang receiver).
"""

from __future__ import annotations

from verl_fastsync.colocated.channel import HELLO_RESEND_S, EventHook, _Channel
from verl_fastsync.colocated.memory import (
    SHM_PREFIX,
    IpcSlotMemory,
    ShmSlotMemory,
    SlotMemory,
    make_ipc_memory,
    make_shm_memory,
    sweep_dead_segments,
)
from verl_fastsync.colocated.planner import WholeTensorPlanner, expert_alignment
from verl_fastsync.colocated.protocol import (
    DEFAULT_TIMEOUT_S,
    ENV_ENABLE,
    ENV_TIMEOUT,
    ENV_VERIFY,
    METRIC_PREFIX,
    SCHEMA_VERSION,
    Abort,
    Ack,
    BucketMsg,
    ColocatedError,
    ColocatedProtocolError,
    ColocatedTimeoutError,
    Hello,
    HelloAck,
    IpcHandle,
    Message,
    Ready,
    SlotDesc,
    colocated_enabled,
    colocated_transport_name,
)
from verl_fastsync.colocated.receiver import ColocatedReceiver, ExpertSliceLoader
from verl_fastsync.colocated.sender import ColocatedSender
from verl_fastsync.colocated.slots import NUM_SLOTS, get_last_metrics, release_colocated_resources
from verl_fastsync.colocated.switch import install_colocated, uninstall_colocated

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ENV_ENABLE",
    "ENV_TIMEOUT",
    "ENV_VERIFY",
    "HELLO_RESEND_S",
    "METRIC_PREFIX",
    "NUM_SLOTS",
    "SCHEMA_VERSION",
    "SHM_PREFIX",
    "Abort",
    "Ack",
    "BucketMsg",
    "ColocatedError",
    "ColocatedProtocolError",
    "ColocatedReceiver",
    "ColocatedSender",
    "ColocatedTimeoutError",
    "EventHook",
    "ExpertSliceLoader",
    "Hello",
    "HelloAck",
    "IpcHandle",
    "IpcSlotMemory",
    "Message",
    "Ready",
    "ShmSlotMemory",
    "SlotDesc",
    "SlotMemory",
    "WholeTensorPlanner",
    "_Channel",
    "colocated_enabled",
    "colocated_transport_name",
    "expert_alignment",
    "get_last_metrics",
    "install_colocated",
    "make_ipc_memory",
    "make_shm_memory",
    "release_colocated_resources",
    "sweep_dead_segments",
    "uninstall_colocated",
]
