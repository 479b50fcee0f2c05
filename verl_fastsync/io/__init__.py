"""Shared process-to-process plumbing of the engine and colocated paths: shared-memory segments
(:mod:`~verl_fastsync.io.shm`), the zmq control channel (:mod:`~verl_fastsync.io.control`), the
device fence (:mod:`~verl_fastsync.io.fence`), what a consumer is lent (:mod:`~verl_fastsync.io.lending`)
and a tensor's bytes (:mod:`~verl_fastsync.io.views`). Nothing here imports verl; submodules are imported
explicitly (this package imports nothing at import time)."""
