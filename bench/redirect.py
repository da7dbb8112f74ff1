"""Scoped, reversible runtime redirection of one accelerator API onto another device.

Shared infrastructure at the devices floor: the megatron adapter runs Megatron-Core's CUDA code
on the host (or an NPU) with it, and ``bench smoke`` (:mod:`parabench.migrate.smoke_boot`) runs
migrated NPU code on the CPU with it. It imports nothing of parabench.

This is the mechanism of torch_npu's ``transfer_to_npu`` (Ascend/pytorch
``torch_npu/contrib/transfer_to_npu.py``, see docs/runtime.md), generalised and made
reversible:

* source ``"cuda"`` or ``"npu"`` (the API the program was written for),
* target ``"cpu"`` (everywhere) or ``"npu"`` (needs ``torch_npu``, real or emulated).

Nothing happens at import time. Apply it with ``redirect(...)`` (a context manager) or
``install(...)`` (returns a :class:`Redirection` with ``.remove()``). Removal restores every
patched attribute, ``sys.modules`` entry, ``sys.meta_path`` finder, ``copyreg`` entry and the
TorchFunctionMode exactly. Redirections stack; they must be removed in reverse order.

What one redirection ``source -> target`` patches (``S`` = ``torch.<source>``):

* ``S.*`` runtime API (``torch.cuda`` is patched in place, plus ``torch.cuda.random`` and
  ``torch.cuda.memory``; for ``npu`` without torch_npu a stand-in ``torch.npu`` module is
  created): is_available, device_count, current_device, set_device, device, device_of,
  synchronize, Stream, Event, stream, current_stream, default_stream, set_stream,
  is_current_stream_capturing (cpu target: False),
  manual_seed(_all), seed(_all), initial_seed, get/set_rng_state(_all), default_generators,
  is_initialized, init, _lazy_init, memory_* / max_memory_* / reset_* / memory_stats /
  memory_summary / mem_get_info / empty_cache / ipc_collect, get_device_properties,
  get_device_name, get_device_capability, get_arch_list, is_bf16_supported,
  is_tf32_supported, utilization / temperature / power_draw / clock_rate, the legacy
  ``S.FloatTensor``-style types, and ``torch.cuda.nvtx`` range functions (no-ops).
  With target ``npu`` the same names are taken from ``torch.npu``.
* ``Tensor.<source>()``, ``Module.<source>()`` -> target; ``Tensor.is_<source>`` is True for
  tensors on the target (as transfer_to_npu maps is_cuda -> is_npu); with target cpu,
  ``Tensor.type()`` reports ``torch.<source>.FloatTensor``-style names for them (Megatron's
  mixed-precision optimizers compare these strings) and accepts such names as arguments.
  ``Tensor.record_stream`` is a no-op on the cpu target.
* A ``torch.overrides.TorchFunctionMode`` rewrites device arguments of every torch function
  and Tensor method: ``device=`` keywords (``"cuda"``, ``"cuda:1"``, ``torch.device``, bare
  ints), the positional device of ``Tensor.to``; on the cpu target ``pin_memory=True`` becomes
  False and ``Tensor.pin_memory()`` returns the tensor. ``nn.Module.to`` and
  ``torch.utils._device.DeviceContext`` (``torch.set_default_device``, ``with torch.device(..)``)
  map their device argument in Python.
* ``torch.amp.autocast`` (so also ``torch.autocast`` and ``torch.<source>.amp.autocast``):
  ``device_type=source`` -> target; on cpu float16 becomes bfloat16 (CPU autocast supports
  bf16; fp16 without a loss scaler underflows).
* ``torch.amp.GradScaler`` (so also ``torch.<source>.amp.GradScaler``): device -> target;
  on cpu it is built with ``enabled=False``, i.e. a pass-through scaler with the same API.
* ``torch.distributed.init_process_group`` / ``new_group``: ``nccl``/``hccl`` -> ``gloo`` on
  cpu (``nccl`` -> ``hccl`` on npu), ``"cuda:nccl,cpu:gloo"`` forms too; ``device_id`` dropped
  on cpu. ``barrier(device_ids=...)`` drops device_ids on cpu.
* ``DistributedDataParallel(device_ids=..., output_device=...)`` -> None on cpu.
* ``torch.load(map_location=...)``: source devices -> target; ``None`` -> target on cpu.
* For source ``npu`` without torch_npu: stand-in modules ``torch_npu``, ``torch_npu.npu``,
  ``torch_npu.npu.amp``, ``torch.npu``, ``torch.npu.amp`` (marked ``EMULATED = True``; profiling
  marks ``torch_npu.npu.mstx`` are no-ops, ``torch_npu.profiler`` is torch's recording CPU activity), a
  ``sys.meta_path`` finder that serves ``torch_npu.contrib.transfer_to_npu`` (importing it
  installs a nested ``cuda -> target`` redirection, as the real module redirects cuda to npu),
  and ``torch.device`` replaced by a stand-in factory that maps ``"npu[:i]"`` to the target
  (``isinstance(x, torch.device)`` keeps working; a ``copyreg`` entry keeps devices picklable).

Decisions: on the cpu target ``is_available()`` is True (CPU is available and the program
should take its accelerator path); ``EMULATED`` on the namespace and :func:`current` tell
that it is an emulation. ``device_count()`` is ``LOCAL_WORLD_SIZE`` (torchrun's contract,
default 1): one emulated device per local worker. The emulated RNG *is* the CPU generator:
``torch.cuda.manual_seed`` reseeds ``torch.default_generator`` (dropout etc. on the "device"
runs on CPU, so Megatron's RNG tracker must fork that generator). Memory statistics are 0
(``memory_stats()`` is a ``defaultdict(int)``), ``mem_get_info`` gives host memory.
``get_device_capability`` is ``(0, 0)`` for cuda and ``None`` for npu (as torch_npu).

Known gaps: references bound before install (``from torch.cuda import current_device``,
``from torch.distributed import init_process_group``) are not patched, except what goes
through module globals (``torch.cuda._lazy_call``/``_lazy_init`` read ``is_initialized``);
the TorchFunctionMode is thread-local, so threads started by user code do not see it;
CUDA graphs, MemPool, ExternalStream, ``torch.Generator(device="cuda")``, FSDP ``device_id``,
``custom_fwd`` decorators applied before install, and on the emulated npu
``torch.device("npu").type`` (it is ``"cpu"``) are not covered. See docs/runtime.md.
"""

