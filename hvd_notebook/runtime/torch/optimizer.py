"""``hvd.DistributedOptimizer`` for PyTorch: gradients averaged over ranks while backward still runs.

Each parameter gets a post-accumulate-grad hook. The parameters are cut into buckets in the
order backward produces their gradients (the reverse of the model's; the first bucket small, so
that communication starts early; ``FIRST_BUCKET_BYTES``, ``BUCKET_BYTES``), as PyTorch DDP's: when
the last gradient of a bucket is final for the step (after ``backward_passes_per_step`` backward
passes), the hook starts one asynchronous in-place allreduce of the bucket and returns at once, so
autograd goes on with the layers below while the gradients travel. A bucket is one request to the
core's coordinator (named after its first parameter, agreed across ranks by that name), whose
tensors share one MPI call; buckets ready in the same agreement round share one too (Horovod's
tensor fusion; the round is the cycle). Horovod's ``groups``/``num_groups`` replace the buckets,
and ``HOROVOD_FUSION_THRESHOLD=0`` reduces each gradient alone. ``step()`` (or ``synchronize()``)
waits for the outstanding reductions, reduces with zeros the parameters this rank computed no
gradient for (another rank may have), then steps the wrapped optimizer.

The returned object is the user's optimizer itself under a subclass that adds this (its state,
param groups and hyperparameters are the original's, not copies), so ``isinstance(opt, SGD)``,
``state_dict()`` and learning-rate schedulers work as before. A parameter belongs to the newest
``DistributedOptimizer`` made for it: making one again (a notebook cell run twice) removes the earlier
one's hook, so no gradient is reduced twice.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from ... import config
from ..core import noise_scale, ops
from ..core.fusion import fusion_threshold
from ..core.noise_scale import NoiseScale
from ..core.process_sets import global_process_set
from . import device
from .compression import Compression
from .mpi_ops import allreduce_async_, grouped_allreduce_async_, sparse_allreduce_async, synchronize, through_dist

# a parameter's attribute holding the hook of the newest DistributedOptimizer that took it
_HOOK_ATTRIBUTE = "_hvd_notebook_hook"
FIRST_BUCKET_BYTES = 1 << 20  # DDP's sizes: a small first bucket starts communication early in backward,
BUCKET_BYTES = 25 << 20       # then buckets large enough that each call's fixed cost is paid rarely


class _GradientReduction:
    """How a ``DistributedOptimizer`` reduces the gradients: a hook per parameter that starts its group's
    reduction once its backward passes are done, and ``synchronize``, which waits for them all."""

    def _setup_distributed(self, named_parameters: Any, compression: Any, backward_passes_per_step: int, op: int,
                           gradient_predivide_factor: float, groups: Any, sparse_as_dense: bool,
                           process_set: Any) -> None:
        self._compression, self._op, self._sparse_as_dense = compression, op, sparse_as_dense
        self._predivide, self._process_set = gradient_predivide_factor, process_set
        self._parameter_names = _parameter_names(self, named_parameters)  # (Horovod's attribute name)
        self.backward_passes_per_step = backward_passes_per_step
        self._passes_left = {p: backward_passes_per_step for p in self._parameter_names}
        self._handles: dict[tuple, list[tuple[tuple, Any, Any]]] = {}  # a group: its parts in flight
        self._groups = _parameter_groups(self, groups)
        self._group_ready: dict[tuple, int] = {g: 0 for g in set(self._groups.values())}
        self._synchronized, self._should_synchronize = False, True
        self._hooks: list[Any] = []
        self._flats: dict[tuple, _FlatBucket | None] = {}  # a group's flat buffer, where it may have one
        self._filling: dict[tuple, _FlatBucket | None] = {}  # this step's choice for each group begun
        backends = _backends(process_set)
        self._ranks = 1 if backends is None else backends.size
        self._noise = _StepNoise(op, self._ranks, process_set)
        self._reducing = backends is not None and (backends.size > 1 or config.REDUCE_ALONE.flag())
        if self._reducing:
            for p in self._parameter_names:
                if p.requires_grad:
                    earlier = getattr(p, _HOOK_ATTRIBUTE, None)
                    if earlier is not None:  # a DistributedOptimizer made before (a cell run again): this one
                        earlier.remove()     # owns the parameter now, or each gradient would be reduced twice
                    hook = p.register_post_accumulate_grad_hook(self._make_hook(p))
                    setattr(p, _HOOK_ATTRIBUTE, hook)
                    self._hooks.append(hook)

    # ------------------------------------------------------------ the hooks
    def _make_hook(self, p: torch.Tensor) -> Any:
        def hook(param: torch.Tensor) -> None:
            if self._passes_left[p] <= 0:
                raise AssertionError("Gradients were computed more than backward_passes_per_step times before "
                                     "optimizer.step(); raise backward_passes_per_step to accumulate them locally.")
            self._passes_left[p] -= 1
            if self._passes_left[p] > 0:
                return
            group = self._groups[p]
            ready = self._group_ready[group]
            flat = self._filling[group] if ready else self._begin(group)
            if flat is not None and not flat.place(p):
                self._filling[group] = self._flats[group] = flat.abandon()  # (a sparse gradient: the general way)
            self._group_ready[group] = ready = ready + 1
            if ready == len(group):
                self._handles[group] = self._reduce_async(group)
                self._group_ready[group] = 0

        return hook

    def _begin(self, group: tuple) -> _FlatBucket | None:
        """This step's way for ``group``, chosen as its first gradient is final: its flat buffer where the bucket
        goes through ``torch.distributed`` with a plain average or sum (DDP's ``gradient_as_bucket_view`` way: each
        gradient copied in, divided, by its hook; the buffer reduced in place), else None (one grouped call)."""
        flat = None
        if self._plain() and through_dist(group[0], self._process_set):
            flat = self._flats.get(group, False)
            if flat is False:
                scale = 1.0 / self._ranks if self._op == ops.Average else 1.0
                flat = self._flats[group] = _FlatBucket.of(group, scale)
        self._filling[group] = flat and flat.begin()
        return self._filling[group]

    def _plain(self) -> bool:
        """Are this optimizer's reductions a plain average or sum (no compression, predivision or sparse as
        dense)?"""
        return (self._op in (ops.Average, ops.Sum) and self._predivide == 1.0 and not self._sparse_as_dense
                and self._compression is Compression.none)

    def _reduce_flat(self, group: tuple, flat: _FlatBucket) -> list[tuple[tuple, Any, Any]] | None:
        """Start reducing ``group``'s flat buffer (its gradients not placed by a hook placed now: zeros where a
        parameter has none on this rank); None where a sparse gradient sends it the general way."""
        for p in group:
            if not flat.placed(p) and not flat.place(p, zeros=p.grad is None):
                self._flats[group] = flat.abandon()
                return None
        self._noise.add_local_flat(flat.buffer, flat.scale)
        handle = allreduce_async_(flat.buffer, name=self._parameter_names[group[0]], op=ops.Sum,
                                  process_set=self._process_set)
        return [(group, handle, flat)]

    def _scales(self) -> tuple[float, float]:
        """Horovod's split of an average around the sum: 1/f before it, f (and 1/size) after."""
        if self._op == ops.Average and self._predivide != 1.0:
            return 1.0 / self._predivide, self._predivide
        return 1.0, 1.0

    def _reduce_async(self, group: tuple) -> list[tuple[tuple, Any, Any]]:
        """Start reducing ``group``'s gradients: one grouped call for the dense ones, one sparse call each for
        the sparse ones (unless ``sparse_as_dense``); the parts as (parameters, handle, context). A parameter
        frozen since (``requires_grad`` off, no gradient) takes no part, on every rank alike. A group filled
        into its flat buffer (``_begin``) is one in-place call of that buffer."""
        flat = self._filling[group] if group in self._filling else self._begin(group)
        del self._filling[group]
        if flat is not None and all(p.requires_grad for p in group):
            parts = self._reduce_flat(group, flat)
            if parts is not None:
                return parts
        group = tuple(p for p in group if p.requires_grad or p.grad is not None)
        for p in group:
            if p.grad is None:  # no gradient on this rank; another rank may have one: take part with zeros
                p.grad = torch.zeros_like(p)
        self._noise.add_local([p.grad for p in group])
        alone = [p.grad.is_sparse and not self._sparse_as_dense for p in group]
        parts = [((p,), sparse_allreduce_async(p.grad, self._parameter_names[p], self._op, self._process_set),
                  "sparse") for p, sparse in zip(group, alone) if sparse]
        dense = tuple(p for p, sparse in zip(group, alone) if not sparse)
        if dense:
            grads = [p.grad.to_dense() if p.grad.is_sparse else p.grad for p in dense]
            compressed, ctxs = zip(*(self._compression.compress(g) for g in grads))
            prescale, postscale = self._scales()
            handle = grouped_allreduce_async_(list(compressed), name=self._parameter_names[dense[0]], op=self._op,
                                              prescale_factor=prescale, postscale_factor=postscale,
                                              process_set=self._process_set)
            parts.append((dense, handle, list(zip(ctxs, compressed))))
        return parts

    # ------------------------------------------------------------ the step
    def synchronize(self) -> None:
        """Wait until every gradient is reduced over the ranks.

        ``step()`` calls it. Call it yourself to read or clip the reduced gradients before the step, then step
        inside ``skip_synchronize()``. A parameter that took no gradient on this rank takes part with zeros, since
        another rank may have one.

        Raises:
            CollectiveMismatchError: the ranks' reductions do not match, such as models of different shapes.
            StallError: a reduction cannot complete: a rank it waits for has shut down, or the wait passed
                ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
            HorovodInternalError: another rank left a reduction to reset the world for ``hvd.elastic.run``.
        """
        if not self._reducing:
            self._synchronized = True
            return
        for p in self._parameter_names:  # (every rank walks the parameters in the same order)
            group = self._groups[p]
            if p.requires_grad and group not in self._handles:
                self._handles[group] = self._reduce_async(group)
        noise = self._noise.reduce_local_async(next(iter(self._parameter_names.values())))
        flats: list[_FlatBucket] = []
        for parts in self._handles.values():
            for params, handle, ctx in parts:
                if isinstance(ctx, _FlatBucket):
                    synchronize(handle)  # (the gradients are views of its buffer: nothing to copy back)
                    flats.append(ctx)
                    continue
                if ctx == "sparse":
                    output = handle()  # (sparse_allreduce_async's handle is a function, as Horovod's)
                    with torch.no_grad():
                        params[0].grad.zero_().add_(output)
                    continue
                synchronize(handle)
                for p, (c, compressed) in zip(params, ctx):
                    _set_grad(p, self._compression.decompress(compressed, c))
        if noise is not None:
            in_flats = {id(p) for flat in flats for p in flat.params}
            grads = [p.grad for p in self._parameter_names if p.requires_grad and p.grad is not None
                     and id(p) not in in_flats]
            self._noise.record(noise, [flat.buffer for flat in flats] + grads, self.backward_passes_per_step)
        self.set_backward_passes_per_step(self.backward_passes_per_step)
        for g in self._group_ready:
            self._group_ready[g] = 0
        self._handles.clear()
        self._filling.clear()
        self._synchronized = True

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change the number of backward passes that accumulate before each reduction.

        Args:
            passes: the new number of backward passes per step.
        """
        self.backward_passes_per_step = passes
        for p in self._passes_left:
            self._passes_left[p] = passes


class _DistributedOptimizer(_GradientReduction):
    """The methods that ``DistributedOptimizer`` adds in front of the wrapped optimizer's class: its reductions
    (``_GradientReduction``), and the step, the gradients' zeroing and the noise scale around them."""

    # ------------------------------------------------------------ the noise scale
    def noise_scale(self, batch_size: int) -> float | None:
        """Return the gradient noise scale this optimizer measured, as ``hvd.noise_scale`` does.

        Args:
            batch_size: the samples per rank and backward pass.

        Returns:
            The noise scale in samples, as a float, or None while there is no estimate.
        """
        self._noise.flush()
        return self._noise.estimator.value(batch_size)

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Make ``step()`` inside this ``with`` block skip its ``synchronize()``, after an explicit one.

        >>> optimizer.synchronize()
        >>> torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        >>> with optimizer.skip_synchronize():
        ...     optimizer.step()
        """
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        """Wait for the gradients' reductions, then step the wrapped optimizer.

        Args:
            closure: passed to the wrapped optimizer's ``step``. Defaults to None.

        Returns:
            What the wrapped optimizer's ``step`` returns.

        Raises:
            CollectiveMismatchError: the ranks' reductions do not match, such as models of different shapes.
            StallError: a reduction cannot complete: a rank it waits for has shut down, or the wait passed
                ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
            HorovodInternalError: another rank left a reduction to reset the world for ``hvd.elastic.run``.
        """
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(): the gradients are reduced twice (use "
                              "`with optimizer.skip_synchronize(): optimizer.step()`).", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients, as the wrapped optimizer does.

        Args:
            set_to_none: set the gradients to None instead of zeros. Defaults to True.

        Raises:
            AssertionError: reductions are still in flight: ``zero_grad`` was called after ``backward()`` but before
                ``step()`` or ``synchronize()``.
        """
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(): the gradients are still being "
                                 "reduced.")
        return super().zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict: dict) -> None:
        self._handles.clear()
        self._synchronized, self._should_synchronize = False, True
        self.set_backward_passes_per_step(self.backward_passes_per_step)
        return super().load_state_dict(state_dict)


