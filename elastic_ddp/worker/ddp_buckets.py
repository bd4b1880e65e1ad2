"""A stable DDP bucket layout: same-world-size resume stays bitwise identical at 3 ranks and more.

DDP all-reduces gradients in buckets, and a ring all-reduce sums each element over the ranks in an
order set by the element's offset in its bucket and by the bucket's size. At 2 ranks that order does
not matter (``a + b == b + a`` exactly); at 3 or more it does (``(a + b) + c`` and ``a + (b + c)``
can differ in the last bit).

DDP (``find_unused_parameters=False``, or ``static_graph=True``) reduces the first iteration of
every ``DistributedDataParallel`` instance (the first two with ``static_graph``) in its initial
layout, by default one bucket holding every parameter, then rebuilds its buckets in gradient-ready
order, capped at 1 MiB for the first and 25 MiB for the others. A run that goes through step 21
reduces it in the rebuilt layout; a run resumed at step 20 builds a new DDP that reduces step 21 in
the initial layout, and its parameters differ slightly from then on.

:func:`stabilize_buckets` registers a communication hook that reduces those first iterations in the
layout the rebuild will produce, so that every iteration of every attempt reduces in one layout.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["NOT_BITWISE", "StableBuckets", "stabilize_buckets"]

log = logging.getLogger(__name__)

# Starts the one warning logged when the guarantee does not hold (tests look for it).
NOT_BITWISE = "Same-world-size resume may not be bitwise identical"

# DDP's own switch: its C++ rebuild then assigns buckets in reverse ready order (a small *last* bucket).
ENV_LAST_BUCKET_CAP = "DDP_SET_LAST_BUCKET_CAP"


@dataclass(frozen=True)
class _Rebuild:
    """How DDP's C++ Reducer will rebuild its buckets: what it passes to the assignment function."""

    assign: Callable[..., tuple[list[list[int]], list[int]]]  # dist._compute_bucket_assignment_by_size
    limits: tuple[int, ...]
    reverse: bool  # DDP_SET_LAST_BUCKET_CAP=1: assign in reverse ready order, then reverse the buckets
    initial_iterations: int  # how many iterations DDP reduces in its initial layout (2 with static_graph)


def _torch_private(ddp: DistributedDataParallel, parameter_count: int) -> _Rebuild | str | None:
    """Everything this module reads from torch's private DDP internals, in one place.

    Returns how DDP will rebuild its buckets; None when it never rebuilds (its initial layout is the
    layout of every iteration already); or a string saying why the rebuild cannot be predicted.
    Checked against torch 2.13 and 2.14, whose ``torch/nn/parallel/distributed.py`` agree on all of it.
    """
    if getattr(ddp, "_use_python_reducer", False):
        return "DDP runs its Python reducer, whose buckets this module does not model"
    if getattr(ddp, "mixed_precision", None) is not None:
        return "DDP runs with mixed_precision, whose reduction this module does not model"
    if ddp.find_unused_parameters and not ddp.static_graph:
        return None  # the C++ Reducer only rebuilds with static_graph or find_unused_parameters=False
    assign = getattr(dist, "_compute_bucket_assignment_by_size", None)
    if assign is None:
        return f"torch {torch.__version__} has no torch.distributed._compute_bucket_assignment_by_size"
    config = getattr(ddp, "_bucket_config", None)
    if config is not None:
        # torch 2.13, 2.14: DDP passes compute_bucket_size_limits()[1] (custom per-bucket caps, from
        # bucket_cap_mb_list) to the Reducer, which rebuilds with [first_bucket_bytes_cap,
        # bucket_bytes_cap] when it is empty.
        try:
            _, for_rebuilding = config.compute_bucket_size_limits(
                static_graph=ddp.static_graph, find_unused_parameters=ddp.find_unused_parameters
            )
            limits = tuple(for_rebuilding) or (config.first_bucket_bytes_cap, config.bucket_bytes_cap)
        except (AttributeError, TypeError) as exc:
            return f"torch {torch.__version__} changed DDP's bucket configuration ({exc})"
    else:
        # The layout of torch <= 2.12: bucket_bytes_cap, and a 1 MiB first bucket for the default cap.
        cap = getattr(ddp, "bucket_bytes_cap", None)
        if cap is None:
            return f"torch {torch.__version__} has neither DDP._bucket_config nor DDP.bucket_bytes_cap"
        first = dist._DEFAULT_FIRST_BUCKET_BYTES if getattr(ddp, "bucket_bytes_cap_default", False) else cap
        limits = (first, cap)
    logging_data = getattr(ddp, "_get_ddp_logging_data", None)
    counted = logging_data().get("num_parameter_tensors") if logging_data is not None else None
    if counted is not None and counted != parameter_count:
        return f"DDP reduces {counted} parameters where this module counted {parameter_count}"
    return _Rebuild(
        assign=assign, limits=limits, reverse=os.environ.get(ENV_LAST_BUCKET_CAP) == "1",
        initial_iterations=2 if ddp.static_graph else 1,
    )  # fmt: skip