from __future__ import annotations

import collections
import collections.abc
import contextlib
import copyreg
import importlib.abc
import importlib.machinery
import os
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "RedirectError",
    "Redirection",
    "current",
    "install",
    "redirect",
]

SOURCES = ("cuda", "npu")
TARGETS = ("cpu", "npu")

_STACK: list[Redirection] = []  # active redirections, innermost last
_LOCK = threading.RLock()


class RedirectError(RuntimeError):
    """A redirection cannot be installed or removed as asked."""


# ---------------------------------------------------------------------------------------------
# Bookkeeping: every change goes through _Patches so that remove() can undo it exactly.


class _Patches:
    _MISSING = object()

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []
        self.names: list[str] = []

    def set(self, obj: Any, name: str, value: Any, label: str | None = None) -> None:
        own = vars(obj) if isinstance(obj, (type, types.ModuleType)) else {}
        old = own.get(name, self._MISSING)

        def undo() -> None:
            if old is self._MISSING:
                if name in vars(obj):
                    delattr(obj, name)
            else:
                setattr(obj, name, old)

        setattr(obj, name, value)
        self._undo.append(undo)
        self.names.append(label or f"{getattr(obj, '__name__', obj)}.{name}")

    def module(self, name: str, module: types.ModuleType) -> None:
        old = sys.modules.get(name, self._MISSING)

        def undo() -> None:
            if old is self._MISSING:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old

        sys.modules[name] = module
        self._undo.append(undo)
        self.names.append(f"sys.modules[{name!r}]")

    def call(self, undo: Callable[[], None], label: str) -> None:
        self._undo.append(undo)
        self.names.append(label)

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()


# ---------------------------------------------------------------------------------------------
# Device-string mapping


def _split(dev: str) -> tuple[str, int | None]:
    kind, _, idx = dev.partition(":")
    return kind.strip(), (int(idx) if idx.strip().isdigit() else None)


class _Mapper:
    """Maps device specs of ``source`` onto ``target``."""

    def __init__(self, source: str, target: str, real_device: type) -> None:
        self.source, self.target, self._device = source, target, real_device

    def dev(self, index: int | None) -> str:
        if self.target == "cpu" or index is None:
            return self.target
        return f"{self.target}:{index}"

    def map(self, d: Any, int_ok: bool = True) -> Any:
        if isinstance(d, str):
            kind, idx = _split(d)
            return self.dev(idx) if kind == self.source else d
        if isinstance(d, self._device):
            return self.dev(d.index) if d.type == self.source else d
        if int_ok and isinstance(d, int) and not isinstance(d, bool):
            # A bare int names an accelerator ordinal (``x.to(local_rank)``, ``device=0``).
            return self.dev(d)
        return d

    def index(self, d: Any) -> int:
        if d is None:
            return 0
        if isinstance(d, int):
            return d
        if isinstance(d, str):
            return _split(d)[1] or 0
        return getattr(d, "index", None) or 0

    def backend(self, backend: Any) -> Any:
        if not isinstance(backend, str):
            return backend
        accel = {"nccl", "hccl"}
        new = "gloo" if self.target == "cpu" else "hccl"
        parts = []
        for part in backend.split(","):
            dev, sep, be = part.rpartition(":")
            dev, be = dev.strip(), be.strip()
            if be.lower() in accel:
                be = new
            if sep and dev == self.source:
                dev = self.target
            parts.append(f"{dev}:{be}" if sep else be)
        # "cuda:nccl,cpu:gloo" on the cpu target becomes "cpu:gloo,cpu:gloo": keep one per device
        seen: dict[str, str] = {}
        for p in parts:
            seen.setdefault(p.rpartition(":")[0], p)
        return ",".join(seen.values()) if len(parts) > 1 else parts[0]


# ---------------------------------------------------------------------------------------------
# CPU stand-ins for the accelerator runtime API


class _CpuStream:
    """No-op stream: work on the CPU is already ordered."""

    def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
        self.device = device
        self.priority = priority
        self.cuda_stream = 0
        self.npu_stream = 0

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        event = event or _CpuEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _CpuStream)

    def __hash__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "<emulated stream on cpu>"


