"""How a suspend pickles what plain pickling loses or breaks, and the process's own state (the RNGs).

``Pickler`` is cloudpickle's with a ``reducer_override`` that sends framework objects through their own
formats; it imports no framework: it looks at ``sys.modules`` for the ones the rank already imported.

- Keras 3 and Keras 2 (``tf_keras``) models: their config, compile config, weights (numpy) and their
  compiled optimizer as an object of its own, so that a name bound to ``model.optimizer`` stays that object.
  An optimizer: its class (a ``hvd.DistributedOptimizer``'s is made at run time: cloudpickle takes it by
  value), config, variables (``iterations``, momentum slots) and noise-scale estimator; its variables are
  assigned when the model it belongs to is rebuilt and compiled with it.
- PyTorch: tensors and parameters off the CPU are moved to host (and back to their device where there is
  one); a parameter loses the hook that a ``hvd.DistributedOptimizer`` put on it; that optimizer and a
  ``DistributedDataParallel`` hold this world's reductions, so they are refused (``Unsaveable``): the cell
  that made them is replayed and ``state_of`` keeps their state for ``suspension.reconcile``.
- ``hvd.elastic`` states: without their queue of host messages; the variables' committed values as numpy,
  paired again with the restored model's variables.
"""

from __future__ import annotations

import contextlib
import io
import queue
import random
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import cloudpickle
import numpy as np

_KERAS_FLAVOURS = ("keras", "tf_keras")
_HVD_TORCH_OPTIMIZER = ("hvd_notebook.runtime.torch.optimizer", "_DistributedOptimizer")
_ELASTIC_STATE = ("hvd_notebook.runtime.core.elastic", "State")
# an optimizer being restored: itself, its variables' values, the paths of the variables it trains
_pending_optimizer_values: dict[int, tuple[Any, list[Any], list[str | None]]] = {}


class Unsaveable(TypeError):
    """An object that holds what a new world cannot have (a process group, a hook on this world's
    reductions): replaying the line that made it is the way to get it back."""


def _has_base(obj: Any, where: tuple[str, str]) -> bool:
    return any((c.__module__, c.__name__) == where for c in type(obj).__mro__)


class Pickler(cloudpickle.Pickler):
    """cloudpickle's pickler, with the framework formats above. A function defined in ``namespace`` (a cell's)
    keeps no copy of its globals: restored, its globals are the namespace it is restored into
    (``unpickling_into``), so that it sees what a replay or a later cell binds there.

    Args:
        file: where the pickle goes.
        protocol: the pickle protocol.
        namespace: the namespace being saved.
    """

    def __init__(self, file: Any, protocol: int, namespace: dict[str, Any] | None = None) -> None:
        super().__init__(file, protocol=protocol)
        self._namespace = namespace

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.FunctionType) and self._namespace is not None and obj.__globals__ is self._namespace:
            return _rebuild_function, (obj.__code__, obj.__name__, obj.__defaults__, obj.__closure__,
                                       obj.__kwdefaults__, obj.__qualname__, obj.__doc__, obj.__dict__)
        for reducer in _REDUCERS:
            reduced = reducer(obj)
            if reduced is not NotImplemented:
                return reduced
        return super().reducer_override(obj)


def _file_reduce(obj: Any) -> Any:
    # (cloudpickle would keep a file opened for reading as a copy of its text: not the file any more)
    if isinstance(obj, io.IOBase) and not isinstance(obj, (io.BytesIO, io.StringIO)):
        raise Unsaveable(f"an open file ({getattr(obj, 'name', type(obj).__name__)}): opened again by replay")
    return NotImplemented


_target: list[dict[str, Any]] = []  # the namespace being restored into


@contextlib.contextmanager
def unpickling_into(namespace: dict[str, Any]) -> Iterator[None]:
    """Within it, the cells' functions unpickled take ``namespace`` as their globals.

    Args:
        namespace: the namespace the state is restored into.
    """
    _target.append(namespace)
    try:
        yield
    finally:
        _target.pop()


def _rebuild_function(code: Any, name: str, defaults: Any, closure: Any, kwdefaults: Any, qualname: str,
                      doc: Any, attributes: dict[str, Any]) -> Any:
    function = types.FunctionType(code, _target[-1] if _target else {}, name, defaults, closure)
    function.__kwdefaults__, function.__qualname__, function.__doc__ = kwdefaults, qualname, doc
    function.__dict__.update(attributes)
    return function


