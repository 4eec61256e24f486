"""Pure parts of the runtime (hvd_notebook.runtime): no MPI, no engines."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import numpy as np
import pytest

from hvd_notebook import config
from hvd_notebook.messages import EventKind
from hvd_notebook.runtime.core import fusion, ops, signatures
from hvd_notebook.runtime.core.exceptions import MismatchError
from hvd_notebook.runtime.core.signatures import describe_mismatch
from hvd_notebook.runtime.core.timeline import Timeline

RUNTIME = Path(__file__).resolve().parents[2] / "hvd_notebook" / "runtime"

# the core (runtime/core): each module may import (at module level or inside a function) only modules of a
# lower layer, and no binding
CORE_LAYERS = [
    {"ops", "exceptions", "events", "timeline", "topology", "noise_scale", "collective_time"},
    {"rules", "gradients", "signatures", "fusion", "shared_memory", "transports"},
    {"matching", "collective_logic"},
    {"coordinator"},
    {"negotiation"},
    {"mpi_backend", "array_backend"},  # (array_backend: the MPI backend's logic over an array module and a transport)
    {"nccl_backend"},  # (array_backend on cupy and NCCL)
    {"world"},
    {"process_sets"},
    {"basics", "objects", "compression"},
    {"elastic", "debugger"},
    {"__init__"},
]
# what each binding may import of the runtime: the core, itself, and (Keras on TensorFlow) the TensorFlow one
BINDINGS = {"tensorflow": {"core", "tensorflow"}, "keras": {"core", "tensorflow", "keras"}, "torch": {"core", "torch"}}
FRAMEWORKS = {"tensorflow": {"tensorflow"}, "keras": {"tensorflow", "keras"}, "torch": {"torch"}}


def _imports(path: Path) -> list[tuple[str, str]]:
    """(runtime package, module) for each runtime module that ``path`` (a module of a runtime package)
    imports, anywhere in it, and ("", name) for each module outside the package."""
    found = []
    package = path.parent.name
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found += [(package, node.module.split(".")[0])] if node.module else \
                [(package, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 2 and node.module:
            parts = node.module.split(".")
            found += [(parts[0], parts[1])] if len(parts) > 1 else [(parts[0], a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(("", node.module))
        elif isinstance(node, ast.Import):
            found += [("", a.name) for a in node.names]
    return found


def test_every_core_module_has_a_layer():
    assert {p.stem for p in (RUNTIME / "core").glob("*.py")} == set().union(*CORE_LAYERS)


def test_core_modules_import_only_lower_layers_and_no_framework():
    layer_of = {m: i for i, layer in enumerate(CORE_LAYERS) for m in layer}
    wrong = []
    for path in (RUNTIME / "core").glob("*.py"):
        for package, imported in _imports(path):
            if package == "core" and layer_of[imported] >= layer_of[path.stem]:
                wrong.append(f"core/{path.name} (layer {layer_of[path.stem]}) imports {imported} "
                             f"(layer {layer_of[imported]})")
            elif package in BINDINGS or imported.split(".")[0] in ("tensorflow", "keras", "torch"):
                wrong.append(f"core/{path.name} imports {package or imported}")
    assert not wrong, wrong


@pytest.mark.parametrize("binding", sorted(BINDINGS))
def test_each_binding_imports_only_the_core_and_its_own_framework(binding):
    wrong = []
    for path in (RUNTIME / binding).glob("*.py"):
        for package, imported in _imports(path):
            if package and package not in BINDINGS[binding]:
                wrong.append(f"{binding}/{path.name} imports runtime.{package}.{imported}")
            top = imported.split(".")[0]
            if not package and top in ("tensorflow", "keras", "torch") and top not in FRAMEWORKS[binding]:
                wrong.append(f"{binding}/{path.name} imports {top}")
    assert not wrong, wrong


def test_the_backends_never_import_each_other():
    assert ("core", "nccl_backend") not in _imports(RUNTIME / "core" / "mpi_backend.py")
    assert ("core", "mpi_backend") not in _imports(RUNTIME / "core" / "nccl_backend.py")


def test_importing_the_runtime_loads_no_mpi_tensorflow_or_cupy():
    import subprocess

    code = ("import sys, hvd_notebook.runtime; "
            "print([m for m in ('mpi4py', 'tensorflow', 'cupy', 'keras') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ------------------------------------------------------------------ ops
def test_ops_have_horovods_values_and_names():
    assert (ops.Average, ops.Sum, ops.Adasum, ops.Min, ops.Max, ops.Product) == (0, 1, 2, 3, 4, 5)
    assert all(ops.op_named(name) == op for op, name in ops.OP_NAMES.items())
    with pytest.raises(NotImplementedError, match="Adasum"):
        ops.check_op(ops.Adasum)
    with pytest.raises(ValueError, match="op=42 is not supported"):
        ops.check_op(42)
    ops.check_op(ops.Max)


def test_one_op_check_lists_what_the_call_accepts():
    assert ops.op_refusal(ops.Sum) is None and ops.op_refusal(ops.Product) is None
    assert ops.op_refusal(ops.Adasum) == ("op=hvd.Adasum is not supported by hvd_notebook's built-in runtime; give "
                                         "op=hvd.Average, hvd.Sum, hvd.Min, hvd.Max or hvd.Product.")
    assert ops.op_refusal(ops.Min, (ops.Average, ops.Sum), "hvd.DistributedOptimizer") == (
        "hvd.DistributedOptimizer: op=hvd.Min is not supported here; give op=hvd.Average or hvd.Sum.")
    assert ops.op_refusal("Sum", what="hvd.allreduce") == ("hvd.allreduce: op='Sum' is not supported; give "
                                                           "op=hvd.Average, hvd.Sum, hvd.Min, hvd.Max or hvd.Product.")
    assert ops.op_refusal([1]) is not None  # (unhashable: named, not a TypeError)
    with pytest.raises(NotImplementedError, match="Adasum is not supported"):  # Horovod's types
        ops.check_op(ops.Adasum, (ops.Average, ops.Sum))
    with pytest.raises(ValueError, match="give op=hvd.Average or hvd.Sum"):
        ops.check_op(ops.Max, (ops.Average, ops.Sum))
    with pytest.raises(ValueError, match="Adasum"):
        ops.check_op(ops.Adasum, (ops.Average, ops.Sum), error=ValueError)


def test_scale_floats_in_place_integers_in_their_dtype():
    floats = np.array([1.0, 2.0], np.float32)
    assert ops.scale(floats, 0.5) is floats and floats.tolist() == [0.5, 1.0]
    ints = np.array([3, 5], np.int32)
    scaled = ops.scale(ints, 0.5)
    assert scaled.dtype == np.int32 and scaled.tolist() == [1, 2] and ints.tolist() == [3, 5]


def test_average_of_integers_keeps_their_dtype_truncated_toward_zero():
    summed = np.array([3, 4, -3], np.int64)
    out = ops.average(summed, 2)
    assert out.dtype == np.int64 and out.tolist() == [1, 2, -1]
    floats = np.array([3.0, 4.0], np.float32)
    assert ops.average(floats, 2) is floats and floats.tolist() == [1.5, 2.0]


def test_finish_reduction_averages_then_postscales():
    assert ops.finish_reduction(np.array([4.0]), ops.Average, 2, 3.0).tolist() == [6.0]
    assert ops.finish_reduction(np.array([4.0]), ops.Sum, 2, 1.0).tolist() == [4.0]


def test_reduce_dtype_widens_half_precision_only():
    assert ops.reduce_dtype(np.dtype(np.float16)) == np.float32
    assert ops.reduce_dtype(ops.bfloat16()) == np.float32
    assert ops.reduce_dtype(np.dtype(np.int16)) == np.int16
    assert ops.reduce_dtype(np.dtype(np.float64)) == np.float64
    assert ops.numpy_dtype("bfloat16") == ops.bfloat16() and ops.numpy_dtype("int8") == np.int8


@pytest.mark.parametrize("rows,size,expected", [(5, 2, [3, 2]), (4, 2, [2, 2]), (1, 3, [1, 0, 0]), (0, 2, [0, 0]),
                                                (7, 3, [3, 2, 2])])
def test_even_rows(rows, size, expected):
    assert ops.even_rows(rows, size) == expected


# ------------------------------------------------------------ signatures
def test_describe_mismatch_names_ranks_and_field():
    a = signatures.allreduce_signature(ops.Sum, "float32", ((3,),), 1.0, 1.0, "w")
    b = signatures.allreduce_signature(ops.Sum, "float32", ((4,),), 1.0, 1.0, "w")
    text = describe_mismatch([a, b, a])
    assert text.startswith("allreduce of tensor 'w' does not match across ranks: shapes: ")
    assert "rank(s) [0, 2] ((3,),)" in text and "rank(s) [1] ((4,),)" in text
    assert "Every rank must pass the same op, dtype, shapes" in text


def test_describe_mismatch_of_different_collectives():
    text = describe_mismatch([signatures.BARRIER, signatures.allgather_object_signature("x")])
    assert "Ranks called different collectives" in text and "rank 0: barrier" in text
    assert "rank 1: allgather_object('x')" in text


def test_signature_equality_ignores_the_label():
    a = signatures.broadcast_signature(0, ("float32",), ((2,),), "a")
    assert a == signatures.broadcast_signature(0, ("float32",), ((2,),), "b")
    assert a != signatures.broadcast_signature(1, ("float32",), ((2,),), "a")
    assert a.named("c").name == "c" and a.named(None) is a
    assert a.describe() == "broadcast('a')" and signatures.BARRIER.describe() == "barrier"


def test_signature_builders():
    sig = signatures.allreduce_signature(ops.Average, "float16", ((2, 3),), 0.5, 2.0, "g", via="NCCL")
    assert sig.kind == "allreduce" and dict(sig.fields) == {
        "op": "Average", "dtype": "float16", "shapes": ((2, 3),), "prescale_factor": 0.5, "postscale_factor": 2.0,
        "via": "NCCL"}
    call = signatures.AllreduceCall.of(sig)
    assert (call.op, call.dtype, call.prescale, call.postscale, call.via) == (ops.Average, "float16", 0.5, 2.0,
                                                                                "NCCL")
    assert call.elements == 6
    assert dict(signatures.allgather_signature(("int8",), ((2,),), "x").fields) == {
        "dtypes": ("int8",), "trailing shapes": ((2,),)}
    assert dict(signatures.alltoall_signature("int8", (2,), "x").fields) == {"dtype": "int8", "trailing shape": (2,)}
    assert dict(signatures.reducescatter_signature(ops.Max, "int8", (4, 2), "x").fields) == {
        "op": "Max", "dtype": "int8", "shape": (4, 2)}
    assert dict(signatures.broadcast_object_signature(1, "o").fields) == {"root_rank": 1}
    assert isinstance(MismatchError("x"), ValueError)


# ---------------------------------------------------------------- fusion
def test_fusion_groups_by_dtype_within_the_threshold(monkeypatch):
    items = [("f4", 1024), ("f8", 24), ("f4", 1024), ("f4", 1024)]
    monkeypatch.delenv("HOROVOD_FUSION_THRESHOLD", raising=False)
    assert fusion.fusion_groups(items) == [[0, 2, 3], [1]]
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "2048")
    assert fusion.fusion_groups(items) == [[0, 2], [1], [3]]
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "0")
    assert fusion.fusion_groups(items) == [[0], [1], [2], [3]]
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "not a number")
    assert fusion.fusion_threshold() == config.FUSION_THRESHOLD.default


def test_fused_label():
    assert fusion.fused_label(["a"]) == "a" and fusion.fused_label(["a", "b", "c"]) == "a +2 fused"


def test_aligned_offsets_start_every_tensor_on_64_bytes():
    assert fusion.aligned_offsets([16, 16], 4) == ([0, 16], 32)  # 64 bytes each: no padding
    assert fusion.aligned_offsets([3, 5, 1], 4) == ([0, 16, 32], 33)
    assert fusion.aligned_offsets([1, 1], 8) == ([0, 8], 9)
    assert fusion.aligned_offsets([100, 1], 1) == ([0, 128], 129)
    assert fusion.aligned_offsets([], 4) == ([], 0)


def test_buffer_pool_reuses_free_buffers_only():
    pool = fusion.BufferPool(max_bytes=1024, per_size=2)
    a = pool.get(64)
    assert fusion.is_aligned(a) and a.nbytes == 64
    view = a.view(np.float32)
    b = pool.get(64)
    assert b.__array_interface__["data"] != a.__array_interface__["data"]  # ``view`` keeps ``a`` in use
    del view, a, b
    c = pool.get(64)
    assert c.__array_interface__["data"][0] in {raw.__array_interface__["data"][0]
                                                for _, raw in pool.buffers[64]}
    assert len(pool.buffers[64]) == 2 and pool.total == 128


def test_buffer_pool_stays_within_its_bounds():
    pool = fusion.BufferPool(max_bytes=128, per_size=2)
    held = [pool.get(64).view(np.uint8) for _ in range(3)]  # callers hold views (see BufferPool.get)
    assert len(pool.buffers[64]) == 2 and pool.total == 128
    big = pool.get(256)
    assert 256 not in pool.buffers and fusion.is_aligned(big)
    assert all(fusion.is_aligned(h) for h in held)
    arr = pool.empty(5, np.float64)
    assert arr.dtype == np.float64 and arr.shape == (5,) and fusion.is_aligned(arr)


# -------------------------------------------------------------- timeline
def test_timeline_marks_cycles_only_when_asked():
    timeline = Timeline()
    timeline.mark_cycle(1)
    assert timeline.events == []  # off
    timeline.start("t.json")
    timeline.mark_cycle(1)
    with timeline.phase("MPI_ALLREDUCE", "x", 8):
        pass
    assert [e["name"] for e in timeline.events] == ["MPI_ALLREDUCE"]
    timeline.start("t.json", mark_cycles=True)
    timeline.mark_cycle(7)
    (event,) = timeline.events
    assert event["name"] == "CYCLE_START" and event["ph"] == "i" and event["args"] == {"collective": 7}
    path, events = timeline.take()
    assert path == "t.json" and events == [event] and not timeline.active


# -------------------------------------------------------------- settings
@pytest.mark.parametrize("value,expected", [("1", True), ("true", True), ("Yes", True), ("on", True), ("0", False),
                                            ("false", False), ("no", False), ("", False), ("maybe", None)])
def test_runtime_flags_parse_alike(value, expected):
    for setting in (config.NCCL, config.SHM_AGREEMENT, config.TIMELINE_MARK_CYCLES, config.STALL_CHECK_DISABLE):
        want = setting.default if expected is None else expected
        assert setting.flag({setting.name: value}) is want
        assert setting.flag({}) is setting.default


def test_runtime_numbers():
    assert config.STALL_CHECK_TIME.number({config.STALL_CHECK_TIME.name: "2.5"}) == 2.5
    assert config.STALL_SHUTDOWN_TIME.number({}) == 0.0
    assert config.FUSION_THRESHOLD.number({config.FUSION_THRESHOLD.name: "64"}) == 64
    assert config.TIMELINE.text({}) is None and config.TIMELINE.text({"HOROVOD_TIMELINE": "t.json"}) == "t.json"


def test_alltoall_splits():
    from hvd_notebook.runtime.core.mpi_backend import alltoall_splits

    assert alltoall_splits((4, 3), None, 2, "x").tolist() == [2, 2]
    assert alltoall_splits((4,), [3, 1], 2, "x").tolist() == [3, 1]
    with pytest.raises(ValueError, match="must divide evenly by the number of ranks"):
        alltoall_splits((5,), None, 2, "x")
    with pytest.raises(ValueError, match="summing to the first dimension"):
        alltoall_splits((4,), [3, 2], 2, "x")
    with pytest.raises(ValueError, match="one non-negative entry per rank"):
        alltoall_splits((4,), [4], 2, "x")
    with pytest.raises(ValueError, match="at least one dimension"):
        alltoall_splits((), None, 2, "x")


def test_an_elastic_commit_is_an_event_once_on_disk_and_its_removal_too(tmp_path, monkeypatch, capsys):
    """Rank 0's commit tells the listener its summary once the file is written, and an empty text once the
    run that made it returned (the commit removed); where nobody listens, a commit is not printed, a warning is."""
    from hvd_notebook.runtime.core import elastic, events

    monkeypatch.setenv("HVD_NOTEBOOK_ELASTIC_DIR", str(tmp_path))
    told: list[tuple[str, str, bool]] = []
    events.listen(lambda kind, text, fields: told.append((kind, text, (tmp_path / elastic._Spill.FILE).exists())))
    try:
        spill = elastic._Spill()
        spill.write({"values": {"step": 4}, "variables": []})
        spill.thread.join()
        spill.clear()
    finally:
        events.listen(None)
    assert [(k, t.split(", committed at")[0], on_disk) for k, t, on_disk in told] == [
        ("commit", "step=4", True), ("commit", "", False)]
    events.emit(EventKind.COMMIT, "step=5, committed at 12:00:00")
    events.emit(EventKind.WARNING, "a warning")
    assert capsys.readouterr().err == f"{config.WARNING_PREFIX}: a warning\n"


def test_each_binding_raises_the_core_errors_as_its_frameworks_one_class_each():
    """TensorFlow: a mismatch as FailedPreconditionError, a bad argument as InvalidArgumentError; PyTorch: both as
    RuntimeErrors (Horovod's classes); the core's class stays a base, its attributes come along, and one class
    serves every error of a kind (it is made once, not per call)."""
    tf = pytest.importorskip("tensorflow")
    pytest.importorskip("torch")
    from hvd_notebook.runtime.core.exceptions import MismatchError, RefusedError, StallError
    from hvd_notebook.runtime.tensorflow import mpi_ops as tf_ops
    from hvd_notebook.runtime.torch import mpi_ops as torch_ops

    first, second = (tf_ops._ERRORS.convert(MismatchError(f"rank 1 called {c}")) for c in ("allgather", "broadcast"))
    assert isinstance(first, tf.errors.FailedPreconditionError) and isinstance(first, MismatchError)
    assert type(first) is type(second) and first.message == "rank 1 called allgather" == str(first)
    refused = tf_ops._ERRORS.convert(RefusedError("no Adasum", refused_here=True))
    assert isinstance(refused, tf.errors.InvalidArgumentError) and isinstance(refused, RefusedError)
    assert refused.refused_here and str(refused) == "no Adasum"
    stall = StallError("waited")
    assert tf_ops._ERRORS.convert(stall) is stall and torch_ops._ERRORS.convert(stall) is stall
    refused = torch_ops._ERRORS.convert(RefusedError("no Adasum", refused_here=True))
    assert type(refused) is torch_ops.CollectiveRefusedError and refused.refused_here and str(refused) == "no Adasum"
    assert type(torch_ops._ERRORS.convert(MismatchError("x"))) is torch_ops.CollectiveMismatchError


# ------------------------------------------------------------------ the gradient noise scale's estimator
def test_the_noise_scale_estimator_follows_mccandlish_appendix_a1():
    from hvd_notebook.runtime.core.noise_scale import NoiseScale

    # |G_small|^2 = 3, |G_big|^2 = 2 over 2 ranks of 32: |G|^2 = (64*2 - 32*3)/32 = 1, tr(S) = 1/(1/32 - 1/64) = 64
    ns = NoiseScale(decay=0.5)
    assert ns.value() is None
    ns.record(local_sq=3.0, global_sq=2.0, ranks=2, batch=32)
    assert ns.gradient_sq() == pytest.approx(1.0) and ns.value() == pytest.approx(64.0)
    # the averages are taken of |G|^2 and tr(S), then divided (not an average of the ratios)
    ns.record(local_sq=5.0, global_sq=2.0, ranks=2, batch=32)  # |G|^2 = -1, tr(S) = 192
    assert ns.gradient_sq() == pytest.approx((0.5 * 1 + 1 * -1) / 1.5)
    assert ns.value() is None  # the averaged |G|^2 is not positive: the gradient is lost in its noise
    ns.record(local_sq=float("inf"), global_sq=2.0, ranks=2, batch=32)  # a skipped loss-scaling step
    assert ns.steps == 2


def test_without_a_batch_the_noise_scale_takes_it_when_read():
    from hvd_notebook.runtime.core.noise_scale import NoiseScale

    told, untold = NoiseScale(0.9), NoiseScale(0.9)
    for local, global_ in ((3.0, 2.0), (3.5, 2.1)):
        told.record(local, global_, ranks=4, batch=8, passes=4)
        untold.record(local, global_, ranks=4, passes=4)
    assert untold.value() is None
    assert untold.value(batch_size=8) == pytest.approx(told.value())
    assert NoiseScale(0.9).value(8) is None


def test_the_noise_scale_settings(monkeypatch):
    from hvd_notebook.runtime.core import noise_scale

    assert noise_scale.enabled(2) and not noise_scale.enabled(1)
    monkeypatch.setenv("HVD_NOTEBOOK_NOISE_SCALE", "0")
    assert not noise_scale.enabled(2)
    monkeypatch.setenv("HVD_NOTEBOOK_NOISE_SCALE_DECAY", "1.5")
    with pytest.raises(ValueError, match="HVD_NOTEBOOK_NOISE_SCALE_DECAY=1.5: the decay is a number in"):
        noise_scale.NoiseScale().record(3.0, 2.0, ranks=2, batch=32)


# ------------------------------------------------------------------ the seconds in collectives
class _Caller:
    """A thread of its own that enters or leaves a clock when told, one order at a time."""

    def __init__(self, clock) -> None:
        import queue
        import threading

        self.clock, self.orders, self.done = clock, queue.Queue(), queue.Queue()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while (order := self.orders.get()) is not None:
            getattr(self.clock, order)()
            self.done.put(order)

    def do(self, order: str) -> None:
        self.orders.put(order)
        self.done.get(timeout=10)


def test_the_collective_clock_counts_overlapping_calls_once(monkeypatch):
    from hvd_notebook.runtime.core import collective_time

    now = [0.0]
    monkeypatch.setattr(collective_time.time, "perf_counter", lambda: now[0])
    clock = collective_time.CollectiveClock()
    a, b = _Caller(clock), _Caller(clock)
    # a call of thread a in [0, 2], one of thread b in [1, 3]: the union is 3 seconds, not their sum of 4
    a.do("enter")
    now[0] = 1.0
    b.do("enter")
    assert clock.seconds() == 1.0 and clock.active == 2
    now[0] = 2.0
    a.do("leave")
    assert clock.seconds() == 2.0 and clock.active == 1  # b is still in: the clock runs on
    now[0] = 3.0
    b.do("leave")
    assert clock.active == 0 and clock.seconds() == 3.0
    now[0] = 10.0  # nothing under way: the clock stands
    assert clock.seconds() == 3.0
    now[0] = 11.0
    b.do("enter")
    now[0] = 11.5
    b.do("leave")
    assert clock.seconds() == 3.5
    a.orders.put(None)
    b.orders.put(None)


def test_the_collective_clock_pairs_under_threads_and_runs_in_real_time():
    import threading
    import time

    from hvd_notebook.runtime.core.collective_time import CollectiveClock

    clock = CollectiveClock()

    def calls() -> None:
        for _ in range(20000):
            clock.enter()
            clock.leave()

    threads = [threading.Thread(target=calls) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert clock.active == 0
    before = clock.seconds()
    clock.enter()
    time.sleep(0.05)
    assert clock.seconds() - before >= 0.05  # a call under way counts
    clock.leave()
    assert 0.05 <= clock.seconds() - before < 5


class _Work:
    fusion_key, nbytes, solo, done = None, 0, True, False

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def run(self, followers: list) -> None:
        if self.fail:
            raise RuntimeError("the data did not move")


class _Coordinator:
    """Answers ``acquire`` as told (a turn, a lone refusal, an error, a request moved by another's call) and
    notes how many calls the collective clock counted at each step."""

    def __init__(self, answer: object) -> None:
        self.answer, self.seen = answer, []

    def _active(self) -> int:
        from hvd_notebook.runtime.core.collective_time import CLOCK

        return CLOCK.active

    def acquire(self, sig, name, h, allow_joined, data, work, lone):
        self.seen.append(("acquire", self._active()))
        if isinstance(self.answer, BaseException):
            raise self.answer
        if self.answer == "done":
            if work is not None:  # (an earlier request's call moved its data)
                work.done = True
            return False
        if self.answer is None and not lone:  # (only a lone call is sent back)
            return False
        return self.answer

    def release(self) -> None:
        self.seen.append(("release", self._active()))

    def run_fused(self, work) -> None:
        work.run([])

    def join(self, serve) -> None:
        self.seen.append(("join", self._active()))


def _negotiator(answer: object):
    from hvd_notebook.runtime.core.negotiation import Negotiator

    negotiator = Negotiator.__new__(Negotiator)  # (no MPI: only what acquire, release, run and join use)
    negotiator.size, negotiator.seq, negotiator.timeline = 2, 0, Timeline()
    negotiator._hashes, negotiator.coordinator, negotiator.joined_before = {}, _Coordinator(answer), set()
    return negotiator


@pytest.mark.parametrize("answer", [False, True, None, "done", KeyboardInterrupt(), MismatchError("differ")])
def test_every_path_through_the_negotiator_leaves_the_collective_clock_as_it_entered(answer):
    from hvd_notebook.runtime.core.collective_time import CLOCK
    from hvd_notebook.runtime.core.signatures import BARRIER

    assert CLOCK.active == 0
    negotiator = _negotiator(answer)
    # acquire ... release (a turn, check): counted from the agreement until the release
    try:
        turn = negotiator.acquire(BARRIER, lone=True)
    except BaseException as exc:
        assert exc is answer and CLOCK.active == 0  # failed: left at once
    else:
        if turn is None:  # lone, others waiting: no turn, no release; the caller retries
            assert CLOCK.active == 0
        else:
            assert CLOCK.active == 1
            negotiator.release()
            assert CLOCK.active == 0
    assert negotiator.coordinator.seen[0] == ("acquire", 1)
    # run: its data moved by its own call, by an earlier one's (done: no release), or failing
    for fail in (False, True):
        negotiator.coordinator.seen.clear()
        try:
            negotiator.run(BARRIER, _Work(fail))
        except BaseException:
            pass
        assert CLOCK.active == 0, (answer, fail, negotiator.coordinator.seen)
        assert negotiator.coordinator.seen[0] == ("acquire", 1)
    negotiator.join(lambda sig: None)
    assert negotiator.coordinator.seen[-1] == ("join", 1) and CLOCK.active == 0


def test_a_world_of_one_rank_counts_no_collective():
    from hvd_notebook.runtime.core.collective_time import CLOCK
    from hvd_notebook.runtime.core.signatures import BARRIER

    negotiator = _negotiator(False)
    negotiator.size = 1
    before = CLOCK.seconds()
    negotiator.acquire(BARRIER)
    assert CLOCK.active == 0
    negotiator.release()
    negotiator.run(BARRIER, _Work())
    assert CLOCK.active == 0 and CLOCK.seconds() == before and negotiator.coordinator.seen == []


def test_the_noise_scale_of_a_loop_that_does_not_tell_its_batch_says_so_once_then_takes_the_told_one(monkeypatch):
    """A custom loop (PyTorch's DistributedOptimizer, a tape): ``hvd.noise_scale()`` says once what it needs and
    returns None; once the loop told the dashboard its batch (``progress.report(batch_size=...)``), it uses it."""
    import warnings

    from hvd_notebook.runtime.core import noise_scale as ns

    monkeypatch.setattr(ns, "_latest", None)
    monkeypatch.setattr(ns, "_told_batch", None)
    monkeypatch.setattr(ns, "_said_it_needs_the_batch", False)
    assert ns.noise_scale() is None  # (no step yet: nothing to say)
    estimator = ns.NoiseScale(decay=0.0)
    ns.record(estimator, local_sq=3.0, global_sq=2.0, ranks=2)  # (no batch: a custom loop)
    with pytest.warns(UserWarning, match=r"hvd.noise_scale\(batch_size=32\).*progress.report"):
        assert ns.noise_scale() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: not again
        assert ns.noise_scale() is None
        assert ns.noise_scale(batch_size=32) == pytest.approx(64.0)
        ns.tell_batch(16)
        assert ns.noise_scale() == pytest.approx(32.0)
        assert ns.noise_scale(batch_size=32) == pytest.approx(64.0)  # (an explicit batch wins)