class _StepNoise:
    """A ``DistributedOptimizer``'s measure of the gradient noise scale: this rank's squared gradient norms, taken
    before the in-place reductions overwrite them and averaged over the ranks beside the reductions, then the
    reduced gradients' norm: one record a step in ``estimator``.

    Args:
        op: the optimizer's reduction (no measure under Adasum).
        ranks: the ranks the gradients are reduced over.
        process_set: the ``hvd.ProcessSet`` they are reduced in.
    """

    def __init__(self, op: int, ranks: int, process_set: Any) -> None:
        self.estimator = NoiseScale()
        self.on = op != ops.Adasum and noise_scale.enabled(ranks)
        self.op, self.ranks, self.process_set = op, ranks, process_set
        self.local_sq: list[torch.Tensor] = []
        self.pending: list[tuple[Any, int]] = []  # steps whose norms are on their way to the host

    def add_local(self, grads: list[torch.Tensor]) -> None:
        """Keep the gradients' squared norm for this step's local sum (on their device)."""
        if self.on:
            self.local_sq.append(_squared_norm(grads))

    def add_local_flat(self, flat: torch.Tensor, scale: float) -> None:
        """Keep the squared norm of gradients held in ``flat`` multiplied by ``scale`` (one dot product)."""
        if self.on:
            with torch.no_grad():
                self.local_sq.append(torch.dot(flat, flat).float() / (scale * scale))

    def reduce_local_async(self, name: str) -> tuple[int, torch.Tensor] | None:
        """Start averaging the local squared norms over the ranks (a call named after ``name``), beside the
        gradients' reductions: (its handle, this rank's sum), or None where nothing was kept."""
        if not self.local_sq:
            return None
        local = torch.stack(self.local_sq).sum().reshape(1)
        self.local_sq = []
        return allreduce_async_(local, name="noise_scale." + name, op=ops.Average, process_set=self.process_set), local

    def record(self, started: tuple[int, torch.Tensor], grads: list[torch.Tensor], passes: int) -> None:
        """Record the step, once its gradients (``grads``, summed over ``passes`` backward passes) are reduced."""
        handle, local = started
        synchronize(handle)
        # (on a GPU the two norms come to the host without a wait: recorded once they are there, a step or so later)
        self.pending.append((device.to_host([local.reshape(()), _squared_norm(grads)]), passes))
        self.flush()

    def flush(self) -> None:
        """Record the steps whose norms have reached the host, in their order."""
        while self.pending:
            values = device.read(self.pending[0][0])
            if values is None:
                return
            passes = self.pending.pop(0)[1]
            # the gradients are sums over the accumulated passes (and over the ranks for op=Sum): a rank's
            # gradient over all of its samples is 1/passes of it, the average 1/size more for op=Sum
            per = float(passes) ** 2
            ranks_sq = float(self.ranks) ** 2 if self.op == ops.Sum else 1.0
            noise_scale.record(self.estimator, values[0] / per, values[1] / per / ranks_sq, self.ranks,
                               passes=passes)


