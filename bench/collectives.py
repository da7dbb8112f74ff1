"""What ``bench comm`` measures, as pure definitions: the operations and their bus-bandwidth
factors, the size sweep, the expected result values of the correctness check, and the fitted
latency/bandwidth (alpha-beta) model. No torch here: the front end (:mod:`parabench.comm.command`) checks a
command before launch with these, and the per-rank worker (:mod:`parabench.comm.worker`) runs them.

Sizes and bandwidths follow nccl-tests (docs/sources.md#collectives-benchmark): ``size`` S is the
largest buffer of the operation (all-reduce and broadcast: the buffer; all-gather: the gathered
output; reduce-scatter: the input; all-to-all: each rank's buffer; send/recv: the message), time t
is one operation, algorithm bandwidth ``algbw = S / t`` and bus bandwidth ``busbw = algbw x factor``
with the factors of :data:`OPS`. GB/s are 1e9 bytes per second, as nccl-tests prints them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from parabench.commvolume import bus_factor
from parabench.errors import SpecError
from parabench.spec import BackendSpec, DeviceSpec, LaunchSpec, TrackingSpec, build


@dataclass(frozen=True)
class Op:
    name: str
    bus_factor: str  # the formula, in n = ranks taking part
    split: bool  # S is split into n equal pieces (one per rank): S must be a multiple of n elements
    reduces: bool  # sums values (the check expects the sum over ranks)

    def factor(self, n: int) -> float:
        """nccl-tests' bus-bandwidth factor (docs/sources.md#communication-volume)."""
        return factor_of(self.name, n)


# Operations whose bus factor is that of a commvolume kind: all-to-all moves (n-1)/n of its buffer
# like all-gather; broadcast, reduce and send/recv move the buffer once.
_FACTOR_AS = {"all_to_all": "all_gather", "broadcast": "send", "reduce": "send", "send_recv": "send", "recv": "send"}


def factor_of(op: str, n: int) -> float:
    """The bus factor of an operation (or commlog kind) on n ranks, from commvolume.bus_factor."""
    return bus_factor(_FACTOR_AS.get(op, op), n)  # type: ignore[arg-type]


OPS: dict[str, Op] = {
    o.name: o
    for o in (
        Op("all_reduce", "2(n-1)/n", split=False, reduces=True),
        Op("all_gather", "(n-1)/n", split=True, reduces=False),
        Op("reduce_scatter", "(n-1)/n", split=True, reduces=True),
        Op("all_to_all", "(n-1)/n", split=True, reduces=False),
        Op("broadcast", "1", split=False, reduces=False),
        Op("send_recv", "1", split=False, reduces=False),
    )
}

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
MAX_BYTES = 1 << 36  # 64 GiB per buffer: beyond any device's memory; a typo, not a benchmark
MAX_SIZES = 64  # points of one sweep


