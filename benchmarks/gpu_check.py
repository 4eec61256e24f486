"""GPU device check of hvd_notebook's runtime: collectives of GPU tensors through NCCL, one process on one GPU.

Sections (each runs on its own: a failure is recorded with its traceback and the next section still runs):

- environment: TensorFlow and Keras versions, the GPU's name, cupy's and NCCL's versions,
  ``hvd.nccl_built()`` (and ``hvd.nccl_enabled()`` where the runtime has it).
- correctness: ``hvd.allreduce`` of a [3, 5] GPU tensor for float16, bfloat16, float32, float64, int32 and
  int64 x Sum, Average, Min, Max and Product, eager and inside ``tf.function(jit_compile=False)``. Each
  call must give the single-rank result (the input itself; an integer Average is compared as numbers),
  leave the result on a GPU (``.device``, and for all but int32, which TensorFlow keeps in host memory
  even "on" a GPU, ``.backing_device``: no host round trip in the API) and write an NCCL_ALLREDUCE phase
  to the timeline. Also 0-d and 1-d tensors, ``grouped_allreduce`` of 10 tensors (fusion: how many NCCL
  calls), ``allgather``, ``broadcast(root_rank=0)``, ``reducescatter`` and ``Compression.fp16``.
  The int32 row runs last, as its own section (correctness_int32): TensorFlow keeps int32 tensors in host
  memory and exports them through DLPack as CPU memory, so a path that gave them to NCCL as device memory
  could break the CUDA context for every section after it.
- training: a small CNN on synthetic 28x28x1 images, with ``hvd.DistributedOptimizer`` and
  ``BroadcastGlobalVariablesCallback(0)`` (the timeline on for its second epoch: NCCL_ALLREDUCE phases
  must appear) and with the plain optimizer: samples/s of each after a warm-up epoch, and their ratio.
- bandwidth: ``hvd.allreduce(op=hvd.Sum)`` of a float32 GPU tensor of 1 MiB .. 1 GiB against a raw NCCL
  allreduce through cupy on a buffer of the same size: median time and algorithm bandwidth (bytes / time).

Run it as one MPI process (``benchmarks/gpu_check.sh`` builds a venv with the ``[gpu,mpich]`` extras and
does this):

    mpiexec -n 1 python benchmarks/gpu_check.py [--out build/gpu_check.json] [--sections training,bandwidth]

The JSON (default: $GPU_CHECK_OUT, else $OUT/gpu_check.json, else build/gpu_check.json) is rewritten after
every section and before every correctness case, so a run that is killed or crashes still leaves the
figures so far and says what was running. Exit status: 0 when every check passed, 1 when one failed, 2 when
the check could not start (no GPU visible, TensorFlow or the runtime missing, more than one rank).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this checkout's runtime, also where it is not installed

# correctness_int32 (the int32 row of the allreduce table) runs last: TensorFlow keeps int32 tensors in host
# memory even when their device is a GPU (their DLPack capsule is a CPU one), and a path that handed such
# memory to NCCL as device memory could break the CUDA context for every section after it
SECTIONS = ("environment", "correctness", "training", "bandwidth", "correctness_int32")
DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "int64")
OPS = ("Sum", "Average", "Min", "Max", "Product")
# relative tolerance of a value check, by dtype (one rank: results should be exact anyway)
RTOL = {"float16": 1e-3, "bfloat16": 1e-2, "float32": 1e-6, "float64": 1e-12, "int32": 0.0, "int64": 0.0}
TRAIN_SAMPLES, TRAIN_BATCH, TRAIN_EPOCHS = 8192, 256, 2
MIB = 1 << 20
# buffer size -> timed repetitions (each after 2 untimed warm-ups)
BANDWIDTH_REPS = {MIB: 30, 4 * MIB: 30, 16 * MIB: 20, 64 * MIB: 10, 256 * MIB: 5, 1024 * MIB: 3}
MAX_TRACEBACKS = 12
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{datetime.now():%H:%M:%S} +{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def default_out() -> Path:
    if os.environ.get("GPU_CHECK_OUT"):
        return Path(os.environ["GPU_CHECK_OUT"])
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "gpu_check.json"
    return ROOT / "build" / "gpu_check.json"


class Report:
    """The JSON result, written atomically whenever something was added."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {
            "check": "hvd_notebook GPU check (benchmarks/gpu_check.py)",
            "started": utc_now(),
            "finished": None, "complete": False, "ok": None, "running": None,
            "host": platform.node(), "python": sys.version.split()[0], "argv": sys.argv[1:],
            "sections": {}, "failed": [], "summary": [], "errors": {},
        }

    def error(self, exc: BaseException) -> str:
        """One line naming ``exc``; its traceback is kept once per distinct line, under "errors"."""
        text = str(exc).strip().splitlines()
        msg = f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")[:300]
        errors = self.data["errors"]
        if msg not in errors:
            errors[msg] = ("".join(traceback.format_exception(exc))[-2500:] if len(errors) < MAX_TRACEBACKS
                           else "(traceback left out: too many distinct errors)")
        return msg

    def running(self, what: str | None) -> None:
        self.data["running"] = what
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)