def _reducer_parameters(ddp: DistributedDataParallel) -> tuple[list[nn.Parameter], bool]:
    """The parameters DDP reduces, in its Reducer's order (as ``DDP._build_params_for_reducer``
    builds them, which has side effects of its own), and whether any expects a sparse gradient."""
    ignored = getattr(ddp, "parameters_to_ignore", ())
    params: list[nn.Parameter] = []
    seen: set[int] = set()
    sparse = False
    for module_name, module in ddp.module.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if param.requires_grad and f"{module_name}.{name}" not in ignored and id(param) not in seen:
                seen.add(id(param))
                params.append(param)
                sparse |= isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse
    return params, sparse


def _first_value(fut: torch.futures.Future) -> torch.Tensor:
    return fut.value()[0]


def _pending_future(device: torch.device) -> torch.futures.Future:
    # A future with devices records an event when completed, and whoever waits on it waits for the
    # event on its own stream: no host synchronisation, whichever stream DDP finalises on.
    return torch.futures.Future() if device.type == "cpu" else torch.futures.Future(devices=[device])


class StableBuckets:
    """The communication hook :func:`stabilize_buckets` registers; see there.

    :attr:`status` says where it stands: ``"predicting"`` until DDP has rebuilt its buckets and the
    prediction was checked; ``"verified"`` after the check passed;
    ``"mismatch"`` if DDP rebuilt otherwise than predicted or the prediction could not be made (one
    warning logged); ``"averaging"`` where DDP never rebuilds (``find_unused_parameters=True`` without
    ``static_graph``): its initial layout is the layout of every iteration already;
    ``"unsupported"`` where the rebuild cannot be modelled (one warning logged). In every state the
    hook averages the gradients over the process group.
    """

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self._group = ddp.process_group
        self._world_size = dist.get_world_size(self._group)
        self._params, sparse = _reducer_parameters(ddp)
        plan = _torch_private(ddp, len(self._params))
        if plan is not None and not isinstance(plan, str) and sparse:
            plan = "a parameter expects sparse gradients (nn.Embedding(sparse=True))"
        self._rebuild = plan if isinstance(plan, _Rebuild) else None
        self._settled = self._rebuild is None  # True: average every bucket, nothing else
        self._iteration = 0  # synchronising backward passes seen (a bucket of index 0 starts one)
        self._order: list[int] = []  # indices into _params, in gradient-ready order
        self._overflow = False
        self._pending: list[tuple[list[torch.Tensor], torch.Tensor, torch.futures.Future]] = []
        self._covered = 0
        self.layout: list[list[int]] | None = None  # predicted buckets, as indices into _params
        self._handles: list = []
        if isinstance(plan, str):
            self.status = "unsupported"
            log.warning("%s: %s; gradients are averaged as usual.", NOT_BITWISE, plan)
        elif plan is None:
            self.status = "averaging"
        else:
            self.status = "predicting"
            ddp_ref = weakref.ref(ddp)
            for index, param in enumerate(self._params):
                self._handles.append(param.register_post_accumulate_grad_hook(self._ready_hook(index, ddp_ref)))
            # The hooks hold this object, not the DDP: when the DDP is gone, so are they.
            weakref.finalize(ddp, StableBuckets._remove_hooks, self)

    @property
    def hooks_left(self) -> int:
        """Post-accumulate-grad hooks still registered (0 once the prediction was checked)."""
        return len(self._handles)

    # ----------------------------------------------------------------------------------- hooks

    def _ready_hook(self, index: int, ddp_ref: weakref.ref) -> Callable[[torch.Tensor], None]:
        def ready(param: torch.Tensor) -> None:
            ddp = ddp_ref()
            # DDP's Reducer records the ready order only in backward passes that synchronise.
            if ddp is not None and ddp.require_backward_grad_sync:
                if len(self._order) < len(self._params):
                    self._order.append(index)
                else:
                    self._overflow = True  # more than one backward pass since the last reduction

        return ready

    # No annotations: DDP checks them against the real types, and this module's are strings.
    def hook(self, state, bucket):
        """DDP's communication hook: average ``bucket`` over the process group, in the stable layout."""
        if self._settled:
            return self._average(bucket.buffer())
        index = bucket.index()
        if index == 0:
            self._iteration += 1
        if self._iteration <= self._rebuild.initial_iterations:
            return self._initial_bucket(bucket, index)
        return self._check_bucket(bucket, index)

    def _average(self, buffer: torch.Tensor) -> torch.futures.Future:
        buffer.div_(self._world_size)
        return dist.all_reduce(buffer, group=self._group, async_op=True).get_future().then(_first_value)

    # ------------------------------------------------------------------- iterations before the rebuild

    def _initial_bucket(self, bucket: dist.GradBucket, index: int) -> torch.futures.Future:
        """Hold DDP's initial buckets (one, unless several dtypes or bucket_cap_mb_list) until the
        last one of the iteration, then reduce all of them in the predicted layout."""
        if index == 0:
            self._pending, self._covered = [], 0
        params, buffer = bucket.parameters(), bucket.buffer()
        buffer.div_(self._world_size)
        future = _pending_future(buffer.device)
        self._pending.append((params, buffer, future))
        self._covered += len(params)
        if self._covered < len(self._params):
            return future  # DDP waits on its futures only after its last bucket was handed over
        pending, self._pending = self._pending, []
        try:
            self._reduce_predicted(pending)
        except BaseException as exc:
            for _, _, fut in pending:
                if not fut.done():
                    fut.set_exception(exc)
            raise
        return future

    def _reduce_predicted(self, pending: list[tuple[list[torch.Tensor], torch.Tensor, torch.futures.Future]]) -> None:
        where: dict[int, torch.Tensor] = {}  # id(param) -> its gradient's segment of its bucket's buffer
        for params, buffer, _ in pending:
            offset = 0
            for param in params:
                where[id(param)] = buffer[offset : offset + param.numel()]
                offset += param.numel()
        order = self._agreed_order(pending[0][1].device)
        if order is None:
            self._settle("rank 0 did not see each parameter's gradient exactly once in the synchronising backward pass")
            for _, buffer, _ in pending:
                dist.all_reduce(buffer, group=self._group, async_op=True).wait()
        else:
            self.layout = self._predict(order)
            for indices in self.layout:  # one bucket at a time: the extra memory is one bucket
                segments = [where[id(self._params[i])] for i in indices]
                flat = torch.cat(segments)
                # .wait(): on the CPU it blocks; with NCCL it only makes this stream wait.
                dist.all_reduce(flat, group=self._group, async_op=True).wait()
                for segment, reduced in zip(segments, flat.split([s.numel() for s in segments])):
                    segment.copy_(reduced)
                del flat
        for _, buffer, fut in pending:
            fut.set_result(buffer)

    def _agreed_order(self, device: torch.device) -> list[int] | None:
        """Rank 0's gradient-ready order (DDP rebuilds from rank 0's), or None if it has none."""
        local, overflow = self._order, self._overflow
        self._order, self._overflow = [], False
        count = len(self._params)
        valid = not overflow and len(local) == count and len(set(local)) == count
        order = torch.tensor(local if valid else [-1] * count, dtype=torch.int64, device=device)
        dist.broadcast(order, group=self._group, group_src=0)
        agreed = order.tolist()  # the one host synchronisation, once or twice per DDP instance
        return agreed if agreed[0] >= 0 else None

    def _predict(self, order: list[int]) -> list[list[int]]:
        """The buckets DDP's C++ ``Reducer::rebuild_buckets`` builds from this ready order."""
        rebuild = self._rebuild
        tensors, labels = [self._params[i] for i in order], list(order)
        if rebuild.reverse:
            tensors.reverse()
            labels.reverse()
        # With tensor indices (labels) given, the assignment keeps the order it forms buckets in.
        buckets, _ = rebuild.assign(tensors, list(rebuild.limits), [], labels)
        if rebuild.reverse:
            buckets.reverse()
        return [list(b) for b in buckets]

    # --------------------------------------------------------------------- the check after the rebuild

    def _check_bucket(self, bucket: dist.GradBucket, index: int) -> torch.futures.Future:
        layout = self.layout or []
        params = bucket.parameters()
        expected = layout[index] if index < len(layout) else []
        if len(params) != len(expected) or any(p is not self._params[i] for p, i in zip(params, expected)):
            got = sum(p.numel() for p in params)
            want = [sum(self._params[i].numel() for i in b) for b in layout]
            self._settle(
                f"DDP rebuilt bucket {index} with {len(params)} parameters ({got} elements), where the prediction "
                f"(buckets of {want} elements) had {len(expected)} parameters there; the first iteration of each "
                "attempt is reduced in another layout than the iterations after it"
            )
        elif index == len(layout) - 1:
            self._settle(None)
        return self._average(bucket.buffer())

    def _settle(self, problem: str | None) -> None:
        self._settled = True
        self._remove_hooks()
        if problem is None:
            self.status = "verified"
            log.debug("DDP rebuilt its buckets as predicted: %d buckets.", len(self.layout or []))
        else:
            self.status = "mismatch"
            log.warning("%s: %s. Training goes on, with gradients averaged as usual.", NOT_BITWISE, problem)

    def _remove_hooks(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
        self._order = []


def stabilize_buckets(ddp: DistributedDataParallel) -> StableBuckets:
    """Make every iteration of ``ddp``, its first included, reduce gradients in one bucket layout.

    Call once per DDP instance, right after constructing it and before its first forward: it
    registers DDP's communication hook (DDP takes one; registering another afterwards raises).

    Contract: the hook averages the gradients over ``ddp.process_group`` (divides each bucket by its
    size, then all-reduces the sum) in every iteration; the result is DDP's average, though not
    bitwise DDP's built-in one (which multiplies by 1/size): runs with the hook agree bitwise with
    each other, not with runs without it. Where DDP rebuilds its buckets after its first iteration
    (``find_unused_parameters=False`` or ``static_graph=True``), the hook reduces that iteration in
    the layout the rebuild produces: from rank 0's gradient-ready order, with the same assignment
    function and size limits as DDP's C++ Reducer. So for a given world size and a model whose
    gradient-ready order does not change between iterations, step N of a resumed attempt reduces
    exactly as step N of an uninterrupted run. After the rebuild the hook checks DDP's actual
    buckets against the prediction; if they differ it logs one warning starting with
    :data:`NOT_BITWISE` and goes on averaging correctly, as it does where the rebuild cannot be
    modelled (sparse gradients, DDP's mixed_precision or Python reducer, a torch that lacks the
    private functions used). Where DDP never rebuilds, the hook only averages.

    Costs: per step, one Python call per bucket and one pass over the gradients dividing them by the
    world size, which DDP's built-in reduction fuses into its copy into the bucket (every Python
    communication hook pays it, torch's ``allreduce_hook`` too; on a GPU a few microseconds, on a
    CPU a few percent of a small model's step). In the first iteration of an attempt (two with
    ``static_graph``): a broadcast of rank 0's ready order (one int64 per parameter tensor; one host
    synchronisation on CUDA), one extra copy of the gradients, bucket by bucket, each all-reduced
    before the next is copied (extra memory: the largest bucket); DDP's initial layout does not
    overlap that iteration's communication with the backward pass either. Until the check, one
    post-accumulate-grad hook per parameter, removed after it. Nothing grows with the number of ranks.

    Returns the hook's state (its ``status``, the predicted ``layout``), for inspection.
    """
    stable = StableBuckets(ddp)
    try:
        ddp.register_comm_hook(None, stable.hook)
    except BaseException:
        stable._remove_hooks()  # e.g. a hook was registered already: leave the parameters as they were
        raise
    return stable