class _CpuEvent:
    """Event that records host time, so ``elapsed_time`` gives wall milliseconds."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, **_: Any
    ) -> None:
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        self._t = time.perf_counter()

    def elapsed_time(self, end: _CpuEvent) -> float:
        if self._t is None or end._t is None:
            raise RuntimeError("elapsed_time needs both events recorded")
        return (end._t - self._t) * 1000.0

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


_DEFAULT_STREAM = _CpuStream()


class _DeviceCtx:
    """``torch.cuda.device(i)`` / ``device_of(t)``: switch the emulated current device."""

    def __init__(self, state: _CpuState, device: Any) -> None:
        self._state, self._new, self._old = state, device, 0

    def __enter__(self) -> None:
        self._old = self._state.device
        if self._new is not None and not (isinstance(self._new, int) and self._new < 0):
            self._state.set_device(self._new)

    def __exit__(self, *exc: object) -> None:
        self._state.device = self._old


class _Generators(collections.abc.Sequence):
    """``torch.cuda.default_generators``: the host generator under every device index."""

    def __init__(self, gen: Any, count: Callable[[], int]) -> None:
        self._gen, self._count = gen, count

    def __len__(self) -> int:
        return self._count()

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return tuple(self._gen for _ in range(len(self)))[i]
        return self._gen  # any ordinal: set_device() accepts indices beyond device_count()


class _CpuState:
    """Runtime API of an emulated accelerator whose memory and RNG are the host's."""

    def __init__(self, torch: Any, mapper: _Mapper, source: str) -> None:
        self.torch, self.mapper, self.source = torch, mapper, source
        self.device = 0

    def count(self) -> int:
        try:
            return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        except ValueError:
            return 1

    def set_device(self, device: Any) -> None:
        if isinstance(device, str) and _split(device)[0] == "cpu":
            return
        self.device = self.mapper.index(device)

    def functions(self) -> dict[str, Any]:
        """The emulated ``torch.<source>`` runtime API by name."""
        return {
            **self._device_api(),
            **self._rng_api(),
            **self._memory_api(),
            **self._properties_api(),
            "EMULATED": True,
        }

    def _device_api(self) -> dict[str, Any]:
        state = self
        return {
            "is_available": lambda: True,
            "is_initialized": lambda: True,
            "init": _none,
            "_lazy_init": _none,
            "device_count": state.count,
            "current_device": lambda: state.device,
            "set_device": state.set_device,
            "device": lambda device: _DeviceCtx(state, device),
            "device_of": lambda obj: _DeviceCtx(state, None),
            "synchronize": _none,
            "Stream": _CpuStream,
            "Event": _CpuEvent,
            "stream": lambda stream=None: contextlib.nullcontext(stream),
            "current_stream": lambda device=None: _DEFAULT_STREAM,
            "default_stream": lambda device=None: _DEFAULT_STREAM,
            "set_stream": _none,
            # No CUDA graph is ever captured on the host. A CUDA build of torch (2.6/2.7) calls this
            # from every optimizer step (Optimizer._cuda_graph_capture_health_check) once
            # is_available() says True, and the real one fails without a driver.
            "is_current_stream_capturing": lambda: False,
        }

    def _rng_api(self) -> dict[str, Any]:
        torch, state = self.torch, self
        gen = torch.default_generator

        def set_rng_state_all(states: Any) -> None:
            states = list(states)
            if states:
                torch.set_rng_state(states[min(state.device, len(states) - 1)])

        return {
            "manual_seed": lambda seed: gen.manual_seed(int(seed)),
            "manual_seed_all": lambda seed: gen.manual_seed(int(seed)),
            "seed": lambda: gen.seed(),
            "seed_all": lambda: gen.seed(),
            "initial_seed": lambda: gen.initial_seed(),
            "get_rng_state": lambda device=None: torch.get_rng_state(),
            "set_rng_state": lambda new_state, device=None: torch.set_rng_state(new_state),
            "get_rng_state_all": lambda: [torch.get_rng_state() for _ in range(state.count())],
            "set_rng_state_all": set_rng_state_all,
            "default_generators": _Generators(gen, state.count),
        }

    def _memory_api(self) -> dict[str, Any]:
        source = self.source
        return {
            "memory_allocated": _zero,
            "max_memory_allocated": _zero,
            "memory_reserved": _zero,
            "max_memory_reserved": _zero,
            "memory_cached": _zero,
            "max_memory_cached": _zero,
            "memory_stats": lambda device=None: collections.defaultdict(int),
            "memory_summary": lambda *a, **k: f"emulated {source} on cpu: no allocator statistics",
            "mem_get_info": _host_mem_info,
            "reset_peak_memory_stats": _none,
            "reset_max_memory_allocated": _none,
            "reset_max_memory_cached": _none,
            "reset_accumulated_memory_stats": _none,
            "empty_cache": _none,
            "ipc_collect": _none,
        }

    def _properties_api(self) -> dict[str, Any]:
        source = self.source

        def get_device_properties(device: Any = None) -> Any:
            return types.SimpleNamespace(
                name=f"cpu (emulated {source})",
                total_memory=_host_mem_info()[1],
                major=0,
                minor=0,
                multi_processor_count=os.cpu_count() or 1,
                is_integrated=True,
                uuid="emulated",
            )

        return {
            "get_device_properties": get_device_properties,
            "get_device_name": lambda device=None: f"cpu (emulated {source})",
            # torch_npu returns None here (docs/sources.md#transfer-to-npu-limits); CUDA code expects a tuple.
            "get_device_capability": (lambda device=None: None) if source == "npu" else (lambda device=None: (0, 0)),
            "get_arch_list": lambda: [],
            "is_bf16_supported": lambda including_emulation=True: True,
            "is_tf32_supported": lambda: False,
            "utilization": _zero,
            "temperature": _zero,
            "power_draw": _zero,
            "clock_rate": _zero,
        }


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


