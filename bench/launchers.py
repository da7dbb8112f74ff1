"""How worker processes are started, watched and stopped: torchrun (PyTorch stacks) or msrun (MindSpore).

An adapter names its launcher in ``capabilities.launcher``; a command asks that launcher for the
command line, and each worker asks it where it sits in the world (the two tools export different
environment variables). The dry-run bundle (``launch.sh``) uses the same command, made relocatable.

:func:`supervise` is the one place that starts workers, for ``bench run``, ``bench comm`` and
``bench convert`` alike: a command describes what to launch (:class:`Launch`: the command line, the
environment, the run directory, the watchdog's limits, its own work each poll and its graceful stop)
and gets back the exit code and, where the workers were killed or failed, the reason. The launcher
runs in a process group of its own that dies with this process (:func:`die_with_parent`); SIGINT and
SIGTERM are recorded and acted on between polls (:class:`StopSignals`); a job that stops making
progress is killed by the watchdog; the kill is the launcher's stop signal to its group, then SIGKILL.
"""

from __future__ import annotations

import ctypes
import math
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, ClassVar

from parabench.devices import AUTOLOAD_ENV, DEVICES
from parabench.errors import Interrupted
from parabench.spec import JobSpec

WORKER = ["-m", "parabench.worker"]


def _worker_args(job: JobSpec) -> list[str]:
    """What follows the run directory on the worker's command line (the backend's worker_args)."""
    args: list[str] = job.backend.adapter.worker_args(job)
    return args


def _bundle_args(job: JobSpec) -> str:
    args = _worker_args(job)
    return " " + shlex.join(args) if args else ""


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>; prctl(2): the signal a child gets when its parent dies


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for a launcher that bench starts locally (torchrun, msrun): between fork and
    exec the child asks Linux for ``sig`` when this process dies, however it dies (SIGKILL, the OOM
    killer, a lost login shell), so the launcher never trains on as an orphan. SIGTERM lets torchrun
    stop its workers as it does on scancel (its agent turns SIGTERM into a shutdown of the group).
    The death signal follows the thread that forked: call Popen from the main thread. If this
    process died before the child armed it, the child's parent is no longer us: it sends ``sig`` to
    itself. None off Linux (no prctl). docs/sources.md#pdeathsig."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before fork: the child only calls into it
    parent = os.getpid()
    return lambda: _signal_at_parent_death(libc, sig, parent)


def _signal_at_parent_death(libc: ctypes.CDLL, sig: int, parent: int) -> None:
    """Ask Linux for ``sig`` when this process's parent dies; if ``parent`` is already gone (this
    process was re-parented before asking), send it now."""
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


