"""The peak host memory of a command and the processes it starts (``bench convert`` records it).

Measured as the sum of the proportional set sizes (``Pss`` of ``/proc/<pid>/smaps_rollup``: each
resident page divided by the number of processes that map it; ``VmRSS`` of ``/proc/<pid>/status``
where smaps_rollup cannot be read) of this process and every live descendant, sampled every
:data:`SAMPLE_S` by a background thread, and never below
the largest single process's own peak (``getrusage``'s ``ru_maxrss`` for this process and for its
waited-for children, which the kernel keeps exactly; proc(5), getrusage(2)). A peak shorter than the
sampling period can be missed by the sum, not by the single-process floor. A sum of VmRSS counts a
page shared by several processes once per process: a forked writer (Megatron's checkpoint save forks
them) seemed to double its parent's memory (21 GiB summed for a 0.3B conversion, 2026-12-06).
"""

from __future__ import annotations

import os
import resource
import threading
from pathlib import Path
from types import TracebackType

SAMPLE_S = 0.2
PROC = Path("/proc")
METHOD = (
    f"sum of Pss (smaps_rollup; VmRSS where unreadable) over bench and its descendants sampled every {SAMPLE_S} s, "
    "at least the largest process's ru_maxrss (getrusage)"
)


def _children(proc: Path = PROC) -> dict[int, list[int]]:
    """parent pid -> its children's pids, from ``/proc/<pid>/stat`` (field 4 is the parent)."""
    tree: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # the process ended meanwhile
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the command name in (...) may hold spaces
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def _resident_bytes(pid: int, proc: Path = PROC) -> int:
    """``Pss`` of smaps_rollup (shared pages split between their processes), else ``VmRSS``."""
    try:
        for line in (proc / str(pid) / "smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass  # no smaps_rollup (kernel < 4.14, or not ours to read): the resident set size
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass  # ended meanwhile: it holds no memory now
    return 0


def tree_resident_bytes(root: int, proc: Path = PROC) -> int:
    """The resident bytes of ``root`` and all its live descendants now, a shared page counted once."""
    tree, total, todo = _children(proc), 0, [root]
    while todo:
        pid = todo.pop()
        total += _resident_bytes(pid, proc)
        todo.extend(tree.get(pid, []))
    return total


def _maxrss() -> tuple[int, int]:
    """The peaks of this process and of its largest waited-for descendant so far (Linux: kB)."""
    return (
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
    )


class PeakHostMemory:
    """``with PeakHostMemory() as peak: ...`` then ``peak.bytes``: see the module's docstring."""

    def __init__(self, sample_s: float = SAMPLE_S):
        self.sample_s, self.bytes = sample_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="peak-host-memory", daemon=True)
        self._sampling = PROC.is_dir()
        self._maxrss_before = _maxrss()

    def _sample(self) -> None:
        pid = os.getpid()
        while True:
            self.bytes = max(self.bytes, tree_resident_bytes(pid))
            if self._stop.wait(self.sample_s):
                return

    def __enter__(self) -> PeakHostMemory:
        self._maxrss_before = _maxrss()
        if self._sampling:
            self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._sampling:
            self._stop.set()
            self._thread.join()
        # a lifetime peak counts only when it rose inside the block: then this block set it
        risen = [after for before, after in zip(self._maxrss_before, _maxrss(), strict=True) if after > before]
        self.bytes = max([self.bytes, *(kb * 1024 for kb in risen)])
