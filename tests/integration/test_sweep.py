"""``%%hvd sweep`` through a real kernel, as JupyterLab runs it: a small sweep on scikit-learn's digits (1 and 2
ranks × two per-rank batches) is interrupted after its first points, run again, skips what it finished, and
ends with every point in the results file, the table and the plots in the cell's output, and the world of
before the sweep back."""

from __future__ import annotations

import base64
import json
import re
import time

from conftest import ProcessWatch, artifacts_dir, assert_gone, execute, figure, started_kernel

SETUP = """%%hvd
import keras
from sklearn.datasets import load_digits
x, y = load_digits(return_X_y=True)
x = (x / 16.0).astype("float32")
x_shard, y_shard = hvd.shard((x[:1200], y[:1200]))
x_val, y_val = x[1200:], y[1200:]
"""

SWEEP = """%%hvd sweep -n 1,2 --batch 16,64 --lr linear --target val_accuracy>=0.5 --results {path}
if point.ranks == 2 and point.batch == 64:
    raise ValueError("a point that fails")
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(point.lr(0.05))),
              loss="sparse_categorical_crossentropy", metrics=["accuracy"])
model.fit(x_shard, y_shard, batch_size=point.batch, epochs=3, validation_data=(x_val, y_val), verbose=0,
          callbacks=[hvd.callbacks.MetricAverageCallback(), *point.callbacks(0.05)])
"""


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _displays(kc, msg_id: str) -> tuple[dict, str, list[dict]]:
    """The reply, the text output and every display bundle (shown or updated) of one request."""
    reply = kc.get_shell_msg(timeout=600)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = kc.get_shell_msg(timeout=600)
    text, bundles = [], []
    while True:
        msg = kc.get_iopub_msg(timeout=30)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind = msg["msg_type"]
        if kind == "stream":
            text.append(msg["content"]["text"])
        elif kind == "error":
            text.append("\n".join(msg["content"]["traceback"]))
        elif kind in ("display_data", "update_display_data"):
            bundles.append(msg["content"]["data"])
        elif kind == "status" and msg["content"]["execution_state"] == "idle":
            return reply, "".join(text), bundles


def test_a_sweep_interrupted_and_run_again_skips_its_finished_points(tmp_path):
    path = tmp_path / "sweep.jsonl"
    with ProcessWatch() as watch, started_kernel() as (km, kc):
        execute(kc, "%load_ext hvd_notebook\nfrom hvd_notebook.kernel.session import Session")
        reply, out = execute(kc, "%hvd start -n 2 --standby off")
        assert reply["content"]["status"] == "ok", out
        reply, out = execute(kc, SETUP)
        assert reply["content"]["status"] == "ok", out

        t0 = time.monotonic()
        msg_id = kc.execute(SWEEP.format(path=path))
        while len(_lines(path)) < 2:  # the two 1-rank points
            assert time.monotonic() - t0 < 300, f"the sweep's first points did not end: {_lines(path)}"
            time.sleep(0.2)
        km.interrupt_kernel()
        reply, out, _ = _displays(kc, msg_id)
        first = time.monotonic() - t0
        assert reply["content"]["status"] == "error" and "KeyboardInterrupt" in reply["content"]["ename"], out
        assert "sweep interrupted; 2 of 4 point(s) are in" in out and "run the cell again" in out, out
        assert "back on a world of 2 rank(s), the set-up cells replayed" in out, out
        assert [r["point"] for r in _lines(path)] == ["ranks=1 batch=16 lr=linear warmup=0",
                                                      "ranks=1 batch=64 lr=linear warmup=0"]

        t0 = time.monotonic()
        msg_id = kc.execute(SWEEP.format(path=path))
        reply, out, bundles = _displays(kc, msg_id)
        assert reply["content"]["status"] == "ok", out
        assert "2 of 4 point(s) are in" in out and "running the other 2" in out, out
        assert "3 point(s) measured, 1 failed" in out, out  # the failed point is recorded; the sweep went on
        rows = {r["point"]: r for r in _lines(path)}
        assert len(rows) == 4 == len(_lines(path)), rows  # nothing run twice
        failed = rows.pop("ranks=2 batch=64 lr=linear warmup=0")
        assert failed["status"] == "failed" and re.match(r"rank \d raised ValueError: a point that fails",
                                                         failed["error"]), failed
        assert all(r["status"] == "ok" and r["samples_per_s"] > 0 and r["seconds_to_target"] is not None
                   for r in rows.values()), rows
        two = rows["ranks=2 batch=16 lr=linear warmup=0"]
        assert two["efficiency"] > 0 and two["noise_scale"] and two["steps_to_target"], two
        assert 0 < two["communication"] <= 1 and rows["ranks=1 batch=16 lr=linear warmup=0"]["communication"] is None
        last = bundles[-1]
        assert "sweep: 4 of 4 point(s) done, target val_accuracy>=0.5" in last["text/plain"], last["text/plain"]
        png = re.search(r"<img alt='hvd sweep plots' src='data:image/png;base64,([A-Za-z0-9+/=]+)'", last["text/html"])
        assert png, last["text/html"]
        (artifacts_dir() / "sweep.png").write_bytes(base64.b64decode(png[1]))  # (docs/img/sweep.png is one)
        assert any("fit | " in b["text/plain"] for b in bundles), "no live row of a running point was shown"
        assert "failed: rank" in last["text/plain"], last["text/plain"]
        figure(f"sweep of 4 points: interrupted after {first:.0f} s (2 points), the rest in "
               f"{time.monotonic() - t0:.0f} s (one failing); 2-rank efficiency {two['efficiency']:.2f}, "
               f"communication {100 * two['communication']:.0f}% of each step")

        _, out = execute(kc, "print('N', Session.get().cluster.n)\n%hvd stop")  # the 2-rank world of before
        assert "N 2" in out and "Cluster stopped." in out, out
    assert_gone(watch.seen)  # every world of every point, and the last