def _none(*args: Any, **kwargs: Any) -> None:
    return None


def _host_mem_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes of host memory, for ``mem_get_info``."""
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


# Names of ``torch.cuda`` taken from ``torch.npu`` when the target is npu.
_NPU_TARGET_NAMES = (
    "is_available", "device_count", "current_device", "set_device", "device", "device_of", "synchronize",
    "Stream", "Event", "stream", "current_stream", "default_stream", "set_stream", "manual_seed",
    "manual_seed_all", "seed", "seed_all", "initial_seed", "get_rng_state", "set_rng_state",
    "get_rng_state_all", "set_rng_state_all", "default_generators", "is_initialized", "init",
    "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved", "memory_stats",
    "memory_summary", "mem_get_info", "reset_peak_memory_stats", "reset_max_memory_allocated",
    "reset_accumulated_memory_stats", "empty_cache", "ipc_collect", "get_device_properties",
    "get_device_name", "get_device_capability", "is_bf16_supported", "utilization",
)  # fmt: skip

_LEGACY_TYPES = (
    "FloatTensor", "DoubleTensor", "HalfTensor", "BFloat16Tensor", "ByteTensor", "CharTensor",
    "ShortTensor", "IntTensor", "LongTensor", "BoolTensor",
)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Device argument rewriting


def _make_mode(torch: Any, mapper: _Mapper) -> Any:
    from torch.overrides import TorchFunctionMode

    to_funcs = {torch._C.TensorBase.to}
    pin_funcs = {torch._C.TensorBase.pin_memory}
    cpu = mapper.target == "cpu"

    class DeviceRedirectMode(TorchFunctionMode):
        """Rewrites ``device`` arguments naming the source device (parabench.redirect)."""

        def __torch_function__(self, func: Any, types_: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            if kwargs:
                if "device" in kwargs:
                    kwargs = dict(kwargs)
                    kwargs["device"] = mapper.map(kwargs["device"])
                if cpu and kwargs.get("pin_memory"):
                    kwargs = dict(kwargs, pin_memory=False)
            else:
                kwargs = {}
            if func in to_funcs and len(args) > 1:
                args = (args[0], mapper.map(args[1]), *args[2:])
            elif cpu and func in pin_funcs:
                return args[0]
            return func(*args, **kwargs)

    return DeviceRedirectMode()


class _DeviceFactoryMeta(type):
    """Metaclass of the ``torch.device`` stand-in used while npu is emulated without torch_npu."""

    _real: type
    _mappers: list[_Mapper]

    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, cls._real)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, cls._real)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        kind = kwargs.get("type", args[0] if args else None)
        if isinstance(kind, str):
            base, idx = _split(kind)
            for m in cls._mappers:
                if base == m.source:
                    return cls._real(m.dev(kwargs.get("index", args[1] if len(args) > 1 else idx)))
        return cls._real(*args, **kwargs)


def _rebuild_device(*args: Any) -> Any:
    """Unpickles a ``torch.device`` pickled while the ``torch.device`` stand-in was active."""
    import torch

    real = getattr(torch.device, "_real", torch.device)
    return real(*args)


# ---------------------------------------------------------------------------------------------
# The npu stand-in modules


class _TransferToNpuFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``torch_npu.contrib`` and ``torch_npu.contrib.transfer_to_npu`` while npu is emulated.

    Importing the emulated ``transfer_to_npu`` installs ``cuda -> <target>`` (nested in the npu
    redirection), as the real module redirects cuda to npu for the whole process.
    """

    NAMES = ("torch_npu.contrib", "torch_npu.contrib.transfer_to_npu")

    def __init__(self, owner: Redirection) -> None:
        self.owner = owner

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname in self.NAMES:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=fullname.endswith("contrib"))
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        mod = types.ModuleType(spec.name, "parabench emulation of " + spec.name)
        mod.EMULATED = True  # type: ignore[attr-defined]
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__name__.endswith("transfer_to_npu"):
            self.owner._nest("cuda")
        # The loader leaves these in sys.modules: the owner removes them on remove().
        self.owner._loaded.add(module.__name__)


def _mstx_stand_in() -> types.SimpleNamespace:
    """``torch_npu.npu.mstx`` (profiling annotations: docs/sources.md#mstx-markers): marks do nothing
    on the cpu, ``range_start`` hands out ids as the real one does, ``range_end`` takes them."""
    ids = iter(range(1, 1 << 62))

    def mstx_range(message: str = "", stream: Any = None, domain: str = "default") -> Callable:
        return lambda fn: fn

    return types.SimpleNamespace(
        mark=lambda message="", stream=None, domain="default": None,
        range_start=lambda message="", stream=None, domain="default": next(ids),
        range_end=lambda range_id, domain="default": None,
        mstx_range=mstx_range,
        EMULATED=True,
    )


