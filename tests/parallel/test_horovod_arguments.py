"""Arguments accepted for Horovod compatibility: a value this runtime cannot honour
raises a clear error (before any communication, on every rank alike) instead of
being ignored."""

from __future__ import annotations

import numpy as np
import pytest


def test_a_process_set_that_is_not_one_is_refused_by_every_collective(hvd):
    x = np.ones(2)
    calls = [
        lambda ps: hvd.allreduce(x, process_set=ps),
        lambda ps: hvd.grouped_allreduce([x], process_set=ps),
        lambda ps: hvd.allgather(x, process_set=ps),
        lambda ps: hvd.grouped_allgather([x], process_set=ps),
        lambda ps: hvd.broadcast(x, 0, process_set=ps),
        lambda ps: hvd.broadcast_object(1, process_set=ps),
        lambda ps: hvd.allgather_object(1, process_set=ps),
        lambda ps: hvd.alltoall(np.ones(2), process_set=ps),
        lambda ps: hvd.reducescatter(np.ones(2), process_set=ps),
        lambda ps: hvd.grouped_reducescatter([np.ones(2)], process_set=ps),
        lambda ps: hvd.barrier(process_set=ps),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=r"process_set='some process set'\): process_set takes a hvd.ProcessSet"):
            call("some process set")
    hvd.barrier()  # nothing above reached a collective: the ranks are still in step


def test_device_and_session_arguments_are_rejected(hvd, tf):
    with pytest.raises(ValueError, match="device_dense='/gpu:0'.*omit it"):
        hvd.allreduce(np.ones(2), device_dense="/gpu:0")
    with pytest.raises(ValueError, match="device_sparse='/cpu:0'.*omit it"):
        hvd.grouped_allreduce([np.ones(2)], device_sparse="/cpu:0")
    with pytest.raises(ValueError, match="session=.*TensorFlow 2 runs eagerly"):
        hvd.broadcast_object(1, session="a session")
    with pytest.raises(ValueError, match="session=.*TensorFlow 2 runs eagerly"):
        hvd.allgather_object(1, session="a session")
    with pytest.raises(ValueError, match="BroadcastGlobalVariablesCallback.*device='/gpu:0'.*omit it"):
        hvd.callbacks.BroadcastGlobalVariablesCallback(0, device="/gpu:0")
    with pytest.raises(ValueError, match="MetricAverageCallback.*device='/gpu:0'"):
        hvd.callbacks.MetricAverageCallback(device="/gpu:0")
    # the defaults still work
    assert hvd.broadcast_object(hvd.rank(), root_rank=0, session=None) == 0
    hvd.callbacks.BroadcastGlobalVariablesCallback(0, device="")
    hvd.callbacks.MetricAverageCallback()


def test_grouping_arguments_are_rejected(hvd, tf):
    import keras

    with pytest.raises(ValueError, match="num_groups=2.*HOROVOD_FUSION_THRESHOLD"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), num_groups=2)
    with pytest.raises(ValueError, match="groups=.*HOROVOD_FUSION_THRESHOLD"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), groups=[[0]])
    with pytest.raises(ValueError, match=r"process_set='ps'\): process_set takes a hvd.ProcessSet"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), process_set="ps")
    with pytest.raises(ValueError, match="device_dense=.*omit it"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), device_dense="/gpu:0")
    with tf.GradientTape() as tape:
        pass
    with pytest.raises(ValueError, match="num_groups=3"):
        hvd.DistributedGradientTape(tape, num_groups=3)
    with pytest.raises(ValueError, match="groups="):
        hvd.DistributedGradientTape(tape, groups=[[0]])
    hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), num_groups=0, groups=None)


def test_ignore_name_scope_is_honoured_in_graphs(hvd, tf, tmp_path_factory):
    import json

    path = hvd.broadcast_object(str(tmp_path_factory.mktemp("scope") / "trace.json"), root_rank=0)

    @tf.function
    def step(x):
        with tf.name_scope("tower"):
            return hvd.allgather(x, name="scoped"), hvd.allgather(x, name="bare", ignore_name_scope=True)

    hvd.start_timeline(path)
    step(tf.ones([2]))
    hvd.stop_timeline()
    hvd.barrier()
    if hvd.rank() == 0:
        labels = {e["args"]["tensors"] for e in json.loads(open(path).read())["traceEvents"] if e["ph"] == "X"}
        assert "tower/scoped" in labels and "bare" in labels, labels