def _set_grad(p: torch.Tensor, reduced: torch.Tensor) -> None:
    """The reduced gradient into ``p.grad`` (an in-place reduction already wrote it there); a sparse
    gradient reduced as dense (``sparse_as_dense``) goes back sparse."""
    if reduced is p.grad:
        return
    with torch.no_grad():
        if p.grad.is_sparse:
            p.grad.zero_().add_(reduced.to_sparse() if not reduced.is_sparse else reduced)
        else:
            p.grad.copy_(reduced)


class _FlatBucket:
    """A group's gradients as views of one flat buffer (``buffer``; DDP's ``gradient_as_bucket_view``): each
    copied in by its hook as it is final, multiplied by ``scale`` (1/ranks for an average, as DDP divides while it
    copies), and ``.grad`` made its view; the buffer is then reduced in place with a sum. No pack, division or
    unpack pass over the bucket."""

    __slots__ = ("params", "buffer", "views", "scale", "index", "filled")

    def __init__(self, group: tuple, scale: float) -> None:
        first = group[0]
        self.params = group
        self.buffer = torch.zeros(sum(p.numel() for p in group), dtype=first.dtype, device=first.device)
        self.views = [v.view_as(p) for v, p in zip(self.buffer.split([p.numel() for p in group]), group)]
        self.index = {id(p): i for i, p in enumerate(group)}
        self.scale, self.filled = scale, [False] * len(group)

    @classmethod
    def of(cls, group: tuple, scale: float) -> _FlatBucket | None:
        """A flat bucket for ``group`` where its parameters share a float dtype and device (None elsewhere)."""
        first = group[0]
        if first.dtype not in (torch.float32, torch.float64) or any(
                p.dtype != first.dtype or p.device != first.device for p in group):
            return None
        return cls(group, scale)

    def begin(self) -> _FlatBucket:
        """Start a step: no gradient placed yet."""
        self.filled = [False] * len(self.filled)
        return self

    def placed(self, p: torch.Tensor) -> bool:
        return self.filled[self.index[id(p)]]

    def place(self, p: torch.Tensor, zeros: bool = False) -> bool:
        """Make ``p``'s gradient its view, scaled (zeros where ``zeros``: none on this rank); False for a sparse
        one."""
        i = self.index[id(p)]
        view, grad = self.views[i], p.grad
        with torch.no_grad():
            if zeros:
                view.zero_()
            elif grad.layout != torch.strided:
                return False
            elif grad is view:  # (zero_grad(set_to_none=False): backward accumulated into the view)
                if self.scale != 1.0:
                    view.mul_(self.scale)
            elif self.scale == 1.0:
                view.copy_(grad)
            else:
                torch.mul(grad, self.scale, out=view)
            p.grad = view
        self.filled[i] = True
        return True

    def abandon(self) -> None:
        """Undo this step's scaling of the gradients placed so far (they stay views: the general way reduces
        them in place)."""
        with torch.no_grad():
            for view, filled in zip(self.views, self.filled):
                if filled and self.scale != 1.0:
                    view.div_(self.scale)
        self.begin()


