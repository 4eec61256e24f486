"""A cluster's shape: resolved once from what was asked for and the GPUs leased, made smaller only where
``--min-np`` allows."""

from __future__ import annotations

import dataclasses

import pytest

from hvd_notebook.cluster import ClusterError
from hvd_notebook.cluster.launching.shape import ClusterShape


def test_without_a_count_a_rank_per_leased_gpu():
    shape = ClusterShape.resolve(None, ["0", "2"], None)
    assert shape == ClusterShape(ranks=2, gpus=("0", "2"), min_ranks=2)


def test_a_count_asked_for_is_kept_and_min_np_is_its_floor():
    assert ClusterShape.resolve(4, [], 2) == ClusterShape(ranks=4, gpus=(), min_ranks=2)


def test_a_shape_is_one_value_never_changed_in_place():
    shape = ClusterShape.resolve(2, [], None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        shape.ranks = 3  # type: ignore[misc]
    hash(shape)


def test_a_smaller_shape_drops_the_gone_gpus_where_min_np_allows():
    shape = ClusterShape.resolve(None, ["0", "1", "2"], 2)
    smaller = shape.smaller(2, "GPU(s) 1 are gone", ("1",))
    assert smaller == ClusterShape(ranks=2, gpus=("0", "2"), min_ranks=2) and shape.ranks == 3


def test_fewer_ranks_than_min_np_are_refused_with_what_to_do():
    shape = ClusterShape.resolve(3, [], None)  # (no --min-np: every rank)
    with pytest.raises(ClusterError, match=r"^host b is gone: 2 rank\(s\) could go on, fewer than the 3 that "
                                           r"--min-np asks for\. Start again with what is left \(%hvd start "
                                           r"--restart -n 2\), or with --min-np 2"):
        shape.smaller(2, "host b is gone")