def redirect_output(run_dir: Path, rank: int) -> None:
    """This worker's stdout and stderr, file descriptors included (its frameworks' C++ logs), into
    ``run_dir/logs/rank<rank>.log``: every worker of every command (run, comm, convert) logs alike."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    fd = os.open(logs / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)


def serve_msrun_scheduler() -> int:
    """msrun runs its scheduler with the workers' command: it computes nothing (CPU target whatever
    the workers' device). init() returns only on failure; when all workers have left, it ends this
    process itself."""
    import mindspore
    from mindspore.communication import init

    mindspore.set_device("CPU")
    init()
    return 0


def stop_with_launcher(sig: int = signal.SIGKILL) -> None:
    """Worker side, first thing: ask Linux for ``sig`` when the launcher that started this process
    (torchrun's agent, msrun) dies, however it dies (the OOM killer, ``kill -9``, a node agent), so no
    worker trains on as an orphan writing checkpoints into a job that has ended. SIGKILL: an orphan
    has no one to report to, and its collectives could only hang. A launcher that stops in order ends
    its workers before it exits, so this fires only when it could not. Both launchers start their
    workers from their main thread, the thread whose end the signal follows (prctl(2)). If the
    launcher died before this call (the worker was re-parented), the worker ends now."""
    if not sys.platform.startswith("linux"):
        return
    launcher = os.getppid()
    if launcher == 1:  # re-parented to init already
        os.kill(os.getpid(), sig)
    _signal_at_parent_death(ctypes.CDLL(None, use_errno=True), sig, launcher)


def msrun_scheduler_started() -> bool:
    """First thing every per-rank entry (run, comm, convert) does: tie this process to its launcher
    (:func:`stop_with_launcher`), then say whether it is msrun's scheduler (``MS_ROLE=MS_SCHED``),
    which the entry serves (:func:`serve_msrun_scheduler`) instead of its work."""
    stop_with_launcher()  # a SIGKILLed torchrun or msrun takes its workers with it
    return os.environ.get("MS_ROLE") == "MS_SCHED"


def rank_of(job: JobSpec, run_dir: Path) -> tuple[int, int, int]:
    """(rank, local_rank, world_size) of this worker from ``job``'s launcher; from here on its output
    goes to ``run_dir/logs/rank<rank>.log``."""
    rank, local_rank, world = get_launcher(job.backend.adapter.capabilities.launcher).coords()
    redirect_output(run_dir, rank)
    record_pid(run_dir, rank)
    return rank, local_rank, world


def record_pid(run_dir: Path, rank: int) -> None:
    """``run_dir/pids/rank<R>``: this rank's pid now (a restarted rank overwrites it); and one line
    per pid any rank of the launch ever had in ``run_dir/pids/incarnations`` - a restarted rank's
    earlier incarnations too, whose leftovers :func:`end_rank_groups` must still reach."""
    pids = run_dir / "pids"
    pids.mkdir(exist_ok=True)
    (pids / f"rank{rank}").write_text(str(os.getpid()))
    with open(pids / "incarnations", "a") as every:  # one short O_APPEND write per rank: no interleaving
        every.write(f"{os.getpid()}\n")


# Credentials of the tracking server: only `bench` itself talks to MLflow, the workers never do, so
# they do not inherit them (a worker's environment is readable by anything that runs in it).
SECRET_ENV = frozenset({"MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"})


def without_secrets(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without the tracking server's credentials (SECRET_ENV)."""
    return {k: v for k, v in env.items() if k not in SECRET_ENV}


class Launcher:
    name: ClassVar[str]
    # what makes this launcher stop its workers: it gets this when bench dies (die_with_parent) and
    # first when bench stops it (then SIGKILL to its process group)
    stop_signal: ClassVar[int] = signal.SIGTERM

    @classmethod
    def command(
        cls, job: JobSpec, port: int, run_dir: str, python: str = sys.executable, entry: Sequence[str] = WORKER
    ) -> list[str]:
        """The command line; ``entry`` is the per-rank module (``bench comm`` starts its own); ``port``
        0 lets the launcher choose one at start, with no window in which another process takes it."""
        raise NotImplementedError

    @classmethod
    def bundle_command(cls, job: JobSpec, port: int) -> str:
        """The shell line of ``launch.sh``; $RUN_DIR, $NODE_RANK and $MASTER_ADDR stay variables."""
        raise NotImplementedError

    @classmethod
    def for_job(cls, job: JobSpec) -> type[Launcher]:
        """The launcher that starts ``job`` on this machine (the bundle and manifests keep ``cls``)."""
        return cls

    @staticmethod
    def coords() -> tuple[int, int, int]:
        """(rank, local_rank, world_size) of this worker, from the launcher's environment."""
        raise NotImplementedError

    @classmethod
    def process_env(
        cls, env: Mapping[str, str], here: Mapping[str, str], python: str = sys.executable
    ) -> dict[str, str]:
        """The environment to start this launcher with on this machine: ``here`` (this shell's), then
        the job's ``env``. Only a local start reads this shell; the bundle and the Kubernetes
        manifest carry ``env`` alone, so they never depend on the submitting environment."""
        return {**without_secrets(here), **env}


class Program(Launcher):
    """One process of a tool a command runs on the side (DeepSpeed's ds_to_universal for bench
    convert): started, watched and stopped by :func:`supervise` like a launcher, in a process group
    of its own that dies with bench, without the tracking credentials (the command line is given
    whole: :meth:`Launch.program`)."""

    name = "program"


def _c10d(job: JobSpec, port: int) -> bool:
    """c10d rendezvous: asked for, needed by launcher.max_restarts (the static one keeps one store
    across restarts, and restarted ranks read the dead ranks' gloo addresses from it;
    docs/sources.md#torchrun-restarts), or a local start with no port named (``port`` 0): the agent
    then binds port 0 itself (torchrun --standalone does the same), so no other process can take
    the port between its choice and its use, as one could with a port picked beforehand."""
    return job.launch.rdzv_backend == "c10d" or job.launch.max_restarts > 0 or port == 0


def unclaimed_port(host: str = "127.0.0.1", tries: int = 64) -> int:
    """A port for a launcher that cannot bind port 0 itself (msrun's scheduler): random, free now,
    and below this host's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range, ip(7)), where the
    kernel never hands it to an outgoing connection (an MLflow client's, another run's) before the
    launcher binds it. Concurrent runs draw independently, so two rarely pick the same one."""
    low = _ephemeral_low()
    draw = random.SystemRandom()
    for _ in range(tries):
        port = draw.randrange(10000, low) if low > 10001 else 0
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return int(probe.getsockname()[1])
    raise OSError(f"no free TCP port below {low} on {host} after {tries} tries")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range starts here (ip(7))


class Torchrun(Launcher):
    name = "torchrun"

    @staticmethod
    def _args(job: JobSpec, port: int) -> list[str]:
        la = job.launch
        args = [f"--nnodes={la.nnodes}", f"--nproc-per-node={la.nproc_per_node}", f"--max-restarts={la.max_restarts}"]
        if _c10d(job, port):  # elastic rendezvous: every node names the same endpoint and id
            return args + ["--rdzv-backend=c10d", f"--rdzv-id={la.rdzv_id}"]
        return args + [f"--master-port={port}"]

    @classmethod
    def command(
        cls, job: JobSpec, port: int, run_dir: str, python: str = sys.executable, entry: Sequence[str] = WORKER
    ) -> list[str]:
        la = job.launch
        where = (
            [f"--rdzv-endpoint={la.master_addr}:{port}"]
            if _c10d(job, port)
            else [f"--node-rank={la.node_rank}", f"--master-addr={la.master_addr}"]
        )
        return [
            python,
            "-m",
            "torch.distributed.run",
            *cls._args(job, port),
            *where,
            *entry,
            run_dir,
            *_worker_args(job),
        ]

    @classmethod
    def bundle_command(cls, job: JobSpec, port: int) -> str:
        la = job.launch
        if _c10d(job, port):
            where = f' --rdzv-endpoint="${{MASTER_ADDR:-{la.master_addr}}}:{port}"'
        else:
            where = f' --node-rank="${{NODE_RANK:-{la.node_rank}}}" --master-addr="${{MASTER_ADDR:-{la.master_addr}}}"'
        return (
            "torchrun " + " ".join(cls._args(job, port)) + where + ' -m parabench.worker "$RUN_DIR"' + _bundle_args(job)
        )

    @staticmethod
    def coords() -> tuple[int, int, int]:
        env = os.environ
        return int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0)), int(env.get("WORLD_SIZE", 1))

    @classmethod
    def for_job(cls, job: JobSpec) -> type[Launcher]:
        """One node without restarts or elastic rendezvous, ``launcher.start=fork``: :class:`Localrun`."""
        la = job.launch
        local = la.nnodes == 1 and la.max_restarts == 0 and la.rdzv_backend == "static"
        return Localrun if local and la.start == "fork" else cls