# ------------------------------------------------------------------ PyTorch
def _torch_reduce(obj: Any) -> Any:
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(obj, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)):
        return NotImplemented
    if _has_base(obj, _HVD_TORCH_OPTIMIZER):
        raise Unsaveable("hvd.DistributedOptimizer: its hooks hold this world's reductions; made again by replay, "
                         "its state_dict loaded into it")
    if isinstance(obj, torch.nn.parallel.DistributedDataParallel):
        raise Unsaveable("DistributedDataParallel: holds this world's process group; made again by replay, its "
                         "state_dict loaded into it")
    if isinstance(obj, torch.nn.Parameter):
        state = {k: v for k, v in vars(obj).items() if k != "_hvd_notebook_hook"}  # (a hook into this world)
        return _rebuild_parameter, (obj.detach().cpu(), obj.requires_grad, str(obj.device), state)
    if isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta") and not obj.is_sparse:
        return _rebuild_tensor, (obj.detach().cpu(), obj.requires_grad, str(obj.device))
    return NotImplemented


def _device(torch: Any, device: str) -> str:
    """``device`` where this rank has it (its pinned GPU is cuda:0 in both worlds), else the CPU."""
    return device if device == "cpu" or (device.startswith("cuda") and torch.cuda.is_available()) else "cpu"


def _rebuild_tensor(data: Any, requires_grad: bool, device: str) -> Any:
    import torch

    return data.to(_device(torch, device)).requires_grad_(requires_grad)


def _rebuild_parameter(data: Any, requires_grad: bool, device: str, state: dict[str, Any]) -> Any:
    import torch

    param = torch.nn.Parameter(data.to(_device(torch, device)), requires_grad)
    param.__dict__.update(state)
    return param


# ------------------------------------------------------------------ Keras 3 and Keras 2
def _keras_of(obj: Any) -> tuple[str, Any] | tuple[None, None]:
    for flavour in _KERAS_FLAVOURS:
        module = sys.modules.get(flavour)
        if module is not None and isinstance(obj, (module.Model, module.optimizers.Optimizer)):
            return flavour, module
        legacy = getattr(getattr(module, "optimizers", None), "legacy", None)
        if legacy is not None and isinstance(obj, legacy.Optimizer):
            return flavour, module
    return None, None


def host_array(value: Any) -> Any:
    """A TensorFlow or Keras variable's (or tensor's) value as a numpy array on the host. On the CPU, without a
    copy: the array shares the value's buffer, which TensorFlow copies before a later write to the variable."""
    tf = sys.modules.get("tensorflow")
    if tf is not None:
        try:
            return np.asarray(tf.convert_to_tensor(value))
        except (TypeError, ValueError):  # not a TensorFlow value
            pass
    return np.asarray(value)


def _variables(holder: Any) -> list[Any]:
    found = holder.variables
    return list(found() if callable(found) else found)


def _keras_reduce(obj: Any) -> Any:
    flavour, module = _keras_of(obj)
    if flavour is None:
        return NotImplemented
    if isinstance(obj, module.Model):
        return _reduce_model(obj, flavour, module)
    config = obj.get_config()
    values = [host_array(v) for v in _variables(obj)]
    extras = {k: getattr(obj, k) for k in ("_hvd_noise",) if hasattr(obj, k)}
    paths = [getattr(v, "path", None) for v in getattr(obj, "_trainable_variables", [])]  # (Keras 3's)
    return _rebuild_optimizer, (type(obj), config, values, extras, paths)


def _rebuild_optimizer(cls: type, config: dict[str, Any], values: list[Any], extras: dict[str, Any],
                       paths: list[str | None] | None = None) -> Any:
    optimizer = cls.from_config(config)
    for key, value in extras.items():
        setattr(optimizer, key, value)
    # assigned once its model is compiled with it, or, in a custom loop, by finish_optimizers
    _pending_optimizer_values[id(optimizer)] = (optimizer, values, paths or [])
    return optimizer


def finish_optimizers(values: dict[str, Any]) -> dict[str, str]:
    """Give each restored Keras optimizer that no model was compiled with (a custom loop's) its variables, built
    for the variables of the restored models it trained (found by their paths); the names of those whose
    variables could not be matched, with why.

    Args:
        values: the restored values, by name.
    """
    pending = list(_pending_optimizer_values.values())
    _pending_optimizer_values.clear()
    by_path: dict[str, Any] = {}  # (a model rebuilt from its config names its variables without its own name)
    for value in values.values():
        flavour, module = _keras_of(value)
        if flavour is not None and isinstance(value, module.Model):
            for v in value.trainable_variables:
                path = str(getattr(v, "path", ""))
                by_path[path] = by_path[path.removeprefix(f"{value.name}/")] = v
    lost = {}
    for optimizer, saved, paths in pending:
        found = [by_path.get(p) or by_path.get(p.split("/", 1)[-1]) for p in paths if p]
        if not saved:
            continue
        if paths and len(found) == len(paths) and all(f is not None for f in found):
            load_optimizer_values(optimizer, found, saved)
        else:
            for name in (n for n, v in values.items() if v is optimizer):
                lost[name] = "its variables (iterations, slots): no restored model holds the variables it trained"
    return lost


