"""Shared helpers: run the real `bench` CLI in a subprocess against a temporary results dir; the two
test tiers and the rules that keep them honest (see "Test tiers" below)."""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import benchfork
import pytest
import run_matrix
from schedule import longest_modules_first, measured_seconds
from tiers import CURRENT_ITEM, TIER_MARKERS, install_process_guard, promote_ci_skips, uninstall_process_guard

pytest_plugins = ["pytester"]  # tests/test_tiers.py runs small test projects

REPO = Path(__file__).resolve().parents[1]
BENCHFORK = Path(__file__).with_name("benchfork.py")

# The suite runs two test workers on a machine of two cores, each starting ranks, so a rank's second
# OpenMP thread (a 1-rank run's, a worker's in-process torch) often waits for a core the other
# worker holds. libgomp's default waiting spins (OMP_WAIT_POLICY, the OpenMP specification's section
# on environment variables; GCC's libgomp manual, "OMP_WAIT_POLICY"): a 1-rank 20-step run beside one
# busy process took 35 CPU-s spinning, 14 with PASSIVE (2026-12-07). Set for this process before
# anything loads libgomp, and inherited by every process the tests start; bench itself leaves it to
# the user.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Small, fast geometry for end-to-end tests: the llama model with a 2,048-token vocabulary (VOCAB) and
# shorter sequences. The 32k vocabulary's embedding and output layers are 85% of llama's parameters,
# of every checkpoint and gradient all-reduce, and ~80% of a step on this CPU (0.43 s -> 0.08 s a step
# on 2 ranks); what the tests check (parity, formulas, resume, recovery) does not depend on them.
VOCAB = 2048
FAST = ["+model=llama", f"model.vocab_size={VOCAB}", "data.seq_len=64", "run.warmup_steps=0"]


# The conversion tests' model: smaller than FAST's, so a conversion's gathers and files stay small.
TINY = [
    "model.vocab_size=512",
    "model.hidden_size=64",
    "model.intermediate_size=128",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=4",
    "model.num_key_value_heads=2",
    "launcher.nproc_per_node=2",
    "tracking.enabled=false",
]


# The environment of the tests' `mlflow server`: MLflow 3's server also starts, unless told not to, a job
# runner and seven huey consumers (MLFLOW_SERVER_ENABLE_JOB_EXECUTION, for its GenAI jobs and trace
# roll-ups), eight more processes importing MLflow and then polling for as long as the server lives;
# parabench records runs, metrics and artifacts only and never submits a job.
MLFLOW_SERVER_ENV = {"MLFLOW_DISABLE_TELEMETRY": "true", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: it only waits for its parent to read its exit)."""
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def alive_with(text: str) -> list[int]:
    """Pids of the live processes (not this one) whose command line holds ``text``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # not a process, or gone meanwhile
            continue
        if text in cmdline and alive(int(proc.name)) and int(proc.name) != os.getpid():
            found.append(int(proc.name))
    return found


def assert_trains_like_the_canonical_model(engine, job, steps: int = 3) -> None:
    """An in-process engine starts from the canonical weights, and its first ``steps`` losses equal
    the canonical torch model's under AdamW and clipping on the same batches (relative 1e-5: fp32
    rounding of a different kernel order)."""
    import math

    import torch

    from parabench.adapters.torch_common import make_adamw
    from parabench.data import TokenSource
    from parabench.model import build_llama, canonical_weights, training_loss, weights_checksum

    assert weights_checksum(engine.full_state_dict()) == weights_checksum(canonical_weights(job.model, job.run.seed))
    ref = build_llama(job.model, seed=job.run.seed)
    opt = make_adamw(list(ref.named_parameters()), job.optim)
    source = TokenSource(job.data, job.model.vocab_size)
    for step in range(steps):
        batches = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in source.rank_micro_batches(step, 0, 1)]
        got = float(engine.train_step(batches))
        want = 0.0
        for x, y in batches:
            loss = training_loss(ref, job.model, x, y) / len(batches)
            loss.backward()
            want += float(loss)
        torch.nn.utils.clip_grad_norm_(list(ref.parameters()), job.optim.grad_clip)
        opt.step()
        opt.zero_grad()
        assert math.isclose(got, want, rel_tol=1e-5), (step, got, want)


@functools.cache
def bench_fork_server() -> str | None:
    """The socket of this pytest process's `bench` fork server (tests/benchfork.py), started on first
    use; None when PARABENCH_TEST_FORK=0. Until it listens, clients start fresh interpreters."""
    if os.environ.get("PARABENCH_TEST_FORK", "1") == "0":
        return None
    where = Path(tempfile.mkdtemp(prefix="pbfork-"))  # short: a socket's path holds < 108 bytes
    env = {**os.environ, **benchfork.SERVER_ENV, "MLFLOW_DISABLE_TELEMETRY": "true"}
    with open(where / "server.log", "w") as log:
        subprocess.Popen(
            [sys.executable, str(BENCHFORK), "serve", str(where / "socket")],
            env=env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
        )  # fmt: skip
    return str(where / "socket")


