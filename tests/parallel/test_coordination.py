"""Collectives matched by name, in any order (runtime/core/coordinator.py), and calls refused on
one rank failing on every rank instead of leaving the others waiting."""

import json
import random
import threading
import time

import numpy as np
import pytest


def test_named_collectives_from_threads_in_opposite_orders(hvd, tf, in_threads):
    r, n = hvd.rank(), hvd.size()
    names = [f"grad{i}" for i in range(12)]
    order = names if r == 0 else names[::-1]
    results = {}

    def work(name):
        time.sleep(random.random() * 0.005)
        i = names.index(name)
        value = np.full(3 + i, float(i * (r + 1)), np.float32)
        if i % 3 == 0:
            results[name] = hvd.allreduce(value, name=name, op=hvd.Sum)
        elif i % 3 == 1:
            results[name] = hvd.allreduce(tf.constant(value), name=name, op=hvd.Sum).numpy()
        else:
            results[name] = hvd.allgather(value, name=name)

    assert in_threads(work, order) == {}
    for i, name in enumerate(names):
        expected = (np.full(3 + i, i * n * (n + 1) / 2) if i % 3 != 2
                    else np.concatenate([np.full(3 + i, float(i * (k + 1))) for k in range(n)]))
        np.testing.assert_allclose(results[name], expected)


def test_nameless_calls_in_flight_together_never_share_a_name(hvd):
    """A grouped call of nameless tensors takes one automatic name per tensor; a nameless call made while it
    waits gets a name of its own, not the group's second one. (Two dtypes: the group is two fused calls, each
    matched by the name of its first tensor, so a second holder of that name would be matched with it.)"""
    _nameless_calls_in_flight_together(hvd)


def test_nameless_calls_pair_again_after_a_join(hvd):
    """Rank 1 names its nameless call, rank 0 (joined) serves it with zeros and takes no name: the counts
    meet again at the join's end, so nameless calls in flight together afterwards still pair."""
    if hvd.rank() == 1:
        hvd.allreduce(np.ones(2), op=hvd.Sum)
    hvd.join()
    _nameless_calls_in_flight_together(hvd)


def _nameless_calls_in_flight_together(hvd):
    r = hvd.rank()
    grouped = {}

    def group():
        grouped["out"] = hvd.grouped_allreduce([np.full(2, r + 1.0, np.float32), np.full(3, r + 1.0, np.float64)],
                                               op=hvd.Sum)

    if r == 1:
        time.sleep(1.0)  # rank 0's two calls wait for this rank together, by their names
    thread = threading.Thread(target=group)
    thread.start()
    time.sleep(0.3)  # (the group has taken its names)
    single = hvd.allreduce(np.full(4, r + 1.0), op=hvd.Sum)
    thread.join(timeout=60)
    assert not thread.is_alive(), "the grouped call never finished"
    total = sum(k + 1.0 for k in range(hvd.size()))
    assert [a.tolist() for a in grouped["out"]] == [[total] * 2, [total] * 3]
    assert single.tolist() == [total] * 4


def test_a_mismatch_between_threads_fails_only_that_name(hvd, in_threads):
    r = hvd.rank()

    def work(name):
        shape = 2 + (r if name == "bad" else 0)
        hvd.allreduce(np.ones(shape), name=name)

    errors = in_threads(work, ["ok1", "bad", "ok2"] if r == 0 else ["ok2", "bad", "ok1"])
    assert set(errors) == {"bad"} and isinstance(errors["bad"], hvd.MismatchError)
    assert "allreduce of tensor 'bad' does not match across ranks" in str(errors["bad"])