def _squared_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The squared L2 norm of all of ``grads`` together (float32, on their device); a sparse gradient's
    repeated rows are summed first."""
    if not grads:
        return torch.zeros(())
    with torch.no_grad():
        values = [g.coalesce().values() if g.is_sparse else g for g in grads]
        norms = torch._foreach_norm(values, 2, dtype=torch.float32)  # (one batched op, not one per gradient)
        where = norms[0].device
        return torch.stack([n.to(where) for n in norms]).square().sum()


def _backends(process_set: Any) -> Any:
    """The world or the set's backends; None on a rank outside the set (its gradients stay local)."""
    from ..core import process_sets as _process_sets

    try:
        return _process_sets.backends(process_set, "hvd.DistributedOptimizer")
    except _process_sets.NotAMemberError:
        return None


def _parameter_names(opt: Any, named_parameters: Any) -> dict[torch.Tensor, str]:
    params = [p for group in opt.param_groups for p in group["params"]]
    if named_parameters is None:
        return {p: f"allreduce.noname.{i}.{j}" for i, group in enumerate(opt.param_groups)
                for j, p in enumerate(group["params"])}
    named = list(named_parameters)
    if any(not (isinstance(x, tuple) and len(x) == 2) for x in named):
        raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, usually "
                         "model.named_parameters().")
    seen: set[str] = set()
    duplicates = sorted({n for n, _ in named if n in seen or seen.add(n)})  # type: ignore[func-returns-value]
    if duplicates:
        raise ValueError(f"Parameter names in named_parameters must be unique; duplicates: {', '.join(duplicates)}")
    by_param = {p: str(n) for n, p in named}
    unnamed = [p for p in params if p not in by_param]
    if unnamed:
        raise ValueError(f"named_parameters was given, but {len(unnamed)} of the optimizer's parameters are not in "
                         "it; pass model.named_parameters() of the model whose parameters the optimizer updates.")
    return {p: by_param[p] for p in params}