def parse_size(value: Any, key: str) -> int:
    """``1K``, ``256M``, ``4G`` (powers of 1024, as nccl-tests' -b/-e) or a plain byte count."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", str(value), re.IGNORECASE)
    if isinstance(value, bool) or m is None:
        raise SpecError(key, f"{value!r} is not a size (a byte count, or with K, M, G: 1K, 256M)")
    size = int(m.group(1)) * UNITS[m.group(2).upper()]
    if size <= 0:
        raise SpecError(key, f"must be > 0 bytes, got {value!r}")
    if size > MAX_BYTES:
        raise SpecError(key, f"{value!r} = {size} bytes exceeds the {MAX_BYTES >> 30} GiB a buffer may have")
    return size


@dataclass(frozen=True)
class CommOptions:
    """The ``comm.*`` keys of ``bench comm``."""

    ops: tuple[str, ...] = tuple(OPS)
    min_bytes: Any = "1K"
    max_bytes: Any = "16M"
    factor: int = 2  # next size = size x factor (nccl-tests -f)
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    warmup_iters: int = 5
    iters: int = 20
    inplace: bool = False  # all-gather / reduce-scatter with the rank's piece inside the large buffer
    check: bool = True  # compare every result with its expected values (nccl-tests -c)
    corrupt: str | None = None  # testing the check: rank 0 corrupts this op's result (a wrong reduction)


@dataclass(frozen=True)
class CommJob:
    """One ``bench comm`` job: the launcher, device, tracking and backend keys of a ``bench run`` job
    (the fields of JobSpec the launchers and the adapters' ``init_worker`` read) and ``comm.*``."""

    backend: BackendSpec
    device: DeviceSpec
    launch: LaunchSpec
    tracking: TrackingSpec
    results_dir: str
    options: CommOptions


@dataclass(frozen=True)
class SizePoint:
    op: str
    size: int  # bytes of the operation's largest buffer, after rounding
    requested: int  # the sweep's size before rounding to whole elements per rank
    count: int  # elements of that buffer


def options(node: Mapping[str, Any] | None) -> CommOptions:
    opts = build(CommOptions, node, "comm")
    unknown = [o for o in opts.ops if o not in OPS]
    if not opts.ops or unknown:
        raise SpecError(
            "comm.ops", f"unknown operation {unknown[0] if unknown else '(none)'} (choose from {', '.join(OPS)})"
        )
    for key in ("iters", "factor"):
        if getattr(opts, key) <= (0 if key == "iters" else 1):
            raise SpecError(f"comm.{key}", f"must be > {0 if key == 'iters' else 1}, got {getattr(opts, key)}")
    if opts.warmup_iters < 0:
        raise SpecError("comm.warmup_iters", f"must be >= 0, got {opts.warmup_iters}")
    if opts.corrupt is not None and opts.corrupt not in opts.ops:
        raise SpecError("comm.corrupt", f"{opts.corrupt!r} is not among comm.ops ({', '.join(opts.ops)})")
    return opts


def sweep(opts: CommOptions, world: int) -> list[SizePoint]:
    """Every (op, size) of the sweep. Sizes go min_bytes, x factor, .., up to max_bytes; each is
    rounded down to whole elements (and, for the split operations, whole elements per rank), and
    the rounding is kept to be shown. Raises SpecError for a sweep that cannot run on ``world`` ranks."""
    lo, hi = parse_size(opts.min_bytes, "comm.min_bytes"), parse_size(opts.max_bytes, "comm.max_bytes")
    if lo > hi:
        raise SpecError("comm.min_bytes", f"{lo} B is larger than comm.max_bytes = {hi} B")
    sizes = [lo * opts.factor**i for i in range(int(math.log(hi / lo, opts.factor) + 1e-9) + 1)]
    if len(sizes) > MAX_SIZES:
        raise SpecError(
            "comm.factor", f"{len(sizes)} sizes from {lo} to {hi} B; at most {MAX_SIZES} (raise comm.factor)"
        )
    if "send_recv" in opts.ops and world < 2:
        raise SpecError("comm.ops", "send_recv needs at least 2 ranks (launcher.nproc_per_node=2)")
    elt = DTYPE_BYTES[opts.dtype]
    points = []
    for name in opts.ops:
        unit = elt * (world if OPS[name].split else 1)
        for s in sizes:
            if s < unit:
                raise SpecError(
                    "comm.min_bytes",
                    f"{s} B is less than one {opts.dtype} element per rank for {name} on {world} ranks ({unit} B)",
                )
            points.append(SizePoint(name, s - s % unit, s, (s - s % unit) // elt))
    return points


def input_value(rank: int, index: int) -> int:
    """Rank ``rank``'s input element ``index``: small integers, so that sums over up to 64 ranks are
    exact in bf16 and fp16 and the check can demand equality (nccl-tests -c)."""
    return (rank + index) % 4 + 1


def expected_sum(world: int, index: int) -> int:
    return sum(input_value(r, index) for r in range(world))


# --------------------------------------------------------------------------------------------
# The alpha-beta model of one operation: t(S) = alpha + beta x S.
# --------------------------------------------------------------------------------------------
MAX_FIT_ERR = 0.5  # above this largest relative error the fitted alpha and beta are not shown as a model


@dataclass(frozen=True)
class Fit:
    alpha_s: float  # latency: the time of an empty operation
    beta_s_per_byte: float  # inverse bandwidth: 1 / beta is the asymptotic algbw
    max_rel_err: float  # max over sizes of |fit - measured| / measured
    points: int

    def problem(self) -> str | None:
        """Why the two numbers do not describe the measured curve (then print no bandwidth), or None."""
        if self.beta_s_per_byte <= 0:
            return "the time does not grow with the size (no bandwidth to fit: too few or too noisy sizes)"
        if self.max_rel_err > MAX_FIT_ERR:
            return f"the model misses a measured time by {100 * self.max_rel_err:.0f}% (noisy sizes?)"
        return None

    def as_params(self, op: str) -> dict[str, str]:
        bw = 1 / self.beta_s_per_byte / 1e9 if self.beta_s_per_byte > 0 else float("inf")
        return {
            f"fit.{op}.alpha_us": f"{self.alpha_s * 1e6:.4g}",
            f"fit.{op}.beta_ns_per_byte": f"{self.beta_s_per_byte * 1e9:.6g}",
            f"fit.{op}.algbw_asymptote_GBps": f"{bw:.4g}",
            f"fit.{op}.max_rel_err": f"{self.max_rel_err:.4g}",
            f"fit.{op}.points": str(self.points),
            **({f"fit.{op}.warning": self.problem()} if self.problem() else {}),
        }


def fit_alpha_beta(sizes: list[int], times: list[float]) -> Fit | None:
    """Least squares of the relative error (each point weighted by 1 / t, so that latency-bound
    small sizes count as much as bandwidth-bound large ones). None with fewer than 2 sizes."""
    if len(sizes) < 2 or len(set(sizes)) < 2:
        return None
    # minimise sum(((alpha + beta s) - t) / t)^2: normal equations of the 2x2 system
    w = [1 / (t * t) for t in times]
    s0, s1, s2 = sum(w), sum(wi * s for wi, s in zip(w, sizes)), sum(wi * s * s for wi, s in zip(w, sizes))
    b0, b1 = sum(wi * t for wi, t in zip(w, times)), sum(wi * s * t for wi, s, t in zip(w, sizes, times))
    det = s0 * s2 - s1 * s1
    alpha, beta = (b0 * s2 - b1 * s1) / det, (s0 * b1 - s1 * b0) / det
    err = max(abs(alpha + beta * s - t) / t for s, t in zip(sizes, times))
    return Fit(alpha, beta, err, len(sizes))


# --------------------------------------------------------------------------------------------
# A communication stack bench comm drives: declared by the backend's adapter (``Adapter.comm_stack``).
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stack:
    """What ``bench comm backend=<name>`` measures, and what it cannot do where."""

    library: str  # what is measured, with {lib} = the collective library of the device kind
    dtypes: frozenset[str]
    refused: Mapping[tuple[str, str], str]  # (device kind, op) -> why it cannot run there
    ops: str  # "module:Class" of the worker-side operations (imported in the worker only)
    # device kind -> the framework's own collective library; None: torch.distributed's for the device
    libraries: Mapping[str, str] | None = None

    def library_on(self, kind: str, torch_library: str) -> str:
        """The measured library on ``kind`` (``torch_library``: torch.distributed's backend there)."""
        lib = torch_library if self.libraries is None else self.libraries[kind]
        return self.library.format(lib=lib)
