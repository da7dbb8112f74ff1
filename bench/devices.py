"""Device kinds (cpu, cuda, npu): detection, the collective backend, timing sync and memory stats.

Detection is separate from the backends (Lightning Fabric's lesson): an adapter says which device
kinds it supports; this module says which are present here and, when one is not, exactly why.
torch_npu is probed in a subprocess, because importing it without the CANN runtime can fail or
abort the interpreter (and, with device-backend autoload, even breaks ``import torch``).
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import platform
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from parabench.flops import GemmReading, cpu_gemm_peak, read_gemm, table_peak

# With torch_npu installed but no CANN, ``import torch`` itself fails unless device-backend
# autoload is off (docs/sources.md#device-backend-autoload). Workers that want torch_npu import it explicitly.
AUTOLOAD_ENV = {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
AUTOLOAD_TEXT = " ".join(f"{k}={v}" for k, v in AUTOLOAD_ENV.items())  # for messages


@dataclass(frozen=True)
class Presence:
    available: bool
    reason: str  # "N x <name>" when available, else why not
    count: int = 0


class ProbeFailed(Exception):
    """A probe interpreter timed out or exited non-zero; the message says which (or its last stderr line)."""


def run_probe(code: str, timeout_s: float, env: dict[str, str] | None = None) -> str:
    """Standard output of ``python -c code`` in a fresh interpreter, with device-backend autoload
    off: imports that can abort the interpreter or take long (torch_npu, MindSpore, DeepSpeed) stay
    out of this process. Raises :class:`ProbeFailed`."""
    try:
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={**os.environ, **AUTOLOAD_ENV, **(env or {})},
        )
    except subprocess.TimeoutExpired:
        raise ProbeFailed(f"timed out after {timeout_s:.0f} s") from None
    if out.returncode != 0:
        raise ProbeFailed((out.stderr.strip().splitlines() or ["no output"])[-1])
    return out.stdout


# distribution names whose versions are recorded with every run (bench run, bench comm, bench env)
VERSIONED = (
    "torch",
    "deepspeed",
    "megatron-core",
    "mindspore",
    "torch-npu",
    "mindspeed",
    "mlflow",
    "hydra-core",
    "numpy",
)


def versions() -> dict[str, str | None]:
    """The installed version of each VERSIONED distribution (None: absent), Python's and CANN's."""
    out: dict[str, str | None] = {d: package_version(d) for d in VERSIONED}
    out["python"] = platform.python_version()
    out["cann"] = cann_version()
    return out


def cpu_info() -> dict[str, object]:
    return {"model": cpu_model(), "cores": os.cpu_count(), "machine": platform.machine()}


def cann_version() -> str | None:
    """CANN toolkit version from its version.cfg / version.info, where installed."""
    roots = [
        os.environ.get("ASCEND_TOOLKIT_HOME"),
        os.environ.get("ASCEND_HOME_PATH"),
        "/usr/local/Ascend/ascend-toolkit/latest",
    ]
    for root in filter(None, roots):
        for name in ("version.cfg", "version.info", "compiler/version.info"):
            p = Path(root) / name
            if p.is_file():
                for line in p.read_text(errors="replace").splitlines():
                    if "version" in line.lower() and "=" in line:
                        return line.split("=", 1)[1].strip().strip('"[]')
    return None


def package_version(dist: str) -> str | None:
    """Installed version of a distribution, or None (no import of the package itself)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_build() -> dict[str, str | None] | None:
    """The string fields of the installed torch's ``torch/version.py`` (``__version__``, ``cuda``,
    ``hip``; torch writes them at build time as plain assignments), read without importing torch
    (2-3 CPU-seconds); None if torch or the file cannot be read."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        tree = ast.parse((Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text())
    except (OSError, SyntaxError, StopIteration):
        return None
    fields: dict[str, str | None] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
            fields[target.id] = value.value if isinstance(value.value, str) else None
    return fields


class Device:
    """One device kind. Subclasses are registered in ``DEVICES`` by ``kind``."""

    kind: ClassVar[str]
    dist_backend: ClassVar[str]

    @classmethod
    def presence(cls) -> Presence:
        raise NotImplementedError

    @classmethod
    def launch_env(cls, nproc_per_node: int, threads_per_rank: int) -> dict[str, str]:
        """Environment for this device kind's workers (accelerators: leave host threading alone)."""
        return {}

    # -- worker side -------------------------------------------------------------------------
    def __init__(self, local_rank: int = 0):
        self.local_rank = local_rank

    @property
    def torch_device(self) -> str:
        return f"{self.kind}:{self.local_rank}"

    def setup(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def reset_peak_memory(self) -> None:
        pass

    def peak_memory(self) -> tuple[int, str]:
        """(bytes, what was measured)."""
        raise NotImplementedError

    def name(self) -> str:
        raise NotImplementedError

    @classmethod
    def peak(cls, precision: str, threads: int, cache_dir: Path, device_name: str, reading: GemmReading | None = None):
        """Peak dense FLOP/s of one device for MFU: the datasheet table; None when unknown."""
        return table_peak(device_name, precision)

    @classmethod
    def read_peak(cls, precision: str, threads: int) -> GemmReading | None:
        """A measurement :meth:`peak` takes as ``reading`` (a device without a datasheet): None."""
        return None


class CPUDevice(Device):
    kind = "cpu"
    dist_backend = "gloo"

    @classmethod
    def presence(cls) -> Presence:
        return Presence(True, f"{os.cpu_count()} cores ({cpu_model()})", 1)

    @property
    def torch_device(self) -> str:
        return "cpu"

    @classmethod
    def launch_env(cls, nproc_per_node: int, threads_per_rank: int) -> dict[str, str]:
        return {"OMP_NUM_THREADS": str(cpu_threads(nproc_per_node, threads_per_rank))}

    def peak_memory(self) -> tuple[int, str]:
        # ru_maxrss is KiB on Linux: the process's peak resident set (includes libraries and
        # the Python heap, not only tensors; CPU has no allocator statistics comparable to CUDA's).
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak RSS of the rank process"

    def name(self) -> str:
        return cpu_model()

    @classmethod
    def peak(cls, precision: str, threads: int, cache_dir: Path, device_name: str, reading: GemmReading | None = None):
        """No datasheet for 'a CPU': a GEMM at the rank's thread count (``reading``, or measured now; cached)."""
        return cpu_gemm_peak(threads, precision, cache_dir, device_name, reading)

    @classmethod
    def read_peak(cls, precision: str, threads: int) -> GemmReading | None:
        return read_gemm(threads, precision)


class CUDADevice(Device):
    kind = "cuda"
    dist_backend = "nccl"

    @classmethod
    def presence(cls) -> Presence:
        version = package_version("torch")
        if version is None:
            return Presence(False, "torch is not installed")
        build = torch_build()  # read, not imported: on a CPU build the parent's check costs no torch import
        if build is not None and build.get("__version__") and build.get("cuda") is None:
            return Presence(False, f"this torch build ({version}) has no CUDA support")
        import torch

        if torch.version.cuda is None:
            return Presence(False, f"this torch build ({torch.__version__}) has no CUDA support")
        if not torch.cuda.is_available():
            return Presence(False, f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device")
        n = torch.cuda.device_count()
        return Presence(True, f"{n} x {torch.cuda.get_device_name(0)}", n)

    def setup(self) -> None:
        import torch

        torch.cuda.set_device(self.local_rank)

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize()

    def reset_peak_memory(self) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats()

    def peak_memory(self) -> tuple[int, str]:
        import torch

        return torch.cuda.max_memory_allocated(), "torch.cuda.max_memory_allocated"

    def name(self) -> str:
        import torch

        return torch.cuda.get_device_name(self.local_rank)


def cann_library() -> Path | None:
    """Where libhccl.so of the CANN toolkit is, if anywhere we know to look."""
    dirs = [os.environ.get(v) for v in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH")]
    candidates = [Path(d) / "lib64" for d in dirs if d]
    candidates += [Path(p) for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    candidates += [Path("/usr/local/Ascend/ascend-toolkit/latest/lib64"), Path("/usr/local/Ascend/cann/lib64")]
    for c in candidates:
        if (c / "libhccl.so").exists():
            return c / "libhccl.so"
    return None


class NPUDevice(Device):
    kind = "npu"
    dist_backend = "hccl"

    @classmethod
    def presence(cls) -> Presence:
        version = package_version("torch-npu") or package_version("torch_npu")
        if version is None or importlib.util.find_spec("torch_npu") is None:
            return Presence(
                False, "torch_npu is not installed (pip install torch-npu, on a machine with the CANN toolkit)"
            )
        if cann_library() is None:
            return Presence(
                False,
                f"torch_npu {version} is installed but the CANN runtime (libhccl.so) is not found: install CANN and "
                "`source /usr/local/Ascend/ascend-toolkit/set_env.sh`; until then `import torch` needs "
                f"{AUTOLOAD_TEXT} (parabench sets it)",
            )
        probe = "import torch, torch_npu; print(torch.npu.device_count(), torch.npu.get_device_name(0) if torch.npu.device_count() else '')"
        try:
            out = run_probe(probe, 120)
        except ProbeFailed as exc:
            return Presence(False, f"torch_npu {version} failed to import: {exc}")
        count, _, name = out.strip().partition(" ")
        if int(count or 0) == 0:
            return Presence(
                False, f"torch_npu {version} with CANN sees no NPU (check ASCEND_RT_VISIBLE_DEVICES and npu-smi)"
            )
        return Presence(True, f"{count} x {name or 'Ascend NPU'}", int(count))

    def setup(self) -> None:
        import torch
        import torch_npu  # noqa: F401  (registers torch.npu; worker process only)

        torch.npu.set_device(self.local_rank)

    def synchronize(self) -> None:
        import torch

        torch.npu.synchronize()

    def reset_peak_memory(self) -> None:
        import torch

        torch.npu.reset_peak_memory_stats()

    def peak_memory(self) -> tuple[int, str]:
        import torch

        return torch.npu.max_memory_allocated(), "torch.npu.max_memory_allocated"

    def name(self) -> str:
        import torch

        return torch.npu.get_device_name(self.local_rank)


DEVICES: dict[str, type[Device]] = {d.kind: d for d in (CPUDevice, CUDADevice, NPUDevice)}


def resolve(kind: str) -> str:
    """``auto`` -> cuda if present, else npu if present, else cpu."""
    if kind != "auto":
        return kind
    for candidate in ("cuda", "npu"):
        if DEVICES[candidate].presence().available:
            return candidate
    return "cpu"


def cpu_threads(nproc_per_node: int, threads_per_rank: int = 0) -> int:
    """Intra-op threads per CPU rank: the ranks of a node share its cores (or the user's choice)."""
    return threads_per_rank or max(1, (os.cpu_count() or 1) // nproc_per_node)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# How long a process that ran collectives waits before its interpreter finalizes (see below).
COMM_DRAIN_S = 0.2


def drain_comm_threads() -> None:
    """Give torch's communication threads the GIL once more before the interpreter finalizes.

    A collective's ``AsyncWork`` captures the thread-local state of the call, Python objects included
    (a TorchFunctionMode such as the CUDA->CPU redirection's, the communication log's wrappers). gloo's
    ``pt_gloo_runloop`` thread drops its reference to a finished work (e.g. DDP's last all-reduce)
    after the main thread has moved on; when the main thread reaches interpreter finalization first,
    that thread's GIL acquire exits it mid-destructor and the process aborts with ``terminate called
    without an active exception`` (under gdb: runLoop -> ~AsyncAllreduceWork -> ~ThreadLocalState ->
    decref -> take_gil -> pthread_exit; upstream: pytorch/pytorch#190489, #179291). Waiting here,
    with the interpreter still whole, lets such a thread finish first. Seen at the end of training
    workers, bench convert's export and bench smoke's emulated runs.
    """
    if "torch" in sys.modules:
        time.sleep(COMM_DRAIN_S)
