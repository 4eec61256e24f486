"""The same %%hvd cells on either backend: hvd_notebook's own runtime (here, in
`make test`) and a real Horovod (`make test-horovod`, which sets
HVD_TEST_BACKEND=horovod in an environment where horovod imports)."""

from __future__ import annotations

import os

import pytest
from conftest import assert_gone

from hvd_notebook.kernel.session import Session

BACKEND = os.environ.get("HVD_TEST_BACKEND", "builtin")

# (cell, what rank 0 must print) -- identical cell code for both backends
CELLS = [
    ("import numpy as np, tensorflow as tf\nprint('world', hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size())",
     "world 0 2 0 2"),
    ("x = tf.constant([1.0, 2.0]) * (hvd.rank() + 1)\nprint('avg', hvd.allreduce(x).numpy().tolist())",
     "avg [1.5, 3.0]"),
    ("print('sum', hvd.allreduce(x, op=hvd.Sum).numpy().tolist())", "sum [3.0, 6.0]"),
    ("print('max', hvd.allreduce(x, op=hvd.Max).numpy().tolist())", "max [2.0, 4.0]"),
    ("rows = tf.ones([hvd.rank() + 1, 2]) * hvd.rank()\nprint('gather', hvd.allgather(rows).numpy().tolist())",
     "gather [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]"),
    ("print('bcast', hvd.broadcast(x, root_rank=1).numpy().tolist())", "bcast [2.0, 4.0]"),
    ("outs = hvd.grouped_allreduce([x, x * 10], op=hvd.Sum)\nprint('grouped', [o.numpy().tolist() for o in outs])",
     "grouped [[3.0, 6.0], [30.0, 60.0]]"),
    ("print('fp16', hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16).dtype.name)", "fp16 float32"),
    ("print('object', hvd.broadcast_object({'from': hvd.rank()}, root_rank=1))", "object {'from': 1}"),
    ("print('objects', hvd.allgather_object(hvd.rank() * 10))", "objects [0, 10]"),
    ("v = tf.Variable([float(hvd.rank())] * 3)\nhvd.broadcast_variables([v], root_rank=1)\n"
     "print('variables', v.numpy().tolist())", "variables [1.0, 1.0, 1.0]"),
    ("@tf.function\ndef step(t):\n    return hvd.allreduce(t, op=hvd.Sum)\nprint('graph', step(x).numpy().tolist())",
     "graph [3.0, 6.0]"),
    ("with tf.GradientTape() as tape:\n    w = tf.Variable([1.0, 1.0])\n"
     "    loss = tf.reduce_sum(hvd.allreduce(w * (hvd.rank() + 1), op=hvd.Sum))\n"
     "print('grad', tape.gradient(loss, w).numpy().tolist())", "grad [2.0, 2.0]"),
]


@pytest.fixture(scope="module")
def backend_cluster(ip):
    session = Session.get()
    assert session.cluster is None
    ip.run_line_magic("hvd", f"start -n 2 --backend {BACKEND}")
    assert session.cluster is not None and session.cluster.ranks[0].backend.startswith(BACKEND)
    yield session.cluster
    pids = session.cluster.pids()
    session.stop()
    assert_gone(pids)


@pytest.mark.parametrize("cell, expected", CELLS, ids=[c[1].split()[0] for c in CELLS])
def test_same_cell_on_every_backend(backend_cluster, run, cell, expected):
    result, out = run("%%hvd\n" + cell)
    assert result.success, out
    assert f"[0] {expected}" in out