def test_a_tf1_session_runs_independent_collectives_on_a_pool_of_threads(hvd, tf):
    r, n = hvd.rank(), hvd.size()
    with tf.Graph().as_default():
        checks = []
        for dtype in (tf.uint8, tf.int32, tf.float32, tf.float64):
            for dim in (1, 2, 3):
                t = tf.ones([5] * dim, dtype=dtype) * tf.cast(r + 1, dtype)
                checks.append(tf.reduce_all(tf.equal(hvd.allreduce(t, op=hvd.Sum), tf.cast(n * (n + 1) // 2, dtype))))
                checks.append(tf.equal(tf.shape(hvd.allgather(t))[0], 5 * n))
                checks.append(tf.reduce_all(tf.equal(hvd.broadcast(t, 0), tf.ones_like(t))))
        config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=4)
        with tf.compat.v1.Session(config=config) as session:
            for _ in range(3):
                assert session.run(tf.reduce_all(checks))


def test_independent_named_collectives_in_a_tf_function(hvd, tf):
    n = hvd.size()

    @tf.function
    def step(a, b, c):
        return (hvd.allreduce(a, op=hvd.Sum, name="a"), hvd.allreduce(b, op=hvd.Sum, name="b"),
                hvd.allgather(c, name="c"))

    a, b, c = step(tf.ones(3), tf.ones([4, 4], tf.float64), tf.ones([2]))
    assert a.numpy().tolist() == [n] * 3 and b.numpy().sum() == 16 * n and c.shape == (2 * n,)


def test_differently_named_calls_fail_on_every_rank_instead_of_waiting(hvd):
    start = time.monotonic()
    expected = r"rank 0: allreduce\('x0'\); rank 1: allreduce\('x1'\).*matched by name"
    with pytest.raises(hvd.MismatchError, match=expected):
        hvd.allreduce(np.ones(2), name=f"x{hvd.rank()}")
    assert time.monotonic() - start < 15
    assert hvd.allreduce(np.ones(2), op=hvd.Sum).tolist() == [hvd.size()] * 2  # still usable


@pytest.mark.parametrize("call", ["allgather_scalar", "alltoall_splits", "broadcast_root", "reducescatter_op"])
def test_a_call_refused_on_one_rank_raises_on_every_rank(hvd, call):
    r = hvd.rank()
    bad = r == 1
    calls = {
        "allgather_scalar": lambda: hvd.allgather(np.float32(1) if bad else np.ones(2, np.float32)),
        "alltoall_splits": lambda: hvd.alltoall(np.ones(4), splits=[3, 3] if bad else [2, 2]),
        "broadcast_root": lambda: hvd.broadcast(np.ones(2), root_rank=7 if bad else 0),
        "reducescatter_op": lambda: hvd.reducescatter(np.ones(4), op=hvd.Adasum if bad else hvd.Sum),
    }
    start = time.monotonic()
    with pytest.raises(ValueError) as info:
        calls[call]()
    assert time.monotonic() - start < 15
    if not bad:
        assert "was refused on rank(s) [1]" in str(info.value)
    hvd.barrier()


@pytest.mark.parametrize("value, match", [(np.array([True, False]), "dtype bool cannot be reduced"),
                                          (np.array(["a", "b"], dtype=object), "holds Python objects")])
def test_a_dtype_the_runtime_cannot_reduce_is_refused_before_mpi(hvd, value, match):
    with pytest.raises(ValueError, match=match):
        hvd.allreduce(value)
    # one rank alone: it says why, the other names it
    with pytest.raises(ValueError, match=match if hvd.rank() == 1 else r"was refused on rank\(s\) \[1\]"):
        hvd.allreduce(value if hvd.rank() == 1 else np.ones(2, np.float32))
    hvd.barrier()


def test_allreduces_agreed_together_share_one_mpi_call(hvd, tmp_path_factory, monkeypatch, in_threads):
    # Horovod's tensor fusion across calls: rank 1 is held in a "gate" allreduce that rank 0 joins
    # late, and both ranks' other calls, made from six threads, wait. Which of them a round finds
    # waiting would be timing on a loaded host; with Horovod's cycle (HOROVOD_CYCLE_TIME: a round waits
    # that long for more calls) all six are in the round that agrees on them. Rank 0's first call took
    # the lone path (nothing waited there yet), whose data cannot be shared: it runs alone, the other
    # five share one call
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "250")
    path = hvd.broadcast_object(str(tmp_path_factory.mktemp("fusion") / "trace.json"), root_rank=0)
    hvd.start_timeline(path)
    r, n = hvd.rank(), hvd.size()
    names = [f"layer{i}" for i in range(6)]
    results = {}

    def work(name):
        time.sleep(0.6 if name == "gate" and r == 0 else 0.0 if name == "gate" else 0.1)
        i = names.index(name) if name in names else 10
        results[name] = hvd.allreduce(np.full(20000, float(i + r), np.float32), name=name, op=hvd.Sum)

    assert in_threads(work, ["gate", *(names if r == 0 else names[::-1])]) == {}
    hvd.stop_timeline()
    hvd.barrier()
    for i, name in enumerate([*names, "gate"]):
        i = 10 if name == "gate" else i
        np.testing.assert_allclose(results[name], np.full(20000, n * i + n * (n - 1) / 2))
    calls = []
    if r == 0:
        events = json.loads(open(path).read())["traceEvents"]
        calls = [e["args"]["tensors"] for e in events if e.get("pid") == 0 and e["name"] == "MPI_ALLREDUCE"]
    calls = hvd.broadcast_object(calls, root_rank=0)
    layers = [c for c in calls if not c.startswith("gate")]
    assert len(layers) == 2 and sorted(c.endswith(" +4 fused") for c in layers) == [False, True], calls