def trace_phases(path: Path) -> tuple[str, Counter, dict[str, list[int]]]:
    """A Chrome trace's text, its phase names counted, and each phase's recorded byte counts."""
    try:
        text = path.read_text()
    except OSError:
        return "", Counter(), {}
    names: Counter = Counter()
    nbytes: dict[str, list[int]] = {}
    try:
        data = json.loads(text)
        events = data.get("traceEvents", []) if isinstance(data, dict) else data
        for e in events:
            if isinstance(e, dict) and e.get("ph") != "M" and "name" in e:
                names[e["name"]] += 1
                b = (e.get("args") or {}).get("bytes")
                if isinstance(b, int):
                    nbytes.setdefault(e["name"], []).append(b)
    except (ValueError, TypeError, AttributeError):
        pass  # not JSON after all: the text search below still works
    return text, names, nbytes


def sample_values(shape: tuple[int, ...], floating: bool) -> np.ndarray:
    """Small numbers from -3 to 3 (+0.5 for floating dtypes): exact in every dtype checked."""
    v = (np.arange(math.prod(shape)) % 7 - 3).astype(np.float64).reshape(shape)
    return v + 0.5 if floating else v


def problems_text(case: dict[str, Any]) -> str:
    """A failed case's problems in one line: the setup's, else each mode's first."""
    if case.get("setup"):
        return case["setup"]
    return "; ".join(f"{m}: {case[m]['problems'][0]}" for m in ("eager", "graph") if case[m]["problems"])


def nccl_version_text(code: int) -> str:
    """NCCL_VERSION_CODE as text: major*10000 + minor*100 + patch since 2.9, major*1000 + ... before."""
    if code >= 10000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