def bench_argv(args: list[str], python_args: tuple[str, ...] = ()) -> list[str]:
    """The command line of ``python -m parabench ARGS``: through this process's fork server when it has
    one (not with ``python_args``, which only a fresh interpreter takes)."""
    server = None if python_args else bench_fork_server()
    front = [sys.executable, "-S", str(BENCHFORK), "run", server] if server else [sys.executable, *python_args]
    return [*front, "-m", "parabench", *args]


def bench(
    args: list[str],
    results: Path,
    timeout: float = 600,
    env: dict | None = None,
    cwd: Path | None = None,
    python_args: tuple[str, ...] = (),
):
    """``python -m parabench ARGS`` in a subprocess (a `run` writes under ``results``): a fork of the
    fork server when there is one, as a fresh interpreter otherwise (and with ``python_args``)."""
    cmd = bench_argv(args, python_args)
    if args and args[0] == "run":
        cmd.append(f"run.results_dir={results}")
    full_env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd or REPO)


# The resilience tests' job: 20 steps on 2 ranks (killed, hung, restarted and resumed variants of it).
TWENTY = [*FAST, "run.steps=20", "launcher.nproc_per_node=2"]


def only_summary(results: Path) -> dict:
    (path,) = results.glob("runs/*/*/*/summary.json")
    return json.loads(path.read_text())


def run_ok(args: list[str], results: Path, **kw) -> dict:
    """``bench run ARGS`` (one job) must exit 0; its summary.json."""
    proc = bench(["run", *args], results, **kw)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return only_summary(results)


def torchrun_script(script: str, args: list[str], env: dict[str, str], nproc: int = 2) -> None:
    """``torchrun --standalone --nproc-per-node NPROC tests/SCRIPT ARGS`` (the agent binds its own free
    port); fails the test with the output's tail unless every rank exits 0 (the framework-native
    checkpoint writers)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    proc = subprocess.run(
        [*cmd, str(REPO / "tests" / script), *args],
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def assert_refused_before_launch(args: list[str], must_name: str, tmp_path: Path, capsys) -> str:
    """``bench run ARGS`` (in-process, cwd = tmp_path) exits 2 with one `bench: error:` line naming
    ``must_name``, no traceback, and nothing written. Returns that line."""
    from parabench.cli import main

    results = tmp_path / "results"
    code = main(["run", *args, f"run.results_dir={results}"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("bench: error:") and must_name in err, err
    assert "Traceback" not in err
    assert not results.exists() and not (tmp_path / "mlflow.db").exists() and not (tmp_path / "outputs").exists()
    return err


def summaries(results: Path) -> dict[str, dict]:
    """run-dir name -> summary.json for every finished job under ``results``."""
    out = {}
    for p in sorted(results.glob("runs/*/*/*/summary.json")):
        out[p.parent.name] = json.loads(p.read_text())
    return out


# A citation of an entry of docs/sources.md, from code or data (`docs/sources.md#<anchor>`) or from a
# sibling doc (`sources.md#<anchor>`).
SOURCE_CITATION = re.compile(r"(?:docs/)?\bsources\.md#([\w-]+)")


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces -> '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def source_anchors() -> set[str]:
    """Every anchor of docs/sources.md (one per heading; a repeated slug would shadow an entry)."""
    headings = re.findall(r"^#{1,6} (.+)$", (REPO / "docs" / "sources.md").read_text(), flags=re.M)
    slugs = [github_slug(h) for h in headings]
    repeated = sorted({s for s in slugs if slugs.count(s) > 1})
    assert not repeated, f"docs/sources.md: headings with the same anchor: {repeated}"
    return set(slugs)


def mlflow_runs(results: Path, experiment: str = "parabench"):
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{results / 'mlflow.db'}")
    return mlflow.search_runs(experiment_names=[experiment])


@pytest.fixture
def results(tmp_path: Path) -> Path:
    return tmp_path / "results"


@pytest.fixture(scope="session")
def matrix(request, tmp_path_factory) -> dict[str, run_matrix.MatrixRun]:
    """The shared run matrix (tests/run_matrix.py): variant -> its run, for the variants the session's
    selected tests name with @pytest.mark.matrix. One `bench run -m` per shard, once per session: under
    pytest-xdist each shard is trained by the first worker to claim it, in the folder the workers'
    temporary folders share; a worker skips the shards another is training and trains the next
    unclaimed one, then waits for the rest (a lock per shard) and reads every shard from there."""
    shards = run_matrix.shards_needed(request.config.stash.get(run_matrix.NEEDED, set()))
    if "PYTEST_XDIST_WORKER" not in os.environ:
        root = tmp_path_factory.mktemp("matrix")
        return {v: run for shard in shards for v, run in _train_shard(shard, root).items()}
    shared = tmp_path_factory.getbasetemp().parent  # one per session, above each worker's own
    for shard in shards:  # train what nobody has claimed yet
        _shard_runs(shard, shared, wait=False)
    runs: dict[str, run_matrix.MatrixRun] = {}
    for shard in shards:  # then wait for the others' shards and read them
        runs.update(_shard_runs(shard, shared, wait=True) or {})
    return runs


def _shard_runs(shard, shared: Path, wait: bool) -> dict[str, run_matrix.MatrixRun] | None:
    """The shard's runs, trained here if no worker has done it; None when ``wait`` is false and another
    worker holds the shard's lock (it is training it)."""
    name = shard[0]
    index = shared / f"matrix-{name}.json"
    with open(shared / f"matrix-{name}.lock", "w") as lock:
        try:  # released when the file closes, also if training fails
            fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            return None
        if not index.exists():
            runs = _train_shard(shard, shared / "matrix")
            index.write_text(json.dumps({v: [str(r.run_dir), str(r.results)] for v, r in runs.items()}))
            return runs
    index_runs = json.loads(index.read_text()).items()
    return {
        variant: run_matrix.MatrixRun.read(Path(run_dir), Path(results)) for variant, (run_dir, results) in index_runs
    }