class Localrun(Torchrun):
    """The ranks of one node forked from one process that imported torch once (parabench.localrun):
    torchrun's environment in every rank, the agent's store, torchrun's failure summary; a 2-rank
    20-step run took 25.6 CPU-seconds instead of 31.3 on a 2-core CPU (docs/architecture.md, step 5)."""

    name = "localrun"

    @classmethod
    def command(
        cls, job: JobSpec, port: int, run_dir: str, python: str = sys.executable, entry: Sequence[str] = WORKER
    ) -> list[str]:
        la = job.launch
        if list(entry[:1]) != ["-m"]:
            raise ValueError(f"localrun runs a module (-m NAME), not {list(entry)}")
        where = [f"--nproc-per-node={la.nproc_per_node}", f"--master-addr={la.master_addr}", f"--master-port={port}"]
        return [
            python,
            "-m",
            "parabench.localrun",
            *where,
            f"--run-id={la.rdzv_id}",
            *entry,
            run_dir,
            *_worker_args(job),
        ]


class Msrun(Launcher):
    """MindSpore's ``msrun``: one scheduler process plus the workers, all running the same command.

    msrun starts each process as ``python <args>`` from PATH (a local start puts this interpreter's
    bin first: :meth:`process_env`) and exports, per worker, ``RANK_ID`` (= node_rank x local workers +
    local index, given ``--node_rank``), ``DEVICE_ID`` (the local index), ``MS_WORKER_NUM`` and
    ``MS_ROLE=MS_WORKER``. The scheduler gets the same command with ``MS_ROLE=MS_SCHED`` and
    ``RANK_ID=0``, so ``parabench.worker`` serves the scheduler first (without touching rank 0's
    files) and trains only in workers.
    With ``--join=True`` msrun waits for all workers and exits non-zero if any worker fails
    (killing the others).
    """

    name = "msrun"
    # msrun kills its workers (each in a session of its own, so a signal to msrun's group misses them)
    # on SIGINT only; SIGTERM ends msrun alone (mindspore/parallel/cluster/process_entity/_api.py,
    # join_processes: signal.signal(SIGINT, ...) -> kill_all_processes)
    stop_signal = signal.SIGINT

    @staticmethod
    def _args(job: JobSpec, port: int) -> list[str]:
        la = job.launch
        return [
            f"--worker_num={la.world_size}",
            f"--local_worker_num={la.nproc_per_node}",
            f"--master_port={port}",
            "--join=True",
        ]

    @classmethod
    def command(
        cls, job: JobSpec, port: int, run_dir: str, python: str = sys.executable, entry: Sequence[str] = WORKER
    ) -> list[str]:
        la = job.launch
        port = port or unclaimed_port(la.master_addr)  # msrun's scheduler cannot bind port 0 itself
        msrun = os.path.join(os.path.dirname(python), "msrun")
        if not os.access(msrun, os.X_OK):
            msrun = which("msrun") or "msrun"
        return [
            msrun,
            *cls._args(job, port),
            f"--node_rank={la.node_rank}",
            f"--master_addr={la.master_addr}",
            f"--log_dir={os.path.join(run_dir, 'logs')}",
            "python",
            *entry,
            run_dir,
            *_worker_args(job),
        ]

    @classmethod
    def bundle_command(cls, job: JobSpec, port: int) -> str:
        la = job.launch
        return (
            "msrun "
            + " ".join(cls._args(job, port))
            + f' --node_rank="${{NODE_RANK:-{la.node_rank}}}" --master_addr="${{MASTER_ADDR:-{la.master_addr}}}"'
            + ' --log_dir="$RUN_DIR/logs" python -m parabench.worker "$RUN_DIR"'
            + _bundle_args(job)
        )

    @classmethod
    def process_env(
        cls, env: Mapping[str, str], here: Mapping[str, str], python: str = sys.executable
    ) -> dict[str, str]:
        # msrun starts `python ...` found on PATH: this interpreter's bin first, so the workers run in
        # the runner's environment (a venv need not be activated).
        out = {**without_secrets(here), **env}
        bin_dir, path = os.path.dirname(python), out.get("PATH", "")
        if path.split(os.pathsep)[0] != bin_dir:
            out["PATH"] = os.pathsep.join([bin_dir, path]) if path else bin_dir
        return out

    @staticmethod
    def coords() -> tuple[int, int, int]:
        env = os.environ
        return int(env.get("RANK_ID", 0)), int(env.get("DEVICE_ID", 0)), int(env.get("MS_WORKER_NUM", 1))