def _reduce_model(model: Any, flavour: str, module: Any) -> Any:
    compiled = bool(getattr(model, "compiled", getattr(model, "_is_compiled", False)))
    compile_config = model.get_compile_config() if compiled else None
    if compile_config is not None:
        compile_config = {k: v for k, v in compile_config.items() if k != "optimizer"}
    customs = {module.saving.get_registered_name(type(layer)): type(layer) for layer in _layers(model)}
    config = module.saving.serialize_keras_object(model)
    config.pop("compile_config", None)  # (compiled below, with the optimizer object itself)
    return _rebuild_model, (flavour, config, customs, [host_array(w) for w in model.weights], compile_config,
                            model.optimizer if compiled else None, [host_array(v) for v in _beside_weights(model)])


def _beside_weights(model: Any) -> list[Any]:
    """A Keras 3 model's variables that are not its weights: its layers' seed generators (Dropout's masks)."""
    weights = {id(w) for w in model.weights}
    return [v for v in getattr(model, "variables", []) if id(v) not in weights]


def _layers(model: Any) -> list[Any]:
    flatten = getattr(model, "_flatten_layers", None)
    return list(flatten(include_self=True)) if flatten else [model]


def _rebuild_model(flavour: str, config: Any, customs: dict[str, type], weights: list[Any],
                   compile_config: dict[str, Any] | None, optimizer: Any, beside: list[Any] | None = None) -> Any:
    import importlib

    module = importlib.import_module(flavour)
    with module.saving.custom_object_scope(customs):
        model = module.saving.deserialize_keras_object(config)
        model.set_weights(weights)
        variables = _beside_weights(model)
        if beside and [tuple(v.shape) for v in variables] == [np.shape(b) for b in beside]:
            for variable, value in zip(variables, beside):
                variable.assign(value)
        if compile_config is not None:
            model.compile(optimizer=optimizer, **module.saving.deserialize_keras_object(compile_config))
    if optimizer is not None:
        _, values, _ = _pending_optimizer_values.pop(id(optimizer), (None, [], None))
        load_optimizer_values(optimizer, model.trainable_variables, values)
    return model


def load_optimizer_values(optimizer: Any, trainable: list[Any], values: list[Any]) -> None:
    """Give a Keras ``optimizer`` the variables' ``values`` (``iterations`` and slots), building its variables
    for the ``trainable`` variables first, as its first step would."""
    if not values:
        return
    if not _variables(optimizer) or len(_variables(optimizer)) < len(values):
        build = getattr(optimizer, "build", None)
        if build is not None and not getattr(optimizer, "built", False):
            build(trainable)
        else:  # Keras 2's legacy optimizers
            optimizer._create_all_weights(trainable)
    variables = _variables(optimizer)
    if len(variables) != len(values):
        raise ValueError(f"the optimizer has {len(variables)} variables where {len(values)} were saved")
    for variable, value in zip(variables, values):
        variable.assign(value)


# ------------------------------------------------------------------ hvd.elastic states
def _elastic_reduce(obj: Any) -> Any:
    if not _has_base(obj, _ELASTIC_STATE):
        return NotImplemented
    state = {k: v for k, v in vars(obj).items() if k not in ("_host_messages", "_saved_values")}
    values = [host_array(v) for _, v in obj._saved_values] if hasattr(obj, "_saved_values") else None
    return _rebuild_elastic, (type(obj), state, values)


def _rebuild_elastic(cls: type, state: dict[str, Any], values: list[Any] | None) -> Any:
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    obj._host_messages = queue.Queue()
    if values is not None:  # (the committed values, paired with this world's variables)
        obj._saved_values = list(zip(obj._variables(), values))
    return obj


_REDUCERS: list[Callable[[Any], Any]] = [_file_reduce, _torch_reduce, _keras_reduce, _elastic_reduce]


