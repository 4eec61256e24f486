"""Pure parts of the process sets (hvd_notebook.runtime.core.process_sets): no MPI, no engines."""

from __future__ import annotations

import numpy as np
import pytest

from hvd_notebook.runtime.core import process_sets
from hvd_notebook.runtime.core.process_sets import IdPool, ProcessSet, check_ranks, sets_to_register


def test_a_process_set_keeps_its_ranks_sorted_and_starts_unregistered():
    ps = ProcessSet([3, 0, np.int64(2)])
    assert ps.ranks == [0, 2, 3] and all(type(r) is int for r in ps.ranks)
    assert ps.process_set_id is None and ps.mpi_comm is None
    assert ps.size() is None and ps.rank() is None  # not registered: no answer, no error
    assert str(ps) == "ProcessSet(process_set_id=None, ranks=[0, 2, 3], mpi_comm=None)"
    assert ProcessSet(range(2)).ranks == [0, 1]


@pytest.mark.parametrize("bad", [[0, "1"], [0.5], [True]])
def test_a_process_set_takes_integer_ranks_only(bad):
    with pytest.raises(ValueError, match="list of process ranks or an mpi4py Comm"):
        ProcessSet(bad)


def test_the_global_set_is_id_0():
    assert process_sets.global_process_set.process_set_id == 0


def test_ranks_are_checked_as_horovod_does():
    assert check_ranks([2, 0], 4) == (0, 2)
    with pytest.raises(ValueError, match="duplicate rank: 1"):
        check_ranks([1, 0, 1], 4)
    with pytest.raises(ValueError, match="invalid rank: 4"):
        check_ranks([0, 4], 4)
    with pytest.raises(ValueError, match="invalid rank: -1"):
        check_ranks([-1], 4)
    with pytest.raises(ValueError, match="at least one rank"):
        check_ranks([], 4)


def test_sets_to_register_orders_communicators_first_and_skips_known_ones():
    # 4 ranks: communicators {0,2} and {1,3} (each listed by its two backends), then [1], [0,1,2,3], [1]
    from_comms = [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert sets_to_register(4, from_comms, [[1], [3, 2, 1, 0], [1]], []) == [(0, 2), (1, 3), (1,)]
    # those registered already (and the world) are not registered again
    assert sets_to_register(4, [], [[0, 2], [3]], [(0, 1, 2, 3), (0, 2)]) == [(3,)]
    with pytest.raises(ValueError, match="invalid rank: 7"):
        sets_to_register(4, [], [[7]], [])


def test_ids_are_handed_out_in_order_and_reused_oldest_first():
    ids = IdPool()
    assert [ids.take(), ids.take(), ids.take()] == [1, 2, 3]
    ids.give_back(2)
    ids.give_back(1)
    assert [ids.take(), ids.take(), ids.take()] == [2, 1, 4]


def test_a_process_set_argument_that_is_not_one_is_refused_before_any_communication():
    with pytest.raises(ValueError, match=r"hvd.allreduce\(process_set=\[0\]\): process_set takes a hvd.ProcessSet"):
        process_sets.backends([0], "hvd.allreduce")
    with pytest.raises(ValueError, match="process_set takes a hvd.ProcessSet"):
        process_sets.check("all", "hvd.DistributedOptimizer")
    process_sets.check(None, "hvd.DistributedOptimizer")
    process_sets.check(ProcessSet([0]), "hvd.DistributedOptimizer")


def test_included_before_init_reports_the_error_code():
    assert process_sets.included(0) == process_sets.PROCESS_SET_ERROR_INIT == -1
