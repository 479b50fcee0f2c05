"""Shared process-to-process plumbing of the engine and colocated paths: shared-memory segments
(:mod:`~verl_fastsync.io.shm`), the zmq control channel (:mod:`~verl_fastsync.io.control`) and the
device fence (:mod:`~verl_fastsync.io.fence`). Nothing here imports verl; submodules are imported
explicitly (this package imports nothing at import time)."""
