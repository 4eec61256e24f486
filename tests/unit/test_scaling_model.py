"""``hvd-notebook scaling``'s projection (``hvd_notebook.scaling``): the ring allreduce's cost, what a step
waits for, the report and the command's input checks. The measuring itself runs in
``integration/test_scaling.py``."""

from __future__ import annotations

import pytest

from hvd_notebook import scaling

LINKS = scaling.Links(gpus_per_node=8, intra_gbps=100.0, inter_gbps=10.0, intra_latency_us=1.0, inter_latency_us=4.0)
# one rank's figures as the worker writes them: 2 ms forward, 6 ms with backward and the update
POINT = {"ranks": 1, "model": "mlp", "device": "cpu", "batch": 32, "parameters": 25_000_000,
         "gradient_bytes": 100_000_000, "bucket_bytes": [1_000_000, 49_000_000, 50_000_000],
         "forward_s": 0.002, "compute_s": 0.006, "hvd_step_s": 0.006, "ddp_step_s": 0.0065}


def test_a_ring_allreduce_sends_twice_n_minus_one_over_n_of_the_bytes():
    assert scaling.ring_allreduce_s(1e9, 1, LINKS) == 0.0
    # 4 GPUs in a node: 2*3/4 of 1 GB at 100 GB/s (15 ms), and 6 steps of 1 us
    assert scaling.ring_allreduce_s(1e9, 4, LINKS) == pytest.approx(0.015 + 6e-6)
    # 16 GPUs span two nodes: the slower link and its latency
    assert scaling.ring_allreduce_s(1e9, 16, LINKS) == pytest.approx(2 * 15 / 16 * 0.1 + 30 * 4e-6)


def test_a_step_waits_for_the_last_bucket_or_what_backward_cannot_hide():
    within = scaling.project(POINT, 8, LINKS)  # 100 MB at 100 GB/s: 1.75 ms, under backward's 4 ms
    assert within.communication_s == pytest.approx(sum(scaling.ring_allreduce_s(b, 8, LINKS)
                                                       for b in POINT["bucket_bytes"]))
    assert within.waited_s == pytest.approx(scaling.ring_allreduce_s(50_000_000, 8, LINKS))
    across = scaling.project(POINT, 64, LINKS)  # 10 GB/s: about 20 ms, longer than backward
    assert across.waited_s == pytest.approx(across.communication_s - 0.004)
    assert across.step_s == pytest.approx(0.006 + across.waited_s)
    assert across.efficiency == pytest.approx(0.006 / across.step_s) and across.efficiency < within.efficiency < 1
    assert across.images_per_s == pytest.approx(64 * 32 / across.step_s)


def test_the_report_shows_each_point_and_the_projection():
    two = {**POINT, "ranks": 2, "hvd_step_s": 0.008, "ddp_step_s": 0.0075}
    text = scaling.report([POINT, two], LINKS)
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line[:1].isdigit()}
    assert rows["2"][1:4] == ["8.0", "8000.0", "75%"] and rows["2"][4:7] == ["7.5", "8533.3", "80%"], text
    assert {"8", "64", "256"} <= set(rows) and "a model, not a measurement" in text


@pytest.mark.parametrize(("text", "ranks"), [("4", [1, 2, 4]), ("3", [1, 2, 3]), ("2,8", [1, 2, 8]), ("1", [1])])
def test_ranks_are_a_number_or_a_list_and_always_start_at_one(text, ranks):
    assert scaling.ranks_list(text) == ranks


@pytest.mark.parametrize("text", ["0", "a,b", "", "-2"])
def test_bad_ranks_say_what_to_give(text):
    with pytest.raises(ValueError, match="positive numbers of ranks"):
        scaling.ranks_list(text)


def test_a_link_must_be_positive():
    with pytest.raises(ValueError, match="--inter-gbps must be positive"):
        scaling.Links(inter_gbps=0)
