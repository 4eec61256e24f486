"""The framework-free core of the runtime, cut as Horovod's ``horovod/common``: it works on numpy and
cupy arrays and imports no framework. From the bottom up:

- ``ops`` (the op vocabulary and the arithmetic around a reduction), ``exceptions`` (the errors every
  binding raises or wraps), ``events`` (what a rank tells whoever watches it: stalls, warnings),
  ``rules`` (names, ``op=``/``average=``, refused arguments, scaling: the Horovod
  rules every binding applies alike), ``signatures`` (what must be equal on every rank for one call),
  ``fusion``, ``timeline``, ``topology``;
- ``matching`` (which waiting calls run, in which order: a pure decision every rank takes alike),
  ``coordinator`` (each call a request; the waiting threads take turns running the agreement rounds),
  ``negotiation`` (one round's hash exchange, the stall inspector, the turn each call takes),
  ``shared_memory`` (the board where the ranks of one host post their hashes);
- ``mpi_backend`` and ``nccl_backend`` (never importing each other), ``world`` (one ``hvd.init()``),
  ``process_sets``;
- ``basics`` (init, rank, size and friends), ``objects`` (the calls without a tensor: objects, barrier,
  join, the timeline), ``compression`` (the compressor interface), ``elastic`` (state and the reset loop).

Bindings (``runtime/tensorflow``, ``runtime/keras``, ``runtime/torch``) import this package, never the
reverse.
"""