# ------------------------------------------------------------------ state kept for a replayed object
def state_of(obj: Any) -> tuple[str, Any] | None:
    """What ``load_into`` needs to give a new object ``obj``'s state, for an object that is not pickled (it is
    made again by replaying its cell): a PyTorch object's ``state_dict`` (with a ``hvd.DistributedOptimizer``'s
    noise-scale estimator), a Keras model's weights and optimizer variables; None where there is nothing."""
    flavour, module = _keras_of(obj)
    if flavour is not None and isinstance(obj, module.Model):
        optimizer = getattr(obj, "optimizer", None)
        return "keras", ([host_array(w) for w in obj.weights],
                         [host_array(v) for v in _variables(optimizer)] if optimizer else [])
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        noise = getattr(getattr(obj, "_noise", None), "estimator", None)
        return "state_dict", (_to_host(obj.state_dict()), noise)
    return None


def _to_host(value: Any) -> Any:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return type(value)((k, _to_host(v)) for k, v in value.items()) if type(value) is not dict \
            else {k: _to_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_host(v) for v in value)
    return value


def load_into(obj: Any, kind: str, payload: Any) -> None:
    """Give ``obj`` (a new object a replay made) the state ``state_of`` kept of the old one.

    Raises:
        Exception: whatever the framework raises where the state does not fit ``obj``.
    """
    if kind == "keras":
        weights, optimizer_values = payload
        obj.set_weights(weights)
        if optimizer_values and getattr(obj, "optimizer", None) is not None:
            load_optimizer_values(obj.optimizer, obj.trainable_variables, optimizer_values)
        return
    state_dict, noise = payload
    obj.load_state_dict(state_dict)
    if noise is not None and getattr(obj, "_noise", None) is not None:
        obj._noise.estimator = noise


def load_from(new: Any, restored: Any) -> bool:
    """Give ``new`` (made by a replay) the state of ``restored`` (the object restored under the same name) where
    both are framework objects of one kind; False where that is not so (nothing was loaded).

    Raises:
        Exception: whatever the framework raises where the state does not fit ``new``.
    """
    if type(new) is not type(restored) and not isinstance(new, type(restored)):
        return False
    state = state_of(restored)
    if state is None:
        return False
    load_into(new, *state)
    return True


# ------------------------------------------------------------------ the process's own state
def process_state() -> dict[str, Any]:
    """The RNGs of the frameworks this rank imported (Python's, numpy's global, TensorFlow's global generator and
    eager op seeds, Keras 3's global seed generator, PyTorch's CPU and CUDA) and the noise scale that
    ``hvd.noise_scale()`` reads."""
    state: dict[str, Any] = {"random": random.getstate()}
    if "numpy" in sys.modules:
        state["numpy"] = np.random.get_state()
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
    tf = sys.modules.get("tensorflow")
    if tf is not None and hasattr(tf, "random"):
        state["tensorflow"] = _tensorflow_rng(tf)
    seeds = sys.modules.get("keras.src.random.seed_generator")
    generator = seeds.global_state.get_global_attribute(seeds.GLOBAL_SEED_GENERATOR) if seeds else None
    if generator is not None:  # (keras.random's calls without a seed)
        state["keras"] = np.asarray(generator.state)
    noise = sys.modules.get("hvd_notebook.runtime.core.noise_scale")
    if noise is not None:
        state["noise_scale"] = (noise._latest, noise._told_batch)
    return state


def _tensorflow_rng(tf: Any) -> dict[str, Any]:
    from tensorflow.python.eager import context

    ctx = context.context()
    rng = getattr(ctx, "_rng", None)
    generator = tf.random.get_global_generator()
    return {"generator": generator.state.numpy(), "seed": getattr(ctx, "_seed", None),
            "ops": rng.getstate() if rng is not None else None}


def set_process_state(state: dict[str, Any]) -> None:
    """Put back what ``process_state`` took (the frameworks it names are imported for it)."""
    random.setstate(state["random"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if "torch" in state:
        import torch

        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
    if "tensorflow" in state:
        _set_tensorflow_rng(state["tensorflow"])
    if "keras" in state:
        from keras.src.random import seed_generator

        seed_generator.global_seed_generator().state.assign(state["keras"])
    if "noise_scale" in state:
        from ..runtime.core import noise_scale

        noise_scale._latest, noise_scale._told_batch = state["noise_scale"]


def _set_tensorflow_rng(saved: dict[str, Any]) -> None:
    import tensorflow as tf
    from tensorflow.python.eager import context

    tf.random.get_global_generator().state.assign(saved["generator"])
    if saved["seed"] is not None:
        ctx = context.context()
        ctx._set_global_seed(saved["seed"])
        if saved["ops"] is not None:
            ctx._rng.setstate(saved["ops"])