class GpuCheck:
    def __init__(self, report: Report, tf: Any, hvd: Any, budget_s: float) -> None:
        self.report, self.tf, self.hvd = report, tf, hvd
        self.deadline = T0 + budget_s
        self.cupy: Any = None
        self.traces = Path(tempfile.mkdtemp(prefix="gpu_check_traces_"))
        report.data["traces_dir"] = str(self.traces)

    # ------------------------------------------------------------ helpers
    def time_left(self) -> float:
        return self.deadline - time.perf_counter()

    def sync(self) -> None:
        """Wait for all work queued on the GPU: TensorFlow's stream(s), and through cupy every stream of
        the device (the runtime's NCCL stream too)."""
        self.tf.test.experimental.sync_devices()
        if self.cupy is not None:
            self.cupy.cuda.runtime.deviceSynchronize()

    def gpu_tensor(self, values: np.ndarray, dtype: str) -> Any:
        """``values`` (small, exact in float32) as a tensor of ``dtype`` in the GPU's memory: cast and
        copied there under the device scope (a tf.constant alone stays in host memory)."""
        tf = self.tf
        with tf.device("/GPU:0"):
            return tf.identity(tf.cast(tf.constant(values, tf.float32), getattr(tf, dtype)))

    def run_section(self, name: str) -> None:
        log(f"== {name}")
        sec: dict[str, Any] = {"ok": False, "seconds": None, "error": None, "failures": []}
        self.report.data["sections"][name] = sec
        self.report.running(name)
        t0 = time.perf_counter()
        try:
            getattr(self, f"section_{name}")(sec)
        except Exception as exc:  # recorded; the next section still runs
            sec["error"] = self.report.error(exc)
            log(f"{name}: ERROR {sec['error']}")
        sec["seconds"] = round(time.perf_counter() - t0, 2)
        sec["ok"] = sec["error"] is None and not sec["failures"] and not sec.get("skipped")
        for f in sec["failures"] + ([sec["error"]] if sec["error"] else []):
            self.report.data["failed"].append(f"{name}: {f}")
        self.report.running(None)
        log(f"{name}: {'ok' if sec['ok'] else 'FAILED'} in {sec['seconds']} s")

    # -------------------------------------------------------- environment
    def section_environment(self, sec: dict[str, Any]) -> None:
        tf, hvd = self.tf, self.hvd
        import keras

        gpus = tf.config.list_physical_devices("GPU")
        details = tf.config.experimental.get_device_details(gpus[0])
        build = tf.sysconfig.get_build_info()
        sec.update(tensorflow=tf.__version__, keras=keras.__version__, gpus_visible=len(gpus),
                   gpu_name=details.get("device_name"), compute_capability=details.get("compute_capability"),
                   tf_cuda=build.get("cuda_version"), tf_cudnn=build.get("cudnn_version"),
                   CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES"),
                   HVD_NOTEBOOK_NCCL=os.environ.get("HVD_NOTEBOOK_NCCL"))
        from mpi4py import MPI

        sec["mpi"] = MPI.Get_library_version().strip().splitlines()[0]
        sec["hvd"] = {"size": hvd.size(), "rank": hvd.rank(), "local_rank": hvd.local_rank(),
                      "nccl_built": hvd.nccl_built()}
        if not sec["hvd"]["nccl_built"]:
            sec["failures"].append("hvd.nccl_built() is False (cupy not importable?)")
        if hasattr(hvd, "nccl_enabled"):
            sec["hvd"]["nccl_enabled"] = hvd.nccl_enabled()
            if not sec["hvd"]["nccl_enabled"]:
                sec["failures"].append("hvd.nccl_enabled() is False: hvd.init() made no NCCL communicator")
        try:
            import cupy
            from cupy.cuda import nccl

            sec["cupy"] = cupy.__version__
            sec["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
            sec["cuda_driver"] = cupy.cuda.runtime.driverGetVersion()
            free, total = cupy.cuda.runtime.memGetInfo()
            sec["gpu_memory_gib"] = {"free": round(free / 2**30, 1), "total": round(total / 2**30, 1)}
            sec["nccl_available"] = bool(getattr(nccl, "available", True))
            if not sec["nccl_available"]:
                sec["failures"].append("cupy.cuda.nccl.available is False: libnccl.so.2 could not be loaded "
                                       "(is nvidia-nccl-cu12 installed?)")
            else:
                code = nccl.get_version()
                sec["nccl"] = nccl_version_text(code)
                sec["nccl_version_code"] = code
            self.cupy = cupy
        except Exception as exc:
            sec["failures"].append(f"cupy / NCCL: {self.report.error(exc)}")
        log(f"TF {sec['tensorflow']} (CUDA {sec['tf_cuda']}, cuDNN {sec['tf_cudnn']}), GPU {sec['gpu_name']}, "
            f"cupy {sec.get('cupy')}, NCCL {sec.get('nccl')}, hvd {sec['hvd']}")

    # -------------------------------------------------------- correctness
    def case(self, sec: dict[str, Any], label: str, fn: Any, inputs: list[Any],
             expected: list[tuple[np.ndarray, str | None]], phase: str, rtol: float) -> dict[str, Any]:
        """Run ``fn(*inputs)`` eagerly and in a tf.function; check values, dtypes, devices and the timeline."""
        tf, hvd = self.tf, self.hvd
        result: dict[str, Any] = {}
        for x in inputs:
            backing = getattr(x, "backing_device", None) if x.dtype.name != "int32" else None
            if "GPU" not in (x.device or "").upper() or (backing and "GPU" not in backing.upper()):
                result["setup"] = f"input on {backing or x.device}, not a GPU: the case proves nothing"
        for mode in ("eager", "graph"):
            self.report.running(f"correctness: {label} ({mode})")
            trace = self.traces / (re.sub(r"[^A-Za-z0-9_.-]+", "_", label) + f"_{mode}.json")
            problems: list[str] = []
            r: dict[str, Any] = {}
            try:
                # a fresh tf.function per case: no Python control flow in fn, so no AutoGraph either
                call = fn if mode == "eager" else tf.function(fn, jit_compile=False, autograph=False)
                with tf.device("/GPU:0"):
                    hvd.start_timeline(str(trace))
                    try:
                        out = call(*inputs)
                    finally:
                        hvd.stop_timeline()
                outs = list(out) if isinstance(out, (list, tuple)) else [out]
                r.update(device=outs[0].device, backing_device=getattr(outs[0], "backing_device", None),
                         dtype=outs[0].dtype.name)
                problems += self.compare(outs, expected, rtol)
            except Exception as exc:
                problems.append(self.report.error(exc))
            text, names, nbytes = trace_phases(trace)
            r["phases"] = dict(names)
            if phase in nbytes:
                r["phase_bytes"] = nbytes[phase]
            if phase not in text:
                problems.append(f"no {phase} phase in the timeline (phases: {sorted(names) or 'none'})")
            r["ok"], r["problems"] = not problems, problems
            result[mode] = r
        result["ok"] = "setup" not in result and result["eager"]["ok"] and result["graph"]["ok"]
        sec["cases"][label] = result
        if not result["ok"]:
            sec["failures"].append(f"{label}: {problems_text(result)[:300]}")
        return result

    def compare(self, outs: list[Any], expected: list[tuple[np.ndarray, str | None]], rtol: float) -> list[str]:
        problems: list[str] = []
        if len(outs) != len(expected):
            return [f"{len(outs)} results for {len(expected)} inputs"]
        for i, (y, (want, want_dtype)) in enumerate(zip(outs, expected)):
            tag = f"result {i}: " if len(outs) > 1 else ""
            device = y.device or ""
            if "GPU" not in device.upper():
                problems.append(f"{tag}result on {device or 'no device'}, not a GPU")
            backing = getattr(y, "backing_device", None)
            # TensorFlow keeps int32 tensors in host memory even when their device is a GPU
            if backing is not None and y.dtype.name != "int32" and "GPU" not in backing.upper():
                problems.append(f"{tag}result's memory is on {backing}, not a GPU")
            if want_dtype is not None and y.dtype.name != want_dtype:
                problems.append(f"{tag}dtype {y.dtype.name}, expected {want_dtype}")
            got = np.asarray(y.numpy()).astype(np.float64)
            if got.shape != want.shape:
                problems.append(f"{tag}shape {got.shape}, expected {want.shape}")
            elif not np.allclose(got, want, rtol=rtol, atol=0.0):
                problems.append(f"{tag}wrong values: max |difference| {float(np.max(np.abs(got - want))):.3g}")
        return problems

    def section_correctness(self, sec: dict[str, Any]) -> None:
        self.correctness(sec, [d for d in DTYPES if d != "int32"], others=True)

    def section_correctness_int32(self, sec: dict[str, Any]) -> None:
        sec["note"] = ("TensorFlow keeps int32 tensors in host memory even where their device is a GPU, and "
                       "exports them through DLPack as CPU memory: the runtime has to treat them apart")
        self.correctness(sec, ["int32"], others=False)

    def correctness(self, sec: dict[str, Any], dtypes: list[str], others: bool) -> None:
        """The allreduce table for ``dtypes`` x OPS; with ``others``, the remaining collectives too."""
        sec["cases"] = {}
        table: dict[str, dict[str, str]] = {}
        sec["table"] = table
        for dtype in dtypes:
            table[dtype] = {}
            floating = dtype.startswith(("float", "bfloat"))
            v = sample_values((3, 5), floating)
            try:
                x = self.gpu_tensor(v, dtype)
            except Exception as exc:  # this dtype's row fails; the others still run
                msg = f"could not make a {dtype} GPU tensor: {self.report.error(exc)}"
                table[dtype] = dict.fromkeys(OPS, msg)
                sec["failures"].append(msg)
                continue
            for op_name in OPS:
                # one rank: every op gives back the input; an integer Average may come back as floats
                want_dtype = None if (op_name == "Average" and not floating) else dtype
                res = self.case(sec, f"allreduce {dtype} {op_name}", self.allreduce_with(op_name), [x],
                                [(v, want_dtype)], "NCCL_ALLREDUCE", RTOL[dtype])
                table[dtype][op_name] = "ok" if res["ok"] else problems_text(res)[:240]
            log(f"allreduce {dtype}: " + ", ".join(f"{op} {'ok' if s == 'ok' else 'FAIL'}"
                                                  for op, s in table[dtype].items()))
        if others:
            self.other_collectives(sec)
        n_ok = sum(c["ok"] for c in sec["cases"].values())
        sec["cases_ok"] = f"{n_ok}/{len(sec['cases'])}"

    def allreduce_with(self, op_name: str) -> Any:
        """``t -> hvd.allreduce(t, op=...)``, for the eager call and for a tf.function."""
        hvd, op = self.hvd, getattr(self.hvd, op_name)

        def fn(t: Any) -> Any:
            return hvd.allreduce(t, op=op)

        return fn

    def other_collectives(self, sec: dict[str, Any]) -> None:
        """0-d and 1-d tensors, grouped_allreduce, allgather, broadcast, reducescatter, Compression.fp16."""
        hvd = self.hvd
        values = sample_values
        for shape in ((), (7,)):
            v = values(shape, True)
            self.case(sec, f"allreduce float32 Sum {len(shape)}-d", self.allreduce_with("Sum"),
                      [self.gpu_tensor(v, "float32")], [(v, "float32")], "NCCL_ALLREDUCE", RTOL["float32"])

        shapes = [(i + 1, 3 + i % 4) for i in range(10)]
        vs = [values(s, True) * (i + 1) for i, s in enumerate(shapes)]

        def grouped(*ts: Any) -> Any:
            return hvd.grouped_allreduce(list(ts), op=hvd.Sum)

        res = self.case(sec, "grouped_allreduce 10 x float32", grouped, [self.gpu_tensor(v, "float32") for v in vs],
                        [(v, "float32") for v in vs], "NCCL_ALLREDUCE", RTOL["float32"])
        # fusion: the 10 tensors should go to NCCL as one buffer, one call
        sec["grouped_nccl_calls"] = {m: res[m]["phases"].get("NCCL_ALLREDUCE", 0) for m in ("eager", "graph")}

        v = values((3, 5), True)
        x = self.gpu_tensor(v, "float32")
        self.case(sec, "allgather float32", lambda t: hvd.allgather(t), [x], [(v, "float32")], "NCCL_ALLGATHER",
                  RTOL["float32"])
        self.case(sec, "broadcast float32 root 0", lambda t: hvd.broadcast(t, root_rank=0), [x], [(v, "float32")],
                  "NCCL_BROADCAST", RTOL["float32"])
        self.case(sec, "reducescatter float32 Sum", lambda t: hvd.reducescatter(t, op=hvd.Sum), [x],
                  [(v, "float32")], "NCCL_REDUCESCATTER", RTOL["float32"])
        self.case(sec, "reducescatter float32 Average", lambda t: hvd.reducescatter(t, op=hvd.Average), [x],
                  [(v, "float32")], "NCCL_REDUCESCATTER", RTOL["float32"])
        res = self.case(sec, "allreduce float32 Sum Compression.fp16",
                        lambda t: hvd.allreduce(t, op=hvd.Sum, compression=hvd.Compression.fp16), [x],
                        [(v, "float32")], "NCCL_ALLREDUCE", RTOL["float16"])
        # what NCCL was given: 15 float16 values are 30 bytes (float32 would be 60)
        sec["fp16_nccl_bytes"] = res["eager"].get("phase_bytes")

    # ----------------------------------------------------------- training
    def section_training(self, sec: dict[str, Any]) -> None:
        tf, hvd = self.tf, self.hvd
        import keras

        if self.time_left() < 60:
            sec["skipped"] = f"time budget: {self.time_left():.0f} s left"
            return
        rng = np.random.default_rng(0)
        x = rng.random((TRAIN_SAMPLES, 28, 28, 1), dtype=np.float32)
        y = rng.integers(0, 10, TRAIN_SAMPLES).astype(np.int32)
        steps = math.ceil(TRAIN_SAMPLES / TRAIN_BATCH)
        sec.update(samples=TRAIN_SAMPLES, batch=TRAIN_BATCH, timed_epochs=TRAIN_EPOCHS, steps_per_epoch=steps)

        def build(distributed: bool) -> Any:
            keras.utils.set_random_seed(0)
            model = keras.Sequential([
                keras.Input((28, 28, 1)),
                keras.layers.Conv2D(16, 3, activation="relu"),
                keras.layers.MaxPooling2D(),
                keras.layers.Conv2D(32, 3, activation="relu"),
                keras.layers.Flatten(),
                keras.layers.Dense(10, activation="softmax"),
            ])
            opt = keras.optimizers.SGD(0.01 * hvd.size(), momentum=0.9)
            # jit_compile=False: the hvd collectives in the training step run outside TensorFlow's kernels
            # (a py_function around NCCL, or a numpy_function around MPI), which XLA cannot compile; Keras
            # would otherwise turn XLA on by itself ("auto") because a GPU is visible. The plain model is
            # compiled the same way so that the two rates compare like with like.
            model.compile(optimizer=hvd.DistributedOptimizer(opt) if distributed else opt,
                          loss="sparse_categorical_crossentropy", jit_compile=False)
            return model

        def fit(model: Any, epochs: int, callbacks: list[Any]) -> Any:
            return model.fit(x, y, batch_size=TRAIN_BATCH, epochs=epochs, verbose=0, callbacks=callbacks)

        for kind in ("distributed", "plain"):
            r: dict[str, Any] = {}
            sec[kind] = r
            self.report.running(f"training: {kind}")
            model = build(kind == "distributed")
            callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)] if kind == "distributed" else []
            t0 = time.perf_counter()
            fit(model, 1, callbacks)  # warm-up: tracing, cuDNN's autotuning
            r["warmup_epoch_s"] = round(time.perf_counter() - t0, 2)
            if kind == "distributed":
                trace = self.report.path.with_name(self.report.path.stem + "_train_trace.json")
                hvd.start_timeline(str(trace))
                try:
                    fit(model, 1, callbacks)
                finally:
                    hvd.stop_timeline()
                text, names, _ = trace_phases(trace)
                r["trace"] = str(trace)
                r["timeline_epoch_phases"] = dict(names)
                r["nccl_allreduce_per_step"] = round(names.get("NCCL_ALLREDUCE", 0) / steps, 2)
                if "NCCL_ALLREDUCE" not in text:
                    sec["failures"].append(f"no NCCL_ALLREDUCE phase in the timeline of a training epoch "
                                           f"(phases: {sorted(names) or 'none'})")
            try:
                tf.config.experimental.reset_memory_stats("GPU:0")
            except Exception:  # only the peak figure is lost
                pass
            self.sync()
            t0 = time.perf_counter()
            hist = fit(model, TRAIN_EPOCHS, callbacks)
            self.sync()
            elapsed = time.perf_counter() - t0
            r["seconds"] = round(elapsed, 3)
            r["samples_per_s"] = round(TRAIN_SAMPLES * TRAIN_EPOCHS / elapsed, 1)
            r["final_loss"] = float(hist.history["loss"][-1])
            weight = model.trainable_weights[0]
            r["weights_device"] = str(getattr(getattr(weight, "value", weight), "device", "?"))
            try:
                r["gpu_peak_mib"] = round(tf.config.experimental.get_memory_info("GPU:0")["peak"] / MIB, 1)
            except Exception:
                r["gpu_peak_mib"] = None
            if "GPU" not in r["weights_device"].upper():
                sec["failures"].append(f"{kind}: the model's weights are on {r['weights_device']}, not a GPU")
            if not math.isfinite(r["final_loss"]):
                sec["failures"].append(f"{kind}: the loss is {r['final_loss']}")
            log(f"training {kind}: {r['samples_per_s']:.0f} samples/s, loss {r['final_loss']:.3f}, "
                f"weights on {r['weights_device']}")
        sec["distributed_over_plain"] = round(sec["distributed"]["samples_per_s"] / sec["plain"]["samples_per_s"], 3)

    # ---------------------------------------------------------- bandwidth
    def section_bandwidth(self, sec: dict[str, Any]) -> None:
        if self.cupy is None:  # the environment section did not run, or failed: fail here too, with the reason
            import cupy

            self.cupy = cupy
        cp = self.cupy
        from cupy.cuda import nccl

        rows: list[dict[str, Any]] = []
        sec["sizes"] = rows
        median = statistics.median
        with cp.cuda.Device(0):
            comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
            stream = cp.cuda.Stream(non_blocking=True)
            idle = []
            for _ in range(20):
                t0 = time.perf_counter()
                self.sync()
                idle.append(time.perf_counter() - t0)
            # every hvd figure includes one sync() (TF's sync_devices + cudaDeviceSynchronize)
            sec["sync_overhead_s"] = median(idle)
            try:
                for nbytes, reps in BANDWIDTH_REPS.items():
                    row: dict[str, Any] = {"bytes": nbytes, "label": f"{nbytes // MIB} MiB"}
                    rows.append(row)
                    free = cp.cuda.runtime.memGetInfo()[0]
                    if free < 6 * nbytes + (1 << 30):  # hvd's input, output and buffers, cupy's two
                        row["skipped"] = f"only {free / 2**30:.1f} GiB of GPU memory free"
                        continue
                    if self.time_left() < 20:
                        row["skipped"] = f"time budget: {self.time_left():.0f} s left"
                        continue
                    self.report.running(f"bandwidth: {row['label']}")
                    row.update(self.time_one_size(comm, stream, nbytes, reps))
                    if "GPU" not in (row["hvd_result_device"] or "").upper():
                        sec["failures"].append(f"{row['label']}: hvd's result is on {row['hvd_result_device']}, "
                                               "not a GPU (the time includes a host round trip)")
                    if not row["hvd_correct"] or not row["raw_correct"]:
                        sec["failures"].append(f"{row['label']}: wrong sum (hvd {row['hvd_correct']}, "
                                               f"raw NCCL {row['raw_correct']})")
                    log(f"bandwidth {row['label']:>8}: hvd {row['hvd_s'] * 1e3:8.3f} ms {row['hvd_GBps']:7.1f} GB/s"
                        f" | raw NCCL {row['raw_s'] * 1e3:8.3f} ms {row['raw_GBps']:7.1f} GB/s"
                        f" | hvd/raw {row['hvd_over_raw']:.2f}x")
                    self.report.write()
            finally:
                stream.synchronize()
                comm.destroy()
                cp.get_default_memory_pool().free_all_blocks()
        if any("skipped" in r and "budget" in r["skipped"] for r in rows):
            sec["failures"].append("sizes skipped for the time budget")

    def time_one_size(self, comm: Any, stream: Any, nbytes: int, reps: int) -> dict[str, Any]:
        tf, hvd, cp = self.tf, self.hvd, self.cupy
        from cupy.cuda import nccl

        n = nbytes // 4
        with tf.device("/GPU:0"):
            t = tf.fill([n], tf.constant(1.0, tf.float32))
        send = cp.asarray(np.ones(n, np.float32))  # a copy from the host: no cupy kernel needed
        recv = cp.empty_like(send)

        def raw() -> None:
            comm.allReduce(send.data.ptr, recv.data.ptr, n, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)
            stream.synchronize()

        out: dict[str, Any] = {"reps": reps}
        result = None
        for _ in range(2):  # warm-up (and the first call's allocations)
            result = hvd.allreduce(t, op=hvd.Sum)
            self.sync()
            raw()
        out["hvd_result_device"] = result.device
        with tf.device("/GPU:0"):
            out["hvd_correct"] = bool(tf.reduce_all(tf.equal(result, t)).numpy())
        out["raw_correct"] = bool(np.all(recv[:4].get() == 1.0) and np.all(recv[-4:].get() == 1.0))
        del result
        hvd_times, raw_times = [], []
        for _ in range(reps):  # interleaved, so that drift hits both alike
            self.sync()
            t0 = time.perf_counter()
            result = hvd.allreduce(t, op=hvd.Sum)
            self.sync()
            hvd_times.append(time.perf_counter() - t0)
            del result
            t0 = time.perf_counter()
            raw()
            raw_times.append(time.perf_counter() - t0)
        hvd_s, raw_s = statistics.median(hvd_times), statistics.median(raw_times)
        out.update(hvd_s=hvd_s, raw_s=raw_s, hvd_GBps=round(nbytes / hvd_s / 1e9, 2),
                   raw_GBps=round(nbytes / raw_s / 1e9, 2), hvd_over_raw=round(hvd_s / raw_s, 3),
                   hvd_min_s=min(hvd_times), raw_min_s=min(raw_times))
        return out

    # ------------------------------------------------------------ summary
    def summary(self) -> list[str]:
        d = self.report.data
        secs = d["sections"]
        lines = [f"gpu_check: {'PASSED' if d['ok'] else 'FAILED'}"]
        env = secs.get("environment", {})
        if env:
            lines.append(f"  environment  {'ok  ' if env['ok'] else 'FAIL'}  GPU {env.get('gpu_name')}, "
                         f"TF {env.get('tensorflow')}, cupy {env.get('cupy')}, NCCL {env.get('nccl')}, "
                         f"hvd {env.get('hvd')}")
        cor, cor32 = secs.get("correctness", {}), secs.get("correctness_int32", {})
        if cor:
            lines.append(f"  correctness  {'ok  ' if cor['ok'] else 'FAIL'}  cases ok: {cor.get('cases_ok')}, "
                         f"grouped_allreduce NCCL calls for 10 tensors: {cor.get('grouped_nccl_calls')}")
        if cor32:
            lines.append(f"  correctness_int32 {'ok  ' if cor32['ok'] else 'FAIL'}  cases ok: {cor32.get('cases_ok')}"
                         " (run last)")
        if cor or cor32:
            table = {**cor.get("table", {}), **cor32.get("table", {})}
            table = {d: table[d] for d in DTYPES if d in table}
            if table:
                lines.append("      allreduce " + "".join(f"{op:>9}" for op in OPS))
                for dtype, row in table.items():
                    lines.append(f"      {dtype:9} " + "".join(
                        f"{'ok' if row.get(op) == 'ok' else ('FAIL' if op in row else '-'):>9}" for op in OPS))
        tr = secs.get("training", {})
        if tr:
            dist, plain = tr.get("distributed", {}), tr.get("plain", {})
            lines.append(f"  training     {'ok  ' if tr['ok'] else 'FAIL'}  DistributedOptimizer "
                         f"{dist.get('samples_per_s')} samples/s, plain {plain.get('samples_per_s')} samples/s, "
                         f"ratio {tr.get('distributed_over_plain')}, NCCL_ALLREDUCE per step "
                         f"{dist.get('nccl_allreduce_per_step')}")
        bw = secs.get("bandwidth", {})
        if bw:
            lines.append(f"  bandwidth    {'ok  ' if bw['ok'] else 'FAIL'}  (sync overhead "
                         f"{(bw.get('sync_overhead_s') or 0) * 1e6:.0f} us, included in hvd's times)")
            lines.append(f"      {'size':>8} {'hvd ms':>10} {'hvd GB/s':>9} {'raw ms':>10} {'raw GB/s':>9} "
                         f"{'hvd/raw':>8}")
            for r in bw.get("sizes", []):
                if "hvd_s" in r:
                    lines.append(f"      {r['label']:>8} {r['hvd_s'] * 1e3:10.3f} {r['hvd_GBps']:9.1f} "
                                 f"{r['raw_s'] * 1e3:10.3f} {r['raw_GBps']:9.1f} {r['hvd_over_raw']:8.2f}")
                else:
                    lines.append(f"      {r['label']:>8} {r.get('skipped', 'not run')}")
        for name, sec in secs.items():
            if sec.get("skipped"):
                lines.append(f"  {name}: skipped: {sec['skipped']}")
        if d["failed"]:
            lines.append(f"  {len(d['failed'])} failure(s):")
            lines += [f"    - {f}" for f in d["failed"][:25]]
            if len(d["failed"]) > 25:
                lines.append(f"    ... and {len(d['failed']) - 25} more (see the JSON)")
        return lines


