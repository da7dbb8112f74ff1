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

from parabench import redirect
from parabench.devices import drain_comm_threads

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
    atexit.register(drain_comm_threads)  # emulated runs abort at exit without it
    rank = os.environ.get("RANK")
    where = f"pid {os.getpid()}" + (f", rank {rank}" if rank is not None else "")
    print(f"[bench smoke] {'/'.join(sources)} emulated on CPU ({where})", file=sys.stderr, flush=True)
