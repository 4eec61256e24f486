"""The decision every rank takes alike from all ranks' waiting collectives (runtime/core/matching.py)."""

import threading

from hvd_notebook.runtime.core import coordinator
from hvd_notebook.runtime.core.matching import Entry, decide
from hvd_notebook.runtime.core.signatures import JOIN, Signature, allgather_signature, allreduce_signature


def _allreduce(name: str, shape: tuple = (4,), by_order: bool = False, dtype: str = "float32") -> Entry:
    return Entry(name, by_order, True, allreduce_signature(1, dtype, (shape,), 1.0, 1.0, name))


def _allgather(name: str, by_order: bool = False) -> Entry:
    return Entry(name, by_order, False, allgather_signature(("float32",), ((),), name))


_JOIN = Entry("", True, False, JOIN)


def test_names_in_different_orders_run_in_the_first_ranks_order():
    rank0 = [_allreduce("a"), _allreduce("b"), _allreduce("c")]
    rank1 = [_allreduce("c"), _allreduce("a")]
    decision = decide([rank0, rank1], [False, False])
    assert [v.positions for v in decision.verdicts] == [(0, 1), (2, 0)]  # a, then c; b waits
    assert all(v.error is None and v.serve is None for v in decision.verdicts)


def test_a_repeated_name_matches_occurrence_by_occurrence():
    rank0 = [_allreduce("x"), _allreduce("x")]
    rank1 = [_allreduce("x")]
    assert [v.positions for v in decide([rank0, rank1], [False, False]).verdicts] == [(0, 0)]


def test_same_name_different_shapes_fails_on_every_rank_naming_the_ranks():
    decision = decide([[_allreduce("w", (3,))], [_allreduce("w", (4,))]], [False, False])
    (verdict,) = decision.verdicts
    assert verdict.positions == (0, 0)
    assert "allreduce of tensor 'w' does not match across ranks" in verdict.error
    assert "rank(s) [0]" in verdict.error and "rank(s) [1]" in verdict.error


def test_lone_automatic_names_pair_by_call_order_even_where_they_drifted():
    rank0 = [_allreduce("allreduce.noname.7", by_order=True)]
    rank1 = [_allreduce("allreduce.noname.9", by_order=True)]
    (verdict,) = decide([rank0, rank1], [False, False]).verdicts
    assert verdict.positions == (0, 0) and verdict.error is None


def test_automatic_names_of_asynchronous_calls_pair_by_name_only():
    """A binding's worker threads (torch's *_async) reach the agreement in any order, differently on each rank:
    a lone call there is no program order, and pairing the lone calls would pair two different calls (Horovod's
    test_horovod_reducescatter_async_fused once failed so, shapes (8,) against (8, 8))."""
    signature = allreduce_signature(1, "float32", ((4,),), 1.0, 1.0, "allreduce.noname.3")
    in_program_order = coordinator.Request(signature, "allreduce.noname.3", 5, False)
    assert in_program_order.by_order and in_program_order.round_hash(alone=True) == 5 ^ 0
    seen = []

    def worker():
        coordinator.calls_here_are_unordered()
        request = coordinator.Request(signature, "allreduce.noname.3", 5, False)
        seen.append((request.by_order, request.round_hash(alone=True) != 5))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [(False, True)]  # paired by name, and the name is in the lone call's hash
    rank0 = [_allreduce("reducescatter.noname.3", (8,))]
    rank1 = [_allreduce("reducescatter.noname.4", (8, 8))]
    assert decide([rank0, rank1], [False, False]).verdicts == []  # they wait for their partners


def test_lone_automatic_calls_of_different_kinds_fail_at_once():
    rank0 = [_allreduce("allreduce.noname.3", by_order=True)]
    rank1 = [_allgather("allgather.noname.3", by_order=True)]
    (verdict,) = decide([rank0, rank1], [False, False]).verdicts
    assert "Ranks called different collectives" in verdict.error


def test_unmatched_names_wait_until_every_rank_is_stuck_then_fail():
    lists = [[_allreduce("a")], [_allreduce("b")]]
    assert decide(lists, [True, False]).verdicts == []  # rank 1 may still issue "a"
    (verdict,) = decide(lists, [True, True]).verdicts
    assert "matched by name" in verdict.error and "rank 0: allreduce('a')" in verdict.error
    # several waiting requests on a rank: other threads may still issue the partner
    assert decide([[_allreduce("a"), _allreduce("c")], [_allreduce("b")]], [True, True]).verdicts == []


def test_joined_ranks_serve_allreduces_and_refuse_the_rest():
    (verdict,) = decide([[_JOIN], [_allreduce("g")]], [False, False]).verdicts
    assert verdict.positions == (None, 0) and verdict.error is None and verdict.serve is not None
    (verdict,) = decide([[_JOIN], [_allgather("g")]], [False, False]).verdicts
    assert verdict.error.startswith("After hvd.join() a rank can only take part in allreduce")
    assert decide([[_JOIN], [_JOIN]], [False, False]).all_joined


def test_a_refused_call_fails_everywhere_naming_the_rank_that_refused():
    good = _allgather("x")
    refused = Entry("x", False, False, good.signature.refused("the tensor needs at least one dimension"))
    (verdict,) = decide([[refused], [good]], [False, False]).verdicts
    assert verdict.refused_by == (0,)
    assert "refused on rank(s) [0]: the tensor needs at least one dimension" in verdict.error


def test_a_refusal_never_equals_a_valid_signature():
    sig = Signature("allreduce", (("op", "Sum"),), "x")
    assert sig.refused("why") != sig and sig.refused("why").refusal == "why" and sig.refusal is None


def test_a_request_may_share_a_call_only_where_every_rank_can_fuse_it():
    def fusable(name: str, yes: bool) -> Entry:
        return _allreduce(name)._replace(fusable=yes)

    rank0 = [fusable("a", True), fusable("b", True), fusable("c", False)]
    rank1 = [fusable("a", True), fusable("b", False), fusable("c", False)]
    assert [v.fusable for v in decide([rank0, rank1], [False, False]).verdicts] == [True, False, False]
    # after hvd.join() on a rank, that rank serves each call alone: none is fused
    (served,) = decide([[fusable("a", True)], [_JOIN]], [False, False]).verdicts
    assert served.serve is not None and not served.fusable