def _parameter_groups(opt: Any, groups: Any) -> dict[torch.Tensor, tuple]:
    """Each parameter's group, whose gradients are reduced in one call once all are ready: Horovod's
    ``groups`` (a number of groups, or lists of parameters; a parameter in none is a group of its own),
    else buckets in backward's order (``gradient_buckets``)."""
    params = [p for group in opt.param_groups for p in group["params"] if p.requires_grad]
    if groups is None or groups == 0:
        chunks = gradient_buckets(params)
    elif isinstance(groups, int) and not isinstance(groups, bool) and groups > 0:
        per = -(-len(params) // groups)
        chunks = [tuple(params[i:i + per]) for i in range(0, len(params), per)]
    elif isinstance(groups, list):
        chunks, seen = [], set()
        for g in groups:
            chosen = tuple(p for p in g if any(p is q for q in params))
            for p in g:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must be lists of torch.Tensor (parameters).")
                if id(p) in seen:
                    raise ValueError("a parameter can appear in one group only.")
                seen.add(id(p))
            if chosen:
                chunks.append(chosen)
    else:
        raise ValueError("groups takes a positive number of groups or a list of lists of parameters.")
    grouped = {p: bucket for bucket in map(_Bucket, chunks) for p in bucket}
    return {p: grouped.get(p) or _Bucket((p,)) for group in opt.param_groups for p in group["params"]}


class _Bucket(tuple):
    """A group of parameters, hashed and compared by identity: a hook looks its bucket up once per gradient, and
    a tuple's hash would hash each of its tensors every time."""

    __slots__ = ()
    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        return self is other

    def __ne__(self, other: object) -> bool:
        return self is not other


def gradient_buckets(params: list[torch.Tensor]) -> list[tuple]:
    """``params`` in buckets of consecutive parameters, last first (the order backward makes their
    gradients in), of ``FIRST_BUCKET_BYTES`` for the first and ``BUCKET_BYTES`` after it, or the fusion
    threshold where it is lower (each parameter alone at ``HOROVOD_FUSION_THRESHOLD=0``); a bucket holds
    one dtype and one device, as one call does."""
    threshold = fusion_threshold()
    if threshold <= 0:
        return []
    chunks: list[tuple] = []
    bucket: list[torch.Tensor] = []
    size, limit = 0, min(FIRST_BUCKET_BYTES, threshold)
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if bucket and (size + nbytes > limit or (p.dtype, p.device) != (bucket[0].dtype, bucket[0].device)):
            chunks.append(tuple(bucket))
            bucket, size, limit = [], 0, min(BUCKET_BYTES, threshold)
        bucket.append(p)
        size += nbytes
    if bucket:
        chunks.append(tuple(bucket))
    return chunks


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Any = None,
                         compression: Any = Compression.none, backward_passes_per_step: int = 1,
                         op: int = ops.Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: Any = None, sparse_as_dense: bool = False,
                         process_set: Any = global_process_set) -> torch.optim.Optimizer:
    """Wrap a PyTorch optimizer so that its gradients are averaged over all ranks before each step.

    Each parameter gets a hook. The parameters are cut into buckets in the order backward produces their gradients,
    as PyTorch's DDP does. When a bucket's last gradient is final for the step, its hook starts one asynchronous
    allreduce of the bucket, so the gradients travel while backward goes on. ``step()`` waits for the reductions,
    then steps the wrapped optimizer.

    >>> opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size()),
    ...                                named_parameters=model.named_parameters())

    Args:
        optimizer: the ``torch.optim.Optimizer`` to wrap.
        named_parameters: ``model.named_parameters()``, so that the ranks match gradients by name. The default,
            None, names each parameter by its position in the param groups.
        compression: ``hvd.Compression.none`` (the default), or ``hvd.Compression.fp16`` to send the gradients as
            float16.
        backward_passes_per_step: the backward passes whose gradients accumulate on each rank before one reduction.
            Defaults to 1.
        op: the reduction: ``hvd.Average`` (the default) or ``hvd.Sum``.
        gradient_predivide_factor: with ``hvd.Average``, divide the gradients by this factor before the sum, and
            multiply the sum by ``factor / size`` after it. Defaults to 1.0.
        num_groups: Horovod's number of groups: the parameters are cut into at most this many groups, each reduced
            in one call, instead of buckets. ``groups`` wins where both are given. Defaults to 0.
        groups: a number of groups, or a list of lists of parameters, each list reduced in one call; a parameter in
            no list is reduced alone. The default, None, uses the buckets.
        sparse_as_dense: reduce sparse gradients as dense tensors. By default, False, their indices and values are
            allgathered.
        process_set: reduce over the ranks of this ``hvd.ProcessSet``. A rank outside it keeps its own gradients.
            Defaults to ``hvd.global_process_set``: every rank.

    Returns:
        The optimizer itself, under a subclass of its class: its state, param groups and hooks are the original's,
        not copies, and ``isinstance`` still holds. It adds ``synchronize()``, ``skip_synchronize()``,
        ``set_backward_passes_per_step()`` and ``noise_scale()``.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
        ValueError: ``op`` is not an op; ``gradient_predivide_factor`` is not 1.0 with an ``op`` other than
            ``hvd.Average``; ``backward_passes_per_step`` is under 1; ``named_parameters`` repeats a name, leaves
            out one of the optimizer's parameters, or is not a sequence of pairs; ``groups`` is malformed; the
            runtime is not initialised; or ``process_set`` is not a registered ``hvd.ProcessSet``.
        NotImplementedError: ``op=hvd.Adasum``, which the built-in runtime does not implement.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"hvd.DistributedOptimizer wraps a torch.optim.Optimizer, not {type(optimizer).__name__}.")
    ops.check_op(op)
    if gradient_predivide_factor != 1.0 and op != ops.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be at least 1, not {backward_passes_per_step}.")
    if num_groups and groups is None:
        groups = num_groups
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedOptimizer, base), {"__module__": base.__module__})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)  # the same param groups, state and hooks: nothing copied
    wrapped._setup_distributed(named_parameters, compression, backward_passes_per_step, op,
                               gradient_predivide_factor, groups, sparse_as_dense, process_set)
    return wrapped


__all__ = ["DistributedOptimizer"]