def cannot_start(report: Report, why: str, **facts: Any) -> int:
    report.data["sections"]["preflight"] = {"ok": False, "error": why, **facts}
    report.data.update(ok=False, complete=True, running=None, failed=[f"preflight: {why}"],
                       finished=utc_now(),
                       summary=[f"gpu_check: FAILED: {why}"])
    report.write()
    print(f"gpu_check: FAILED: {why}", file=sys.stderr, flush=True)
    print(f"gpu_check: wrote {report.path}", flush=True)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=default_out(), help="the JSON result (default: %(default)s)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated, from {', '.join(SECTIONS)} (default: all)")
    parser.add_argument("--budget-s", type=float, default=float(os.environ.get("GPU_CHECK_BUDGET_S", 380)),
                        help="skip the training and the larger bandwidth sizes past this many seconds")
    args = parser.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {SECTIONS}")
    faulthandler.enable()  # a crash in native code (NCCL, CUDA) still prints where Python was
    report = Report(args.out.resolve())
    report.running("preflight")
    log(f"gpu_check: results to {report.path}")

    facts: dict[str, Any] = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}
    try:
        import tensorflow as tf
    except Exception as exc:
        return cannot_start(report, f"TensorFlow cannot be imported ({report.error(exc)})", **facts)
    facts.update(tensorflow=tf.__version__, built_with_cuda=tf.test.is_built_with_cuda())
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        why = ("TensorFlow was built without CUDA (tensorflow-cpu installed instead of tensorflow[and-cuda]?)"
               if not facts["built_with_cuda"] else
               "TensorFlow's CUDA build finds no GPU (driver, CUDA_VISIBLE_DEVICES, or CUDA libraries missing: "
               "see TensorFlow's log above)")
        return cannot_start(report, f"no GPU visible: {why}", **facts)
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)  # leave room for cupy's buffers
    tf.get_logger().setLevel("ERROR")  # no retracing notices: every correctness case traces a new tf.function
    try:
        import hvd_notebook.runtime as hvd

        hvd.init()
    except Exception as exc:
        return cannot_start(report, f"hvd.init() failed ({report.error(exc)})", **facts)
    if hvd.size() != 1:
        return cannot_start(report, f"run as one process (mpiexec -n 1), not {hvd.size()}", **facts)
    report.data["sections"]["preflight"] = {"ok": True, **facts, "gpus": [g.name for g in gpus]}
    log(f"TensorFlow {tf.__version__} sees {len(gpus)} GPU(s); hvd.init() done")

    check = GpuCheck(report, tf, hvd, args.budget_s)
    for name in sections:
        check.run_section(name)
    report.data["ok"] = all(report.data["sections"][s]["ok"] for s in sections)
    report.data.update(complete=True, running=None, finished=utc_now())
    report.data["summary"] = check.summary()
    report.write()
    print("\n".join(report.data["summary"]), flush=True)
    try:
        hvd.shutdown()
    except Exception as exc:  # the figures are written already
        log(f"hvd.shutdown() failed: {exc}")
    return 0 if report.data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
