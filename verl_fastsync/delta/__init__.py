"""Delta sync's lowest layer: the codec that turns one bucket's new bytes into their difference from the
bytes sent before (the *base*) and back, bit-exactly (:mod:`~verl_fastsync.delta.codec`).

It knows nothing of tensors, transports, config or the plugin registry: a bucket is a flat byte buffer,
and the caller keeps the base. Submodules are imported explicitly (this package imports nothing at
import time)."""