LAUNCHERS: dict[str, type[Launcher]] = {Torchrun.name: Torchrun, Msrun.name: Msrun}


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list ("gpu[01-03,07],cpu5") -> host names (scontrol's expansion, for
    the common forms)."""
    hosts: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", nodelist):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not hi:
                hosts.append(prefix + lo)
                continue
            hosts += [prefix + str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]
    return hosts


def slurm_node_address(node: str) -> str:
    """How the other nodes reach ``node``: Slurm's NodeAddr (``scontrol show node``; it defaults to
    the node name, and differs where names do not resolve, e.g. several slurmd on one host;
    docs/sources.md#slurm)."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return node
    proc = subprocess.run([scontrol, "show", "node", "-o", node], capture_output=True, text=True, timeout=60)
    found = re.search(r"\bNodeAddr=(\S+)", proc.stdout)
    return found.group(1) if proc.returncode == 0 and found else node


def slurm_placement(env: dict[str, str]) -> dict[str, object]:
    """launcher.* values for one node of a Slurm allocation with one task per node (the node
    runs torchrun for its local ranks): nnodes, node_rank, master_addr (the first host's address)."""
    missing = [k for k in ("SLURM_NNODES", "SLURM_NODEID", "SLURM_JOB_NODELIST") if k not in env]
    if missing:
        raise RuntimeError(f"launcher.slurm=true but this is not a Slurm job step ({', '.join(missing)} unset)")
    first = expand_nodelist(env["SLURM_JOB_NODELIST"])[0]
    return {
        "nnodes": int(env["SLURM_NNODES"]),
        "node_rank": int(env["SLURM_NODEID"]),
        "master_addr": slurm_node_address(first) if "SLURM_JOB_ID" in env else first,
    }


