"""The engine -> kernel progress message: one typed structure for both sides."""

from __future__ import annotations

import pytest

from hvd_notebook.messages import KEY_PREFIX, RING, ProgressUpdate, RankState, RunKind


def test_round_trip_through_plain_types():
    update = ProgressUpdate("12.0", RunKind.EVALUATE, RankState.DONE, epoch=1, epochs=3, step=10, steps=10,
                            samples=320, elapsed=1.5, logs={"loss": 0.5}, epoch_logs={0: {"loss": 0.7}}, rank=1,
                            seq=42, step_times=[[8, 0.25, 0.125], [9, 0.5, 0.0]])
    data = update.to_dict()
    assert data["kind"] == "evaluate" and type(data["kind"]) is str and type(data["state"]) is str
    assert ProgressUpdate.from_dict(data) == update


def test_from_dict_fills_defaults_and_reads_keys_sent_as_text():
    update = ProgressUpdate.from_dict({"run": "7.1", "epoch_logs": {"2": {"loss": 1}}, "logs": {"acc": "0.5"}})
    assert update.kind is RunKind.FIT and update.state is RankState.RUNNING
    assert update.epoch_logs == {2: {"loss": 1}} and update.logs == {"acc": 0.5}


def test_unknown_kind_or_state_is_an_error():
    with pytest.raises(ValueError):
        ProgressUpdate.from_dict({"run": "1", "kind": "train"})
    with pytest.raises(ValueError):
        ProgressUpdate.from_dict({"run": "1", "state": "sleeping"})


def test_keys_rotate_over_the_ring():
    assert ProgressUpdate.key(0) == f"{KEY_PREFIX}0" == ProgressUpdate.key(RING)
    assert ProgressUpdate.is_key(ProgressUpdate.key(5)) and not ProgressUpdate.is_key("other")


def test_kinds_and_states():
    assert RunKind.FIT.has_curves and RunKind.CUSTOM.has_curves and not RunKind.PREDICT.has_curves
    assert RankState.DONE.finished and RankState.FAILED.finished and not RankState.EPOCH_END.finished
