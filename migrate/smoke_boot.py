"""Start-up hook of ``bench smoke``: installs the runtime redirection inside each child process.

``bench smoke`` writes a throw-away ``sitecustomize.py`` that calls :func:`boot` and puts its
directory first on ``PYTHONPATH``. Python imports ``sitecustomize`` at start-up, so every Python
process of the run - the script, ``torchrun`` and each of its workers - installs the redirection
before user code runs, and only those processes do: the ``bench`` process itself is untouched.
"""

from __future__ import annotations

import atexit
import importlib.machinery
import importlib.util
import os
import sys
import time

from parabench import redirect

ENV_SOURCES = "PARABENCH_SMOKE_REDIRECT"  # comma-separated sources, e.g. "npu" or "npu,cuda"

SITECUSTOMIZE = (
    "# Written by `bench smoke` (parabench.migrate.smoke); deleted when the run ends.\n"
    "import parabench.migrate.smoke_boot as _parabench_smoke_boot\n"
    "_parabench_smoke_boot.boot(__file__)\n"
)


def _chain_sitecustomize(own_file: str) -> None:
    """Run the ``sitecustomize`` our file shadows, if the environment has one."""
    own_dir = os.path.dirname(os.path.abspath(own_file))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != own_dir]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


# How long the interpreter waits at exit for torch's communication threads (see below).
GLOO_DRAIN_S = 0.2


def _drain_gloo_threads() -> None:
    """Give gloo's worker threads the GIL once more before the interpreter finalizes.

    Under the emulation every torch call runs inside the redirection's TorchFunctionMode, so each
    collective's ``AsyncWork`` captures that Python object in its thread-local state. gloo's
    ``pt_gloo_runloop`` thread drops its reference to a finished work (the DDP reducer's last
    all-reduce) after the main thread has moved on; when the main thread reaches interpreter
    finalization first, that thread's GIL acquire exits it mid-destructor and the process aborts
    with ``terminate called without an active exception`` (seen under gdb: runLoop ->
    ~AsyncAllreduceWork -> ~ThreadLocalState -> decref -> take_gil -> pthread_exit; the upstream
    race: pytorch/pytorch#190489, #179291). Sleeping here (atexit, interpreter still whole) lets a
    thread that waits for the GIL finish first.
    """
    if "torch" in sys.modules:
        time.sleep(GLOO_DRAIN_S)


def boot(own_file: str) -> None:
    """Install the redirections named in ``$PARABENCH_SMOKE_REDIRECT`` onto the cpu."""
    _chain_sitecustomize(own_file)
    sources = [s.strip() for s in os.environ.get(ENV_SOURCES, "").split(",") if s.strip()]
    if not sources:
        return
    try:
        for source in sources:
            redirect.install(source, "cpu")
    except Exception as e:  # site would swallow it; a smoke run without its redirection is meaningless
        raise SystemExit(f"bench smoke: could not install the {'/'.join(sources)} -> cpu emulation: {e}") from e
    atexit.register(_drain_gloo_threads)
    rank = os.environ.get("RANK")
    where = f"pid {os.getpid()}" + (f", rank {rank}" if rank is not None else "")
    print(f"[bench smoke] {'/'.join(sources)} emulated on CPU ({where})", file=sys.stderr, flush=True)