def get_launcher(name: str) -> type[Launcher]:
    return LAUNCHERS[name]


def which(tool: str) -> str | None:
    """A launcher tool next to this interpreter first (a venv's bin need not be on PATH)."""
    beside = os.path.join(os.path.dirname(sys.executable), tool)
    return beside if os.access(beside, os.X_OK) else shutil.which(tool)


# --------------------------------------------------------------------------------------------
# Starting, watching and stopping the workers: the one launcher of every command.
# --------------------------------------------------------------------------------------------
POLL_S = 0.2
TAIL_LINES = 25
KILL_GRACE_S = 10.0  # after the launcher's stop signal, before SIGKILL to its group


def launch_env(job: JobSpec) -> dict[str, str]:
    """Environment the workers get on top of the caller's (logged, secrets excluded)."""
    env = {
        "PYTHONUNBUFFERED": "1",
        # torch_npu without CANN breaks `import torch` (and torchrun) unless autoload is off;
        # the NPU worker imports torch_npu explicitly (docs/sources.md#device-backend-autoload).
        **AUTOLOAD_ENV,
    }
    env.update(DEVICES[job.device.type].launch_env(job.launch.nproc_per_node, job.device.threads_per_rank))
    env.update(job.backend.adapter.launch_env(job))
    return env


