"""The ranks of one node, forked from one process that imported torch once (``launcher.start=fork``).

``python -m parabench.localrun --nproc-per-node N --master-addr ADDR --master-port PORT -m MODULE ARGS...``

torchrun starts an agent that imports torch and then N fresh interpreters that each import torch,
torch.distributed and torch._dynamo again (DistributedDataParallel's constructor reaches for
_dynamo): on this project's 2-core development machine ~3.7 CPU-seconds for the agent and ~5 for
every rank before its first line of work. This launcher imports those modules and the entry module
once (:data:`PRELOAD`, :func:`preload`), forks the ranks from itself (fork(2): the pages stay shared, copy-on-write),
then hosts the rendezvous store that the ranks join as its clients, as torchrun's agent does
(``TORCHELASTIC_USE_AGENT_STORE=True``, read by torch.distributed.rendezvous), watches them, and on
the first rank that fails stops the others and exits 1, writing torchrun's "Root Cause" summary
(rank, exitcode; a signal as its negative number) into its log for the runner's failure line.

Each rank gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT=0,
TORCHELASTIC_MAX_RESTARTS=0, TORCHELASTIC_RUN_ID) and runs the entry module as ``__main__``
with ``sys.argv`` as torchrun would give it. Nothing is computed before the fork (no thread pool
exists yet); should this process hold a second thread anyway, the ranks are started as fresh
interpreters instead (``fresh`` in the log). One node and no restarts only: multi-node jobs,
``launcher.max_restarts`` and ``launcher.rdzv_backend=c10d`` go through torchrun
(:meth:`parabench.launchers.Torchrun.for_job`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from datetime import timedelta
from types import FrameType
from typing import NoReturn

# What every torch.distributed rank of parabench imports before its first line of work (the model, the
# loop, the stacks' shared modules); the entry module follows. None of them starts a thread.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "parabench.model",
    "parabench.loop",
)
STOP_GRACE_S = 10.0  # after SIGTERM to the ranks still running, before SIGKILL
STORE_TIMEOUT_S = 1800.0  # how long the ranks may take to join the store (imports of a backend, JIT builds)


class Stopped(Exception):
    """SIGTERM or SIGINT to this launcher: stop the ranks, then exit 128 + the signal."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m parabench.localrun", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, default=0, help="0: the store binds a free port itself")
    parser.add_argument("--run-id", default="parabench")
    parser.add_argument("-m", dest="module", required=True, help="the per-rank module, run as __main__")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the module's arguments")
    return parser.parse_args(argv)


def log(message: str) -> None:
    print(f"[localrun] {message}", flush=True)


def preload(module: str) -> list[str]:
    """Import what every rank needs, and the entry module where it is one of parabench's (their bodies
    only define: ``main`` runs under ``__main__``); the modules that could not be imported (each rank
    then imports them itself and meets the same error where it can report it)."""
    missing = []
    own = (module,) if module.startswith("parabench.") else ()
    for name in (*PRELOAD, *own):
        try:
            importlib.import_module(name)
        except ImportError as exc:
            missing.append(f"{name} ({exc})")
    return missing


def rank_threads(nproc_per_node: int) -> str | None:
    """The ranks' OMP_NUM_THREADS: the launch's, else 1 where several ranks share the node (torchrun's
    default); None: torch's own default (one rank, nothing set)."""
    wanted = os.environ.get("OMP_NUM_THREADS")
    return wanted if wanted else ("1" if nproc_per_node > 1 else None)


def single_threaded_import(opts: argparse.Namespace) -> str | None:
    """:func:`preload` with OpenMP at one thread: with more, libgomp starts its worker threads as torch
    loads, and a fork copies only the calling thread (a child's team would wait on threads that do not
    exist there). Returns the thread count each rank sets again after the fork (:func:`become_rank`)."""
    wanted = rank_threads(opts.nproc_per_node)
    if wanted is not None:
        os.environ["OMP_NUM_THREADS"] = "1"
    missing = preload(opts.module)
    if missing:
        log("not preloaded (each rank imports them itself): " + "; ".join(missing))
    if wanted is not None:
        os.environ["OMP_NUM_THREADS"] = wanted
    return wanted