def _profiler_stand_in(torch: Any) -> types.ModuleType:
    """``torch_npu.profiler`` on torch's profiler, NPU activity recorded as CPU activity
    (docs/sources.md#npu-profiler: the names ``transfer_to_npu`` maps, with torch_npu's signatures)."""
    tp = torch.profiler
    mod = types.ModuleType("torch_npu.profiler", "parabench emulation of torch_npu.profiler on the cpu")

    def profile(*, activities: Any = None, experimental_config: Any = None, use_cuda: Any = None, **kwargs: Any) -> Any:
        return tp.profile(activities=[tp.ProfilerActivity.CPU], **kwargs)  # the emulated npu is the cpu

    def tensorboard_trace_handler(dir_name: Any = None, worker_name: Any = None, analyse_flag: bool = True,
                                  async_mode: bool = False) -> Any:  # fmt: skip
        return tp.tensorboard_trace_handler(dir_name or ".", worker_name)

    mod.profile, mod.schedule, mod.ProfilerAction = profile, tp.schedule, tp.ProfilerAction  # type: ignore[attr-defined]
    mod.tensorboard_trace_handler = tensorboard_trace_handler  # type: ignore[attr-defined]
    mod.ProfilerActivity = types.SimpleNamespace(CPU=tp.ProfilerActivity.CPU, NPU=tp.ProfilerActivity.CPU)  # type: ignore[attr-defined]
    mod._ExperimentalConfig = lambda *a, **k: None  # type: ignore[attr-defined]
    mod.analyse = lambda *a, **k: None  # type: ignore[attr-defined]
    mod.EMULATED = True  # type: ignore[attr-defined]
    return mod


def _npu_modules(torch: Any, functions: dict[str, Any], owner: Redirection) -> dict[str, types.ModuleType]:
    npu = types.ModuleType("torch_npu.npu", "parabench emulation of torch_npu.npu on the cpu (not an NPU)")
    for k, v in functions.items():
        setattr(npu, k, v)

    class autocast(torch.amp.autocast_mode.autocast):  # lower case: mirrors torch_npu.npu.amp.autocast
        def __init__(self, enabled: bool = True, dtype: Any = torch.float16, cache_enabled: bool = True) -> None:
            super().__init__("npu", enabled=enabled, dtype=dtype, cache_enabled=cache_enabled)

    class GradScaler(torch.amp.grad_scaler.GradScaler):
        def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                     growth_interval: int = 2000, enabled: bool = True) -> None:  # fmt: skip
            super().__init__("npu", init_scale, growth_factor, backoff_factor, growth_interval, enabled)

    amp = types.ModuleType("torch_npu.npu.amp", "parabench emulation of torch_npu.npu.amp")
    amp.autocast, amp.GradScaler, amp.EMULATED = autocast, GradScaler, True  # type: ignore[attr-defined]
    npu.amp = amp  # type: ignore[attr-defined]
    # Flags commonly set by Ascend scripts; accepted and ignored on the cpu.
    npu.config = types.SimpleNamespace(allow_internal_format=False)  # type: ignore[attr-defined]
    npu.matmul = types.SimpleNamespace(allow_hf32=False)  # type: ignore[attr-defined]
    npu.conv = types.SimpleNamespace(allow_hf32=False)  # type: ignore[attr-defined]
    npu.set_compile_mode = lambda *a, **k: None  # type: ignore[attr-defined]
    npu.mstx = _mstx_stand_in()  # type: ignore[attr-defined]
    for name in _LEGACY_TYPES:
        setattr(npu, name, getattr(torch, name))

    def missing(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"torch_npu/torch.npu attribute {name!r} is not emulated on the cpu by parabench")

    npu.__getattr__ = missing  # type: ignore[attr-defined]

    top = types.ModuleType("torch_npu", "parabench emulation of torch_npu on the cpu: numbers are not NPU numbers")
    top.__path__ = []  # a package, so that torch_npu.contrib can be found  # type: ignore[attr-defined]
    top.npu, top.EMULATED, top.__version__ = npu, True, "0+parabench.emulated"  # type: ignore[attr-defined]
    top.optim = types.SimpleNamespace(NpuFusedAdamW=torch.optim.AdamW)  # type: ignore[attr-defined]
    top.profiler = _profiler_stand_in(torch)  # type: ignore[attr-defined]
    top.__getattr__ = missing  # type: ignore[attr-defined]
    npu.__path__ = []  # type: ignore[attr-defined]
    return {"torch_npu": top, "torch_npu.npu": npu, "torch_npu.npu.amp": amp, "torch_npu.profiler": top.profiler}


# ---------------------------------------------------------------------------------------------
# The handle