@dataclass(frozen=True)
class Launch:
    """What a command launches: :func:`supervise` starts, watches and stops it."""

    launcher: type[Launcher]  # torchrun or msrun: its environment, name and stop signal
    command: tuple[str, ...]
    env: Mapping[str, str]  # the workers' environment on top of this shell's (Launcher.process_env)
    run_dir: Path  # command.txt and logs/launcher.log are written here
    # the watchdog: with ``poll``, no step finished for setup_timeout_s until step 1 (imports, JIT
    # builds, the first step), then for hang_timeout_s between steps; without, the whole launch
    # ends within setup_timeout_s. Either way the workers are killed and the reason returned.
    setup_timeout_s: float
    hang_timeout_s: float
    # the command's own work every POLL_S (a progress bar, live metrics): returns rank 0's newest
    # finished step, or None when it has no news
    poll: Callable[[], int | None] | None = None
    # SIGINT/SIGTERM while the workers run: a graceful stop (e.g. ask them for a last checkpoint)
    # before the kill; returns how long to give them to exit on their own
    on_stop: Callable[[], float] | None = None

    @classmethod
    def of(
        cls,
        job: JobSpec,
        run_dir: Path,
        *,
        entry: Sequence[str] = WORKER,
        env: Mapping[str, str] | None = None,
        port: int | None = None,
        poll: Callable[[], int | None] | None = None,
        on_stop: Callable[[], float] | None = None,
    ) -> Launch:
        """``job``'s workers (``entry``: the per-rank module) through its backend's launcher; ``env``
        defaults to :func:`launch_env`, ``port`` to launcher.master_port (0: the launcher takes one)."""
        launcher = get_launcher(job.backend.adapter.capabilities.launcher).for_job(job)
        port = job.launch.master_port if port is None else port
        command = tuple(launcher.command(job, port, str(run_dir), entry=entry))
        env = launch_env(job) if env is None else env
        la = job.launch
        return cls(launcher, command, env, run_dir, la.setup_timeout_s, la.hang_timeout_s, poll, on_stop)

    @classmethod
    def program(cls, command: Sequence[str], run_dir: Path, timeout_s: float = math.inf) -> Launch:
        """One tool process (:class:`Program`) under ``run_dir`` (command.txt, logs/launcher.log),
        killed after ``timeout_s`` (default: no limit; a stop signal ends it either way)."""
        return cls(Program, tuple(command), {}, run_dir, timeout_s, timeout_s)