def threads() -> int:
    """OS threads of this process (a fork copies only the calling one: a lock another held stays held)."""
    return len(os.listdir("/proc/self/task"))


def rank_env(opts: argparse.Namespace, local_rank: int, port: int) -> dict[str, str]:
    """torchrun's per-worker environment for one node (torch.distributed.elastic.agent.server.api)."""
    n = str(opts.nproc_per_node)
    return {
        "RANK": str(local_rank),
        "LOCAL_RANK": str(local_rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(local_rank),
        "ROLE_NAME": "default",
        "WORLD_SIZE": n,
        "LOCAL_WORLD_SIZE": n,
        "ROLE_WORLD_SIZE": n,
        "GROUP_WORLD_SIZE": "1",
        "MASTER_ADDR": opts.master_addr,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": opts.run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


def become_rank(opts: argparse.Namespace, local_rank: int, port_pipe: int, threads_wanted: str | None) -> NoReturn:
    """In the forked child: wait for the store's port, take the rank's environment, run the entry
    module as ``__main__``, then :func:`end_rank`."""
    with os.fdopen(port_pipe, "rb") as pipe:
        told = pipe.read()
    if not told:  # the launcher died before its store was up
        print(f"[localrun] rank {local_rank}: no rendezvous store", file=sys.stderr, flush=True)
        os._exit(1)
    os.environ.update(rank_env(opts, local_rank, int(told)))
    if threads_wanted is not None:  # what libgomp would have read at torch's import in a fresh rank
        import torch

        torch.set_num_threads(int(threads_wanted))
    sys.argv = [opts.module, *opts.args]
    sys.modules.pop(opts.module, None)  # preloaded: its body runs again as __main__, its imports stay
    try:
        runpy.run_module(opts.module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exit_status(exc.code)
    except BaseException:  # the entry's own failure: its traceback, exit 1 (as the interpreter would)
        traceback.print_exc()
        code = 1
    end_rank(code)


def exit_status(code: object) -> int:
    """``sys.exit``'s argument as the interpreter turns it into an exit status."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def end_rank(code: int) -> NoReturn:
    """A forked rank ends as multiprocessing's forked children do: its threads joined and its streams
    flushed, then ``os._exit``, without the interpreter's teardown - whose finalizers belong to the
    objects the launcher created before the fork (torch's operator libraries among them): a rank
    once hung there, in ``torch.library``'s finalizer, after its last step."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    os._exit(code)


def fork_ranks(opts: argparse.Namespace, threads_wanted: str | None) -> dict[int, tuple[int, int]]:
    """Fork every rank; returns {pid: (local rank, write end of its port pipe)} in the launcher. A
    child never returns from here (:func:`become_rank`)."""
    ranks: dict[int, tuple[int, int]] = {}
    for local_rank in range(opts.nproc_per_node):
        read_end, write_end = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(write_end)
            for _, other in ranks.values():
                os.close(other)
            become_rank(opts, local_rank, read_end, threads_wanted)
        os.close(read_end)
        ranks[pid] = (local_rank, write_end)
    return ranks


def start_fresh(opts: argparse.Namespace, port: int) -> dict[int, int]:
    """Each rank a fresh interpreter (``python -m MODULE ARGS``): {pid: local rank}."""
    started = {}
    for local_rank in range(opts.nproc_per_node):
        env = {**os.environ, **rank_env(opts, local_rank, port)}
        proc = subprocess.Popen([sys.executable, "-m", opts.module, *opts.args], env=env)
        started[proc.pid] = local_rank
    return started


def open_store(opts: argparse.Namespace):
    """The rendezvous store the ranks join as clients; binds port 0 itself when asked for any port,
    so no other process can take the port between its choice and its use."""
    from torch.distributed import TCPStore

    return TCPStore(
        opts.master_addr,
        opts.master_port,
        world_size=opts.nproc_per_node,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=STORE_TIMEOUT_S),
    )


def root_cause(local_rank: int, pid: int, code: int) -> None:
    """The first failure, in the shape of torchrun's summary (parabench.run.command.ROOT_CAUSE reads it)."""
    what = f" ({signal.Signals(-code).name})" if code < 0 and -code in signal.valid_signals() else ""
    log("Root Cause (first observed failure):")
    print(f"  rank      : {local_rank} (local_rank: {local_rank})", flush=True)
    print(f"  exitcode  : {code} (pid: {pid}){what}", flush=True)


def wait_all(ranks: dict[int, int]) -> int:
    """Wait for every rank; on the first failure stop the others. Returns this launcher's exit code."""
    failed = False
    while ranks:
        pid, status = os.waitpid(-1, 0)
        local_rank = ranks.pop(pid, None)
        if local_rank is None:
            continue
        code = os.waitstatus_to_exitcode(status)  # minus the signal, as torchrun reports it
        log(f"rank {local_rank} (pid {pid}) exited with code {code}")
        if code != 0 and not failed:
            failed = True
            root_cause(local_rank, pid, code)
            stop(ranks)
    return 1 if failed else 0


def stop(ranks: dict[int, int]) -> None:
    """SIGTERM to the ranks still running, SIGKILL to those left after STOP_GRACE_S; reaps them all."""
    for pid in ranks:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while ranks and time.monotonic() < deadline:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.05)
        elif ranks.pop(pid, None) is not None:
            log(f"stopped rank (pid {pid}): exit code {os.waitstatus_to_exitcode(status)}")
    for pid in ranks:
        _signal(pid, signal.SIGKILL)
    for pid in list(ranks):
        os.waitpid(pid, 0)
        del ranks[pid]


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _raise_stopped(signum: int, _frame: FrameType | None) -> None:
    raise Stopped(signum)


def supervise_ranks(opts: argparse.Namespace) -> int:
    """Start the ranks (forked, or fresh where forking is unsafe), serve their store, wait for them."""
    threads_wanted = single_threaded_import(opts)
    threads_here = threads()
    forked = threads_here == 1
    ranks: dict[int, int] = {}
    pipes: dict[int, tuple[int, int]] = {}
    if forked:
        pipes = fork_ranks(opts, threads_wanted)  # before the store: its server thread must not be in the fork
        ranks = {pid: local_rank for pid, (local_rank, _) in pipes.items()}
    for signum in (signal.SIGTERM, signal.SIGINT):  # after the fork: the ranks keep the defaults
        signal.signal(signum, _raise_stopped)
    try:
        store = open_store(opts)
        if forked:
            for _, write_end in pipes.values():
                os.write(write_end, str(store.port).encode())
                os.close(write_end)
        else:
            ranks = start_fresh(opts, store.port)
        how = "forked" if forked else f"fresh ({threads_here} threads here: not forked)"
        log(f"{len(ranks)} ranks {how}: pids {sorted(ranks)}, store {opts.master_addr}:{store.port}")
        return wait_all(ranks)
    except Stopped as exc:
        for signum in (signal.SIGTERM, signal.SIGINT):  # a second one acts at once
            signal.signal(signum, signal.SIG_DFL)
        log(f"{signal.Signals(exc.signum).name}: stopping the ranks")
        stop(ranks)
        return 128 + exc.signum


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse(sys.argv[1:] if argv is None else argv)
    if not opts.args:
        sys.exit("[localrun] the entry module needs its arguments (the run directory)")
    return supervise_ranks(opts)


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # nothing to tear down: the store closes with the process (see end_rank)
