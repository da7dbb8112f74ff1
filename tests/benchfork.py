"""A fork server for the tests' `bench` commands: the interpreter start-up and imports once per test
worker instead of once per command.

A `bench run` parent used 3.3-3.8 of a 2-rank, 2-step run's 7.4 CPU-seconds on the 2-core machine
(2026-12-08, `getrusage(RUSAGE_SELF)` at exit), nearly all of it importing Hydra, MLflow with its
SQLAlchemy store, pandas, pyarrow and SciPy (~2,400 modules); the full tier starts a few hundred
such commands. The server imports those once; each command is a fork of it.

    python tests/benchfork.py serve SOCKET         the server (one per pytest process)
    python -S tests/benchfork.py run SOCKET -m parabench ARGS...
                                                   one command: a client that stays a real child of
                                                   the test (its exit status, timeouts, the tier guard
                                                   and `ps` see it as `-m parabench ARGS`)

The client sends its arguments, directory, environment and standard streams (SCM_RIGHTS) to the
server. The server forks a handler, which forks the command with those streams, directory and
environment, `sys.path[0]` as `python -m` sets it, fresh `sys.std*` objects and default signal
handlers, and runs `parabench` as `__main__`; the command ends as an interpreter does (non-daemon
threads joined, atexit handlers run, streams flushed). The handler returns the command's pid (the
client forwards SIGTERM, SIGINT, SIGHUP, SIGUSR1/2 to it) and its exit status (the client exits with
the same code or dies of the same signal); a client that dies first (a test's timeout kills it)
takes the command with it (SIGKILL, as the timeout would have).

The client runs the command in a fresh interpreter instead (`os.execv`, the same as without the
server) when the server is not up yet or has gone, when the server holds more than one thread (a
fork would lose them), and when the environment differs from the server's in a variable the
interpreter reads at start-up (PYTHON*, LD_*), which a fork cannot apply.
"""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
STARTUP_PREFIXES = ("PYTHON", "LD_")  # read by the interpreter or the loader before any code runs
# What a `bench run` parent imports (its sys.modules at exit, 2026-12-08), by their top packages.
PRELOAD = (
    "parabench.cli", "parabench.run.command", "parabench.run.sweep", "parabench.tracking.runs",
    "parabench.tracking.store", "parabench.jobs", "parabench.launchers", "parabench.resilience.checkpoint",
    "hydra", "omegaconf", "mlflow", "mlflow.tracking", "mlflow.store.tracking.sqlalchemy_store",
    "sqlalchemy", "alembic", "pandas", "pyarrow", "scipy.stats",
)  # fmt: skip
# Threads a fork would lose: numpy's OpenBLAS pool and pyarrow's jemalloc background thread.
SERVER_ENV = {"OPENBLAS_NUM_THREADS": "1", "JE_ARROW_MALLOC_CONF": "background_thread:false"}


def startup_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(STARTUP_PREFIXES)}


def one_thread() -> bool:
    return len(os.listdir("/proc/self/task")) == 1


# ---------------------------------------------------------------- client
def client(sock_path: str, module_argv: list[str]) -> None:
    """``module_argv`` is ``-m parabench ARGS``: run it through the server, or in a fresh interpreter."""
    direct = [sys.executable, *module_argv]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(sock_path)
    except OSError:  # not listening yet, or gone
        os.execv(sys.executable, direct)
    request = {"argv": module_argv[2:], "cwd": os.getcwd(), "env": dict(os.environ)}
    data = json.dumps(request).encode()
    fds = array.array("i", [0, 1, 2])
    conn.sendmsg([len(data).to_bytes(8, "big"), data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
    replies = conn.makefile("r")
    first = replies.readline().split()
    if len(first) != 2 or first[0] != "pid" or not first[1].isdigit():  # "nofork", or the server died
        conn.close()
        os.execv(sys.executable, direct)
    pid = int(first[1])
    for sig in FORWARDED:
        signal.signal(sig, lambda s, _frame: os.kill(pid, s))
    how, value = (replies.readline().split() or ["exit", "1"])[:2]
    if how == "signal":
        signal.signal(int(value), signal.SIG_DFL)
        os.kill(os.getpid(), int(value))
    sys.exit(int(value))


# ---------------------------------------------------------------- server
def serve(sock_path: str) -> None:
    """Import, then fork a handler per connection; dies with the test process that started it."""
    import ctypes
    import importlib

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    for name in PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    staging = f"{sock_path}.{os.getpid()}"
    listener.bind(staging)
    listener.listen(64)
    os.rename(staging, sock_path)  # clients connect only once everything is imported
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # handlers reap themselves
    server_env = startup_env(dict(os.environ))
    while True:
        conn, _ = listener.accept()
        if not one_thread():
            conn.sendall(b"nofork\n")
        elif os.fork() == 0:
            listener.close()
            os._exit(handle(conn, server_env))
        conn.close()


def receive(conn: socket.socket) -> tuple[dict, list[int]]:
    fds = array.array("i")
    head, ancillary, _flags, _addr = conn.recvmsg(8, socket.CMSG_SPACE(3 * fds.itemsize))
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    size, data = int.from_bytes(head, "big"), b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the client went away mid-request")
        data += chunk
    return json.loads(data), list(fds)


def handle(conn: socket.socket, server_env: dict[str, str]) -> int:
    """The handler: fork the command, tell the client its pid, then its exit status."""
    import threading

    request, fds = receive(conn)
    if len(fds) != 3 or startup_env(request["env"]) != server_env:
        conn.sendall(b"nofork\n")
        return 0
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        conn.close()
        run_command(request, fds)
    for fd in fds:
        os.close(fd)
    conn.sendall(f"pid {pid}\n".encode())

    def kill_when_client_goes() -> None:
        while conn.recv(1):  # the client sends nothing more: b"" is its end
            pass
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    threading.Thread(target=kill_when_client_goes, daemon=True).start()
    _, status = os.waitpid(pid, 0)
    how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"
    try:
        conn.sendall(f"{how}\n".encode())
    except OSError:  # the client has gone
        pass
    return 0


def run_command(request: dict, fds: list[int]) -> None:
    """In the forked command: become `python -m parabench ARGS` in the client's place, run, exit."""
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = os.getcwd()  # what `python -m` puts first
    sys.stdin = sys.__stdin__ = os.fdopen(0, "r", closefd=False)
    sys.stdout = sys.__stdout__ = os.fdopen(1, "w", closefd=False)
    sys.stderr = sys.__stderr__ = os.fdopen(2, "w", buffering=1, errors="backslashreplace", closefd=False)
    sys.argv = ["-m", *request["argv"]]
    os._exit(run_as_main())


def run_as_main() -> int:
    """``runpy`` the package as ``__main__`` and end as the interpreter would; the exit code."""
    import atexit
    import runpy
    import threading

    interrupted = False
    try:
        runpy.run_module("parabench", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit_:
        code = exit_code(exit_.code)
    except KeyboardInterrupt:
        interrupted, code = True, 130
    except BaseException:  # printed as the interpreter prints it, then exit 1
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # join non-daemon threads, as at exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if interrupted:  # the interpreter ends a KeyboardInterrupt by dying of SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2])
    elif sys.argv[1:2] == ["run"]:
        client(sys.argv[2], sys.argv[3:])
    else:
        sys.exit("usage: benchfork.py serve SOCKET | run SOCKET -m parabench ARGS...")