def _train_shard(shard: tuple[str, int, list[str]], root: Path) -> dict[str, run_matrix.MatrixRun]:
    name, world, chosen = shard
    results = root / name
    results.mkdir(parents=True)
    args = [*FAST, f"run.steps={run_matrix.STEPS}", f"launcher.nproc_per_node={world}"]
    backends = ",".join({**run_matrix.VARIANTS, **run_matrix.ONE_RANK}[v] for v in chosen)
    proc = bench(["run", "-m", *args, f"backend={backends}"], results, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    jobs = run_matrix.sweep_jobs(results)
    assert len(jobs) == len(chosen), [j.name for j in jobs]
    return {variant: run_matrix.MatrixRun.read(run_dir, results) for variant, run_dir in zip(chosen, jobs, strict=True)}


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory):
    """``shared_run(args)`` -> the summary of ``bench run ARGS`` (one job), trained once per session
    for every module that asks with the same arguments (the 20-step moe-tiny ddp reference of
    test_moe, test_moe_megatron and test_moe_deepspeed), under pytest-xdist by the first worker to
    ask, the other waiting on its lock. Readers must not write into its run directory."""
    shared = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        shared = shared.parent  # one per session, above each worker's own
    root = shared / "shared-runs"
    root.mkdir(exist_ok=True)

    def run(args: list[str], timeout: float = 900) -> dict:
        key = hashlib.sha256(json.dumps(args).encode()).hexdigest()[:16]
        results, done = root / key, root / f"{key}.done"
        with open(root / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if training fails
            if not done.exists():
                shutil.rmtree(results, ignore_errors=True)  # a failed try of another worker
                proc = bench(["run", *args], results, timeout=timeout)
                assert proc.returncode == 0, proc.stderr[-4000:]
                done.write_text(json.dumps(args))
        (summary,) = summaries(results).values()
        return summary

    return run


@pytest.fixture
def uninterrupted(matrix):
    """variant -> summary of its uninterrupted matrix run (the TWENTY job), the reference of every
    kill-and-resume, restart and hang test (the test names the variant with @pytest.mark.matrix)."""
    return lambda variant: matrix[variant].summary


# --------------------------------------------------------------------------------------------
# Test tiers (tests/tiers.py holds the rules). `./dev test` runs the default tier: every test without a
# tier marker (units, rules, the migrate suite) plus those marked `e2e` (end-to-end coverage of each
# backend and command). `./dev test --full` adds the tests marked `full`. A test that starts worker or
# server processes without a tier marker fails; under CI=true a skip fails unless it names hardware.
# --------------------------------------------------------------------------------------------
def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", help="run the full tier (tests marked `full` too)")


def pytest_configure(config):
    install_process_guard(config)


def pytest_unconfigure(config):
    uninstall_process_guard(config)


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--full"):
        kept = [item for item in items if item.get_closest_marker("full") is None]
        deselected = [item for item in items if item.get_closest_marker("full") is not None]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = kept
    config.stash[run_matrix.NEEDED] = run_matrix.needed_variants(items)  # what the selected tests read
    if os.environ.get("PYTEST_XDIST_WORKER"):  # whole modules to the workers, longest first
        items[:] = longest_modules_first(items, measured_seconds(), TIER_MARKERS)
    for item in items:
        # pytest-timeout's limit (pyproject) counts a test's fixtures too. A test that reads the run
        # matrix may train it (~21 jobs: 282 s on a quiet machine one test at a time, over 900 s with
        # two workers beside other jobs, when pytest-timeout ended the whole worker) or wait for the
        # worker that does: its limit counts its own call (the matrix's bench calls have their own).
        if "matrix" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(float(config.getini("timeout")), func_only=True))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item.config.stash[CURRENT_ITEM] = item  # the process guard's test, through setup and teardown
    yield
    item.config.stash[CURRENT_ITEM] = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    promote_ci_skips(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    promote_ci_skips(outcome.get_result())