class StopSignals:
    """SIGINT and SIGTERM (scancel, a time limit) while the workers run, recorded by the handler and
    raised by the watch loop between its polls: an exception raised from inside the handler lands
    wherever the main thread is, e.g. amid the live MLflow write, and left the store unable to take
    the run's final status (it stayed RUNNING). A second signal acts at once (default handlers)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._record)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _record(self, signum: int, _frame: FrameType | None) -> None:
        self.received = signum
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def raise_if_received(self) -> None:
        if self.received is not None:
            raise Interrupted(self.received)


def supervise(launch: Launch) -> tuple[int, str]:
    """Start the launcher in a process group of its own that never outlives this process, watch it
    until it exits, and return (exit code, reason): the watchdog's, or the failure's; "" when it
    succeeded. SIGINT/SIGTERM (raised as :class:`parabench.errors.Interrupted`) stop the workers
    (``on_stop``, then the kill) and propagate to the command."""
    logs = launch.run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    (launch.run_dir / "command.txt").write_text(shlex.join(launch.command) + "\n")
    first = launch.launcher.stop_signal
    with StopSignals() as stop_signals:  # before the start: a signal during it is acted on too
        with open(logs / "launcher.log", "w") as log:
            proc = subprocess.Popen(
                launch.command,
                env=launch.launcher.process_env(launch.env, os.environ),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # the group the kill reaches: the launcher and its workers
                preexec_fn=die_with_parent(first),  # the launcher and its workers never outlive bench
            )
        try:
            reason = _watch(launch, proc, stop_signals)
        except KeyboardInterrupt:
            stop(proc, first, launch.on_stop)
            raise
        finally:
            if running(proc):  # the command's own poll failed: no worker outlives it
                kill(proc, first)
    if proc.returncode is None:  # exited, not reaped: its pid still holds the group id
        end_group(proc)
    end_rank_groups(launch.run_dir, _ticks_now())
    rc = proc.wait()
    if rc != 0 and not reason:
        reason = f"a worker failed ({launch.launcher.name} exit code {rc})"
    return rc, reason


def _watch(launch: Launch, proc: subprocess.Popen[bytes], stop_signals: StopSignals) -> str:
    """Poll the workers until they exit: the command's own poll, the setup/hang watchdog (kills the
    group and returns why), a stop signal (raised here, between polls). Returns "" or the kill reason."""
    last_change, last_step = time.monotonic(), -1
    while running(proc):
        time.sleep(POLL_S)
        stop_signals.raise_if_received()
        step = launch.poll() if launch.poll is not None else None
        stop_signals.raise_if_received()
        if step is not None and step != last_step:
            last_step, last_change = step, time.monotonic()
        reason = _overdue(launch, last_step, time.monotonic() - last_change)
        if reason:
            kill(proc, launch.launcher.stop_signal)
            return reason
    return ""


def running(proc: subprocess.Popen[bytes]) -> bool:
    """Whether the launcher runs. One that has exited is left unreaped (a zombie), so that no other
    process can take its pid, the id of its process group, before :func:`end_group` has run."""
    if proc.returncode is not None:  # reaped already (a kill waits for it)
        return False
    return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None


def end_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL to whatever is left in the process group of a launcher that has exited (call it before
    the launcher is reaped): a process its ranks' side started in the launcher's group and left behind.
    It does not reach what a rank leaves in the rank's own group: torchrun starts each worker as a group
    leader, so Megatron's asynchronous-checkpoint process (multiprocessing spawn) and its resource
    tracker, orphaned when a fault SIGKILLs their rank: :func:`end_rank_groups` ends those."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # nothing left of the group
        pass


def _ticks_now() -> int:
    """Now, in the clock ticks since boot that /proc/PID/stat gives start times in (proc(5))."""
    return int(float(Path("/proc/uptime").read_text().split()[0]) * os.sysconf("SC_CLK_TCK"))


def end_rank_groups(run_dir: Path, before_ticks: int) -> None:
    """SIGKILL what the ranks left in their own process groups (torchrun starts each worker as a group
    leader; ``run_dir/pids/incarnations`` holds every pid they had, a restarted rank's earlier ones
    too: :func:`record_pid`): Megatron's asynchronous-checkpoint process and its multiprocessing
    resource tracker, orphaned when a fault SIGKILLs their rank, were found alive at
    270 MiB each long after the run. Only processes started before ``before_ticks`` (the launcher's
    exit): a group id is free for reuse once its group is empty. Linux only (/proc)."""
    every = run_dir / "pids" / "incarnations"
    leaders = {int(t) for t in (every.read_text().split() if every.is_file() else []) if t.isdigit()}
    if not leaders:
        return
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():  # self, thread-self, and what is not a process
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        group, started = int(fields[2]), int(fields[19])  # proc(5): pgrp (5th), starttime (22nd)
        if group in leaders and started <= before_ticks:
            try:
                os.kill(int(entry.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _overdue(launch: Launch, last_step: int, quiet_s: float) -> str:
    """Why the watchdog kills the workers now ("" while they are within their limit): ``quiet_s``
    without a new step, before step 1 (setup: imports, JIT builds) or after it (a hang)."""
    if launch.poll is None:  # no steps reported: the launch as a whole
        limit = launch.setup_timeout_s
        return f"not finished after {limit:.0f} s (launcher.setup_timeout_s): killed" if quiet_s > limit else ""
    limit, key = (
        (launch.setup_timeout_s, "setup_timeout_s") if last_step < 1 else (launch.hang_timeout_s, "hang_timeout_s")
    )
    return f"no step finished for {limit:.0f} s (launcher.{key}): killed" if quiet_s > limit else ""


def stop(proc: subprocess.Popen[bytes], first: int, on_stop: Callable[[], float] | None = None) -> None:
    """Stop the workers of a signalled command: ``on_stop`` first while they run (its grace period to
    exit on their own), then :func:`kill`."""
    if on_stop is not None and proc.poll() is None:
        grace = on_stop()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    kill(proc, first)


def kill(proc: subprocess.Popen[bytes], first: int = signal.SIGTERM) -> None:
    """``first`` (the launcher's stop_signal) to the launcher's process group, SIGKILL KILL_GRACE_S later."""
    for sig, wait in ((first, KILL_GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def tail(path: Path, n: int = TAIL_LINES) -> str:
    """The last ``n`` lines of a log."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:])


def log_tails(logs: Path) -> str:
    """The last lines of every log of a launch (ranks, the launcher, msrun's scheduler and workers)."""
    return "\n".join(f"---- last lines of {log} ----\n{tail(log)}" for log in sorted(logs.glob("*.log")))
