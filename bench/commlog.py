"""The communication of a training step, as the backend really calls it (worker process only).

:meth:`CommLog.install` wraps torch.distributed's collective and point-to-point functions in this
worker process (restored by :meth:`CommLog.uninstall`; nothing outside the worker is touched).
DDP's gradient all-reduce runs in its C++ reducer, which calls no Python function: the DDP adapter
registers torch's own ``allreduce_hook`` as its comm hook, which does the same division and
all-reduce through ``torch.distributed.all_reduce`` (so it is seen here). FSDP2, DeepSpeed
(``deepspeed.comm`` calls ``torch.distributed``) and Megatron (tensor-parallel mappings, pipeline
``batch_isend_irecv``/``isend``/``irecv``, its DDP buckets) call the wrapped functions directly.

Only calls made inside :meth:`CommLog.step` (the loop wraps ``engine.train_step`` with it) count, so
the harness's own collectives (loss and step-time reductions, checksums) are left out. Per step and
kind: calls, ``bytes`` (each call's nccl-tests size: the reduced buffer, the gathered output, the
scattered input, the message), ``bus_bytes`` (bytes x the bus factor of the call's group size,
docs/sources.md#communication-volume) and ``seconds``: the time the training thread spent inside
the calls. A blocking call (async_op=False) returns when it is complete, so its time is exposed
communication; an asynchronous call (async_op=True, DDP's hook, p2p isend/irecv) returns when it is
enqueued, so only that part is counted (``async_calls`` says how many were). Calls of at most
``SCALAR_ELEMENTS`` elements (losses, gradient norms, overflow flags) are kept apart as ``scalar``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from parabench.collectives import factor_of

SCALAR_ELEMENTS = 16

# function -> (kind, which argument holds the tensor whose size is the call's size)
_SIZE_OF: dict[str, tuple[str, Callable[[tuple, dict], Any]]] = {
    "all_reduce": ("all_reduce", lambda a, k: k.get("tensor", a[0] if a else None)),
    "all_gather_into_tensor": ("all_gather", lambda a, k: k.get("output_tensor", a[0] if a else None)),
    "_all_gather_base": ("all_gather", lambda a, k: a[0] if a else k.get("output_tensor")),
    "all_gather_single": ("all_gather", lambda a, k: k.get("output_tensor", a[0] if a else None)),  # torch >= 2.13
    "all_gather": ("all_gather", lambda a, k: k.get("tensor_list", a[0] if a else None)),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a, k: k.get("input", a[1] if len(a) > 1 else None)),
    "_reduce_scatter_base": ("reduce_scatter", lambda a, k: a[1] if len(a) > 1 else k.get("input")),
    "reduce_scatter_single": ("reduce_scatter", lambda a, k: k.get("input", a[1] if len(a) > 1 else None)),
    "reduce_scatter": ("reduce_scatter", lambda a, k: k.get("input_list", a[1] if len(a) > 1 else None)),
    "all_to_all_single": ("all_to_all", lambda a, k: k.get("input", a[1] if len(a) > 1 else None)),
    "broadcast": ("broadcast", lambda a, k: k.get("tensor", a[0] if a else None)),
    "reduce": ("reduce", lambda a, k: k.get("tensor", a[0] if a else None)),
    "all_to_all": ("all_to_all", lambda a, k: k.get("input_tensor_list", a[1] if len(a) > 1 else None)),
    "send": ("send", lambda a, k: k.get("tensor", a[0] if a else None)),
    "isend": ("send", lambda a, k: k.get("tensor", a[0] if a else None)),
    "recv": ("recv", lambda a, k: k.get("tensor", a[0] if a else None)),
    "irecv": ("recv", lambda a, k: k.get("tensor", a[0] if a else None)),
}
# positional index of each function's ``group`` argument (most callers pass it by keyword)
_GROUP_ARG = {
    **dict.fromkeys(("all_reduce", "all_gather_into_tensor", "_all_gather_base", "all_gather_single"), 2),
    **dict.fromkeys(("all_gather", "broadcast"), 2),
    "reduce": 3,
    "all_to_all": 2,
    **dict.fromkeys(("send", "isend", "recv", "irecv"), 2),
    **dict.fromkeys(("reduce_scatter_tensor", "_reduce_scatter_base", "reduce_scatter_single", "reduce_scatter"), 3),
    "all_to_all_single": 4,
}


def _numel_bytes(obj: Any) -> tuple[int, int]:
    if isinstance(obj, (list, tuple)):
        parts = [_numel_bytes(t) for t in obj]
        return sum(p[0] for p in parts), sum(p[1] for p in parts)
    return obj.numel(), obj.numel() * obj.element_size()


class CommLog:
    """Per-step communication of this rank (see the module docstring)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []  # {"step": index, "kinds": {kind: {calls, bytes, ...}}}
        self._current: dict[str, dict[str, float]] | None = None
        self._saved: list[tuple[Any, str, Any]] = []
        self._depth = 0  # a wrapped function calling another (all_gather -> all_gather_into_tensor) counts once

    # -- installation -------------------------------------------------------------------------
    def install(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name in _SIZE_OF:
            original = getattr(c10d, name, None)
            if original is None:
                continue
            wrapped = self._wrap(name, original, dist)
            for module in (dist, c10d):
                if getattr(module, name, None) is original:
                    self._saved.append((module, name, original))
                    setattr(module, name, wrapped)

    def uninstall(self) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()

    def _wrap(self, name: str, fn: Callable, dist: Any) -> Callable:
        kind, size_of = _SIZE_OF[name]

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._current is None or self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - t0
                self._depth -= 1
                pos = _GROUP_ARG[name]
                group = kwargs.get("group", args[pos] if len(args) > pos else None)
                is_async = bool(kwargs.get("async_op")) or name in ("isend", "irecv")
                self._record(kind, size_of(args, kwargs), dist.get_world_size(group), seconds, is_async)

        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapper

    # -- recording ----------------------------------------------------------------------------
    def _record(self, kind: str, tensor: Any, group_size: int, seconds: float, is_async: bool) -> None:
        numel, nbytes = _numel_bytes(tensor)
        key = "scalar" if numel <= SCALAR_ELEMENTS else kind
        assert self._current is not None
        rec = self._current.setdefault(
            key, {"calls": 0, "bytes": 0, "bus_bytes": 0.0, "seconds": 0.0, "async_calls": 0}
        )
        rec["calls"] += 1
        rec["bytes"] += nbytes
        rec["bus_bytes"] += nbytes * factor_of(kind, group_size)
        rec["seconds"] += seconds
        rec["async_calls"] += int(is_async)

    @contextlib.contextmanager
    def step(self, index: int) -> Iterator[None]:
        """Count the calls made inside as training step ``index``."""
        self._current = {}
        try:
            yield
        finally:
            self.steps.append({"step": index, "kinds": self._current})
            self._current = None

    def hook_ddp(self, ddp: Any) -> None:
        """DDP's reducer all-reduces in C++: route its buckets through torch's ``allreduce_hook``
        (divide by the group size, then ``torch.distributed.all_reduce``: what the built-in does)."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        ddp.register_comm_hook(None, allreduce_hook)