class Redirection:
    """An installed redirection ``source -> target``; undo it with :meth:`remove`.

    Attributes: ``source``, ``target``, ``emulated`` (True when the target is the cpu, or an
    emulated npu), ``patched`` (labels of everything changed, for logs and tests).
    """

    def __init__(self, source: str, target: str) -> None:
        self.source, self.target = source, target
        self.emulated = target == "cpu"
        self._patches = _Patches()
        self._mode: Any = None
        self._nested: list[Redirection] = []
        self._loaded: set[str] = set()
        self._removed = False
        self._thread = threading.get_ident()

    @property
    def patched(self) -> tuple[str, ...]:
        return tuple(self._patches.names)

    @property
    def active(self) -> bool:
        return not self._removed

    def __repr__(self) -> str:
        state = "removed" if self._removed else "active"
        return f"<Redirection {self.source} -> {self.target} ({state}, {len(self._patches.names)} patches)>"

    def __enter__(self) -> Redirection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # -- install ------------------------------------------------------------------------------

    def _nest(self, source: str) -> None:
        if any(r.source == source for r in _STACK if r.active):
            return
        self._nested.append(install(source, self.target))

    def _install(self) -> None:
        import torch

        real_device = getattr(torch.device, "_real", torch.device)
        mapper = _Mapper(self.source, self.target, real_device)
        # 1. The runtime namespace torch.<source>.
        functions = self._runtime_functions(torch, mapper)
        if self.source == "cuda":
            self._patch_cuda_namespace(torch, functions)
        else:
            self._install_npu_emulation(torch, functions, mapper, real_device)
        # 2. Tensor / Module methods.
        self._patch_moves(torch, mapper)
        # 3. autocast, GradScaler and torch.device(...) contexts.
        self._patch_amp(torch, mapper)
        # 4. torch.distributed and DDP.
        self._patch_distributed(torch, mapper)
        # 5. torch.load(map_location=...).
        self._patch_load(torch, mapper)
        # 6. The TorchFunctionMode for device arguments (last, so it is popped first).
        self._mode = _make_mode(torch, mapper)
        self._mode.__enter__()
        self._thread = threading.get_ident()

    def _runtime_functions(self, torch: Any, mapper: _Mapper) -> dict[str, Any]:
        """What ``torch.<source>`` offers under the redirection: the host's emulated runtime, or torch.npu's."""
        src, tgt = self.source, self.target
        if tgt == "cpu":
            functions = _CpuState(torch, mapper, src).functions()
        else:
            target_ns = getattr(torch, "npu", None)
            if target_ns is None:
                raise RedirectError(
                    "target 'npu' needs torch_npu (or an npu emulation: install(source='npu', target='cpu') first)"
                )
            self.emulated = bool(getattr(target_ns, "EMULATED", False))
            functions = {n: getattr(target_ns, n) for n in _NPU_TARGET_NAMES if hasattr(target_ns, n)}
            functions["EMULATED"] = self.emulated
            functions["_lazy_init"] = lambda: None
        functions["REDIRECTED_TO"] = tgt
        return functions

    def _patch_cuda_namespace(self, torch: Any, functions: dict[str, Any]) -> None:
        p, tgt = self._patches, self.target
        for name, value in functions.items():
            p.set(torch.cuda, name, value, f"torch.cuda.{name}")
        for sub in ("random", "memory"):
            mod = getattr(torch.cuda, sub)
            for name, value in functions.items():
                if name in vars(mod) and not name.startswith("_") and name.isidentifier():
                    p.set(mod, name, value, f"torch.cuda.{sub}.{name}")
        if tgt == "cpu":
            for name in _LEGACY_TYPES:
                p.set(torch.cuda, name, getattr(torch, name), f"torch.cuda.{name}")
        nvtx = torch.cuda.nvtx
        for name in ("range_push", "range_pop", "range_start", "range_end", "mark"):
            p.set(nvtx, name, lambda *a, **k: 0, f"torch.cuda.nvtx.{name}")
        p.set(nvtx, "range", lambda *a, **k: contextlib.nullcontext(), "torch.cuda.nvtx.range")

    def _install_npu_emulation(self, torch: Any, functions: dict[str, Any], mapper: _Mapper, real_device: Any) -> None:
        """Source npu on the cpu: torch_npu and torch.npu as modules, transfer_to_npu, torch.device("npu")."""
        p, tgt = self._patches, self.target
        if "torch_npu" in sys.modules and not getattr(sys.modules["torch_npu"], "EMULATED", False):
            # Real torch_npu: redirecting npu onto the cpu would fight the real runtime.
            raise RedirectError("torch_npu is installed: redirect source 'npu' only where it is absent")
        if tgt != "cpu":
            raise RedirectError("source 'npu' can only be redirected to the 'cpu'")
        mods = _npu_modules(torch, functions, self)
        for name, mod in mods.items():
            p.module(name, mod)
        p.module("torch.npu", mods["torch_npu.npu"])
        p.module("torch.npu.amp", mods["torch_npu.npu.amp"])
        p.set(torch, "npu", mods["torch_npu.npu"], "torch.npu")
        finder = _TransferToNpuFinder(self)
        sys.meta_path.insert(0, finder)
        p.call(lambda: sys.meta_path.remove(finder) if finder in sys.meta_path else None, "sys.meta_path finder")
        p.call(lambda: [sys.modules.pop(n, None) for n in sorted(self._loaded, reverse=True)], "torch_npu.contrib")
        # torch.device("npu:0") must not raise on plain torch: a stand-in factory maps it.
        if getattr(torch.device, "_real", None) is None:
            factory = _DeviceFactoryMeta("device", (), {"__doc__": "parabench stand-in for torch.device"})
            factory._real, factory._mappers = real_device, []
            p.set(torch, "device", factory, "torch.device")
            old_reducer = copyreg.dispatch_table.get(real_device)
            p.call(
                lambda: (
                    copyreg.dispatch_table.pop(real_device, None)
                    if old_reducer is None
                    else copyreg.dispatch_table.__setitem__(real_device, old_reducer)
                ),
                "copyreg torch.device",
            )
            copyreg.pickle(real_device, lambda d: (_rebuild_device, (str(d),)))
        factory = torch.device
        factory._mappers.append(mapper)
        p.call(lambda: factory._mappers.remove(mapper), "torch.device mapping")

    def _patch_moves(self, torch: Any, mapper: _Mapper) -> None:
        p, src, tgt = self._patches, self.source, self.target
        on_target = self._on_target_fn(torch)
        tensor_to, module_to = torch.Tensor.to, torch.nn.Module.to

        def tensor_move(t: Any, device: Any = None, non_blocking: bool = False, memory_format: Any = None) -> Any:
            kw = {} if memory_format is None else {"memory_format": memory_format}
            dev = mapper.dev(None if device is None else mapper.index(device))
            return tensor_to(t, dev, non_blocking=non_blocking, **kw)

        def module_move(m: Any, device: Any = None) -> Any:
            return module_to(m, mapper.dev(None if device is None else mapper.index(device)))

        def module_to_redirected(m: Any, *args: Any, **kwargs: Any) -> Any:
            # nn.Module.to parses its arguments in C before any TorchFunctionMode sees them,
            # and "npu" is not a device type of plain torch.
            if args:
                args = (mapper.map(args[0]), *args[1:])
            if "device" in kwargs:
                kwargs["device"] = mapper.map(kwargs["device"])
            return module_to(m, *args, **kwargs)

        p.set(torch.nn.Module, "to", module_to_redirected, "torch.nn.Module.to")
        p.set(torch.Tensor, src, tensor_move, f"torch.Tensor.{src}")
        p.set(torch.Tensor, f"is_{src}", property(on_target), f"torch.Tensor.is_{src}")
        p.set(torch.nn.Module, src, module_move, f"torch.nn.Module.{src}")
        if tgt == "cpu":
            self._patch_tensor_type(torch, on_target)
            p.set(torch.Tensor, "record_stream", lambda t, stream=None: None, "torch.Tensor.record_stream")

    def _patch_amp(self, torch: Any, mapper: _Mapper) -> None:
        p, src, tgt = self._patches, self.source, self.target
        # autocast and GradScaler: patching the base classes covers torch.autocast, torch.amp.*,
        # torch.cuda.amp.* and torch.npu.amp.*, which all call these __init__s.
        ac_cls, gs_cls = torch.amp.autocast_mode.autocast, torch.amp.grad_scaler.GradScaler
        ac_init, gs_init = ac_cls.__init__, gs_cls.__init__

        def autocast_init(
            ac: Any, device_type: str, dtype: Any = None, enabled: bool = True, cache_enabled: Any = None
        ) -> None:
            if device_type == src:
                device_type = tgt
                if tgt == "cpu" and dtype in (None, torch.float16):
                    dtype = torch.bfloat16
            ac_init(ac, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

        def scaler_init(gs: Any, device: str = "cuda", *args: Any, **kwargs: Any) -> None:
            if device == src:
                device = tgt
                if tgt == "cpu":
                    if len(args) >= 5:  # (init_scale, growth_factor, backoff_factor, growth_interval, enabled)
                        args = (*args[:4], False, *args[5:])
                    else:
                        kwargs["enabled"] = False
            gs_init(gs, device, *args, **kwargs)

        p.set(ac_cls, "__init__", autocast_init, "torch.amp.autocast.__init__")
        p.set(gs_cls, "__init__", scaler_init, "torch.amp.GradScaler.__init__")

        # torch.set_default_device / `with torch.device(...)` build a DeviceContext mode, which torch
        # keeps at the *bottom* of the mode stack, below ours: map its device when it is built.
        from torch.utils._device import DeviceContext

        dc_init = DeviceContext.__init__
        p.set(DeviceContext, "__init__", lambda dc, device: dc_init(dc, mapper.map(device)), "DeviceContext.__init__")

    def _patch_load(self, torch: Any, mapper: _Mapper) -> None:
        p, load = self._patches, torch.load

        def load_redirected(*args: Any, **kwargs: Any) -> Any:
            if len(args) >= 2:
                args = (args[0], self._map_location(mapper, args[1]), *args[2:])
            else:
                kwargs["map_location"] = self._map_location(mapper, kwargs.get("map_location"))
            return load(*args, **kwargs)

        p.set(torch, "load", load_redirected, "torch.load")
        if torch.serialization.load is load:
            p.set(torch.serialization, "load", load_redirected, "torch.serialization.load")

    def _on_target_fn(self, torch: Any) -> Callable[[Any], bool]:
        if self.target == "cpu":
            return lambda t: t.device.type == "cpu"
        return lambda t: bool(getattr(t, "is_npu", False))

    def _patch_tensor_type(self, torch: Any, on_target: Callable[[Any], bool]) -> None:
        orig = torch.Tensor.type
        prefix = f"torch.{self.source}."

        def tensor_type(t: Any, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
            if dtype is None and not kwargs:
                name = orig(t)
                if on_target(t) and name.startswith("torch.") and name.count(".") == 1:
                    return prefix + name[len("torch.") :]
                return name
            if isinstance(dtype, str) and dtype.startswith(prefix):
                dtype = "torch." + dtype[len(prefix) :]
            return orig(t, dtype, non_blocking, **kwargs)

        self._patches.set(torch.Tensor, "type", tensor_type, "torch.Tensor.type")

    def _map_location(self, mapper: _Mapper, loc: Any) -> Any:
        if loc is None:
            return "cpu" if self.target == "cpu" else None
        if isinstance(loc, dict):
            return {k: mapper.map(v, int_ok=False) for k, v in loc.items()}
        return mapper.map(loc, int_ok=False)

    def _patch_distributed(self, torch: Any, mapper: _Mapper) -> None:
        if not torch.distributed.is_available():
            return
        import torch.distributed.distributed_c10d as c10d
        from torch.nn.parallel import DistributedDataParallel as DDP

        p, cpu = self._patches, self.target == "cpu"
        ipg, new_group, barrier, ddp_init = c10d.init_process_group, c10d.new_group, c10d.barrier, DDP.__init__

        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            if args:
                args = (mapper.backend(args[0]), *args[1:])
            if "backend" in kwargs:
                kwargs["backend"] = mapper.backend(kwargs["backend"])
            if kwargs.get("device_id") is not None:
                if cpu:
                    kwargs.pop("device_id")
                else:
                    kwargs["device_id"] = torch.device(mapper.map(kwargs["device_id"]))
            return ipg(*args, **kwargs)

        def new_group_redirected(*args: Any, **kwargs: Any) -> Any:
            if len(args) >= 3:
                args = (*args[:2], mapper.backend(args[2]), *args[3:])
            if "backend" in kwargs:
                kwargs["backend"] = mapper.backend(kwargs["backend"])
            return new_group(*args, **kwargs)

        def barrier_redirected(*args: Any, **kwargs: Any) -> Any:
            if cpu:
                if len(args) >= 3:
                    args = (*args[:2], None, *args[3:])
                kwargs.pop("device_ids", None)
            return barrier(*args, **kwargs)

        def ddp_init_redirected(ddp: Any, module: Any, *args: Any, **kwargs: Any) -> None:
            if cpu:
                args = tuple(None if i < 2 else a for i, a in enumerate(args))
                for k in ("device_ids", "output_device"):
                    if k in kwargs:
                        kwargs[k] = None
            ddp_init(ddp, module, *args, **kwargs)

        for mod in (c10d, torch.distributed):
            p.set(mod, "init_process_group", init_process_group, f"{mod.__name__}.init_process_group")
            p.set(mod, "new_group", new_group_redirected, f"{mod.__name__}.new_group")
            p.set(mod, "barrier", barrier_redirected, f"{mod.__name__}.barrier")
        p.set(DDP, "__init__", ddp_init_redirected, "DistributedDataParallel.__init__")

    # -- remove -------------------------------------------------------------------------------

    def remove(self) -> None:
        """Undo everything this redirection (and any nested one) changed. Idempotent."""
        with _LOCK:
            if self._removed:
                return
            for nested in reversed(self._nested):
                nested.remove()
            if _STACK and _STACK[-1] is not self:
                raise RedirectError(f"{self!r} is not the innermost redirection: remove {_STACK[-1]!r} first")
            if threading.get_ident() != self._thread:
                raise RedirectError("remove() must run on the thread that called install()")
            from torch.overrides import _get_current_function_mode_stack

            stack = _get_current_function_mode_stack()
            if not stack or stack[-1] is not self._mode:
                raise RedirectError("another TorchFunctionMode was entered after install() and is still active")
            self._mode.__exit__(None, None, None)
            self._patches.restore()
            _STACK.pop()
            self._removed = True


def install(source: str = "cuda", target: str = "cpu") -> Redirection:
    """Redirect the ``source`` accelerator API (``"cuda"`` or ``"npu"``) onto ``target``.

    ``target`` is ``"cpu"``, or ``"npu"`` when torch_npu is importable (source must then be
    ``"cuda"``). Returns the :class:`Redirection`; call ``.remove()`` to undo it. Raises
    :class:`RedirectError` for unsupported pairs or if ``source`` is already redirected.
    """
    if source not in SOURCES:
        raise RedirectError(f"source must be one of {SOURCES}, not {source!r}")
    if target not in TARGETS:
        raise RedirectError(f"target must be one of {TARGETS}, not {target!r}")
    if source == target:
        raise RedirectError(f"source and target are both {source!r}")
    with _LOCK:
        if any(r.source == source for r in _STACK):
            raise RedirectError(f"{source!r} is already redirected: {current(source)!r}")
        if target == "npu" and "torch_npu" not in sys.modules:
            try:
                import torch_npu  # noqa: F401
            except ImportError as e:
                raise RedirectError(f"target 'npu' needs torch_npu ({e})") from e
        handle = Redirection(source, target)
        try:
            handle._install()
        except BaseException:
            if handle._mode is not None:
                handle._mode.__exit__(None, None, None)
            handle._patches.restore()
            raise
        _STACK.append(handle)
        return handle


@contextlib.contextmanager
def redirect(source: str = "cuda", target: str = "cpu") -> Iterator[Redirection]:
    """Context manager form of :func:`install`: the redirection exists only inside the block."""
    handle = install(source, target)
    try:
        yield handle
    finally:
        handle.remove()


def current(source: str | None = None) -> Redirection | None:
    """The active redirection of ``source`` (or the innermost one), or None."""
    for r in reversed(_STACK):
        if source is None or r.source == source:
            return r
    return None
