"""`bench run` through Slurm, for real: a two-node Slurm cluster from Debian's slurm-wlm on this host
(munged, slurmctld and one slurmd per node, all on 127.0.0.1), started by the fixture below.

Debian's slurmd is built without multiple-slurmd support, but two node names on one host still work
when each names its own port (docs/slurm.md). No accounting database: the submitting side watches
jobs through ``scontrol`` (parabench.run.slurm), not ``sacct``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_mlflow_auth_ui import (
    ADMIN_PASSWORD,
    PASSWORD,
    USER,
    _leaks,
    _recorded,
    _request,
    server_root,
    session_auth_server,
)

from conftest import FAST, REPO, assert_refused_before_launch, bench, mlflow_runs

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "sinfo", "squeue", "scontrol", "scancel")
NODES = ("pb1", "pb2")
# one job: 2 ranks of ddp on CPU, 2 steps, one intra-op thread each (the host has 2 cores)
SLURM_JOB = ["hydra/launcher=slurm_torchrun", "launcher.slurm=true", *FAST, "backend=ddp", "device=cpu"]
SMALL = ["run.steps=2", "device.threads_per_rank=1"]


def _tool(name: str) -> str | None:
    return shutil.which(name) or next((str(p) for p in (Path("/usr/sbin") / name,) if p.exists()), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slurm_conf(root: Path) -> str:
    host = socket.gethostname()
    ports = [_free_port() for _ in range(1 + len(NODES))]
    nodes = "\n".join(
        f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={p} CPUs=2 RealMemory=1000 State=UNKNOWN"
        for n, p in zip(NODES, ports[1:], strict=True)
    )
    return f"""ClusterName=parabench
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ports[0]}
SlurmdPort={ports[1]}
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
KillWait=30
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES State=UP
"""


def _wait_idle(env: dict[str, str], timeout: float = 60) -> None:
    deadline, out = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, env=env)
        out = proc.stdout + proc.stderr
        states = dict(line.split() for line in proc.stdout.splitlines() if len(line.split()) == 2)
        if all(states.get(n) == "idle" for n in NODES):
            return
        time.sleep(0.5)
    raise AssertionError(f"Slurm nodes not idle after {timeout:.0f} s: {out}")


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in reversed(procs):
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> dict[str, str]:
    """SLURM_CONF of a running two-node cluster (partition ``debug``); stopped after the module."""
    missing = [t for t in DAEMONS + CLIENTS if _tool(t) is None]
    if missing:
        pytest.skip(f"Slurm not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("the test cluster runs slurmd as root (it starts jobs as their user)")
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("munge", "state", "spool", "log"):
        (root / sub).mkdir(mode=0o700)
    conf = root / "slurm.conf"
    conf.write_text(_slurm_conf(root))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    key = root / "munge" / "munge.key"
    subprocess.run([_tool("mungekey"), "--create", f"--keyfile={key}"], check=True, capture_output=True)
    logs = open(root / "log" / "daemons.log", "ab")  # closed at teardown
    munge = [f"--socket={root}/munge/socket", f"--key-file={key}", f"--pid-file={root}/munge/pid"]
    munge += [f"--log-file={root}/log/munged.log", f"--seed-file={root}/munge/seed"]
    commands = [[_tool("munged"), "-F", "--force", *munge], [_tool("slurmctld"), "-D", "-i", "-f", str(conf)]]
    commands += [[_tool("slurmd"), "-D", "-N", n, "-f", str(conf)] for n in NODES]
    procs: list[subprocess.Popen] = []
    try:
        for cmd in commands:
            procs.append(subprocess.Popen(cmd, env=env, stdout=logs, stderr=logs, stdin=subprocess.DEVNULL))
            time.sleep(1.0)  # munged's socket before slurmctld, slurmctld before the nodes register
        _wait_idle(env)
        yield env
    finally:
        ids = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, env=env).stdout.split()
        if ids:
            subprocess.run(["scancel", *ids], capture_output=True, env=env)
            time.sleep(2)
        _stop(procs)
        logs.close()


@pytest.fixture(scope="module")
def auth_server(request, tmp_path_factory):
    """MLflow's basic-auth server for a job given a login: the session's, shared with
    tests/test_mlflow_auth_ui.py (the experiment here, slurm, is this module's own)."""
    return session_auth_server(request.config, tmp_path_factory)


def _job_ids(stdout: str) -> list[str]:
    found = re.search(r"Slurm job\(s\) ([\w, ]+);", stdout)
    assert found, stdout
    return found.group(1).split(", ")


def _slurm_state(job_id: str, env: dict[str, str], settle_s: float = 120) -> str:
    """The job's final state. The result reaches bench before Slurm ends the job (its processes and
    epilog are still being reaped: RUNNING, then COMPLETING; a CI run under load read COMPLETING), so
    the state is read until it leaves those two or ``settle_s`` passes."""
    deadline = time.monotonic() + settle_s
    while True:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, env=env).stdout
        state = re.search(r"JobState=(\S+)", out).group(1)
        if state not in ("RUNNING", "COMPLETING") or time.monotonic() > deadline:
            return state
        time.sleep(0.5)


@pytest.mark.full
def test_sweep_of_two_jobs_runs_on_slurm_as_parent_and_children(slurm, results):
    """`bench run -m` submits one array job; each job runs its 2 ddp ranks in Slurm, FINISHED runs
    under one FINISHED sweep run."""
    proc = bench(["run", "-m", *SLURM_JOB, "launcher.nproc_per_node=2", *SMALL, "run.seed=1,2"], results, 400, slurm)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    jobs = _job_ids(proc.stdout)
    assert len(jobs) == 2 and all(_slurm_state(j, slurm) == "COMPLETED" for j in jobs), jobs
    runs = mlflow_runs(results)
    sweep = runs[runs["tags.parabench.kind"] == "sweep"]
    children = runs[runs["tags.parabench.kind"] == "job"]
    assert len(sweep) == 1 and sweep["status"].iloc[0] == "FINISHED"
    assert sorted(children["params.run.seed"]) == ["1", "2"]
    assert (children["status"] == "FINISHED").all() and (children["tags.world_size"] == "2").all()
    assert (children["tags.mlflow.parentRunId"] == sweep["run_id"].iloc[0]).all()
    assert sorted(children["params.launcher.slurm"]) == ["True", "True"]


@pytest.mark.e2e
def test_two_nodes_one_rank_each(slurm, results):
    """launcher.nnodes=2: one Slurm task per node; node 1 takes its rank and node 0's address
    (NodeAddr) from the allocation; one MLflow run (node 0 records) with both ranks. Submitted from
    outside the repository, as an installed parabench is (the launcher is not found by Hydra's scan)."""
    args = ["run", *SLURM_JOB, "launcher.nnodes=2", "launcher.nproc_per_node=1", *SMALL]
    proc = bench([*args, f"launcher.master_port={_free_port()}"], results, 400, slurm, cwd=results.parent)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (job,) = _job_ids(proc.stdout)
    assert _slurm_state(job, slurm) == "COMPLETED"
    runs = mlflow_runs(results)
    child = runs[runs["tags.parabench.kind"] == "job"]
    assert len(child) == 1 and child["status"].iloc[0] == "FINISHED"
    assert child["params.launcher.nnodes"].iloc[0] == "2" and child["tags.world_size"].iloc[0] == "2"
    ranks = sorted(p.name for p in results.glob("runs/*/*/0_*/ranks/rank*.json"))
    assert ranks == ["rank0.json", "rank1.json"]


@pytest.mark.full
def test_login_in_the_tracking_uri_reaches_the_node_and_nothing_written(
    slurm, auth_server, results, tmp_path, tmp_path_factory, monkeypatch
):
    """Issue 33 item 3: a Slurm job given the login in ``tracking.uri`` records as alice on MLflow's
    basic-auth server - the login travels in MLflow's variables, which sbatch exports to the job
    (the node's run would be refused without them) - and the password is in nothing bench submits or
    the job writes (submitit's pickles and logs, Hydra's files, the run directory), nothing printed,
    nothing recorded, and nothing in the server's store."""
    uri = f"http://{USER}:{PASSWORD}@{auth_server.removeprefix('http://')}"
    args = ["run", *SLURM_JOB, "launcher.nproc_per_node=1", *SMALL, f"tracking.uri={uri}", "tracking.experiment=slurm"]
    proc = bench(args, results, 400, slurm, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "spooled" not in proc.stdout + proc.stderr and PASSWORD not in proc.stdout + proc.stderr
    (job,) = _job_ids(proc.stdout)
    assert _slurm_state(job, slurm) == "COMPLETED"
    runs, recorded = _recorded(auth_server, "slurm", tmp_path / "downloaded", monkeypatch)
    kinds = sorted((r.data.tags.get("parabench.kind"), r.info.status) for r in runs)
    assert kinds == [("job", "FINISHED"), ("sweep", "FINISHED")], kinds  # the node recorded its run
    query = f"username={USER}&resource_type=experiment&resource_id={runs[0].info.experiment_id}"
    grant = _request(f"{auth_server}/api/3.0/mlflow/users/permissions/get?{query}", "admin", ADMIN_PASSWORD)
    assert grant["permission"] == "MANAGE", grant  # alice created the experiment: the login was used
    assert not [t for t in [*recorded, *(r.info.run_name for r in runs)] if PASSWORD in t]
    assert list(results.rglob("*_submitted.pkl")) and list(results.rglob("*_log.out"))
    for root in (tmp_path, server_root(tmp_path_factory, auth_server)):
        assert not _leaks(root, PASSWORD), f"password written to {_leaks(root, PASSWORD)}"


def _wait_for_steps(results: Path, proc: subprocess.Popen, jobs: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(1 for p in results.glob("runs/*/*/*_*/steps.jsonl") if p.stat().st_size) >= jobs:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.5)
    raise AssertionError(f"no step finished in every job within {timeout:.0f} s")


def _kill_on_node(raw_job_id: str, node: str, env: dict[str, str]) -> None:
    """SIGKILL every process of a job on its node at once, as when the node dies (``scontrol listpids``
    lists what the node's slurmd tracks for the job: the batch script, srun, the step's processes)."""
    out = subprocess.run(["scontrol", "listpids", raw_job_id, node], capture_output=True, text=True, env=env)
    pids = [int(line.split()[0]) for line in out.stdout.splitlines()[1:] if line.split()]
    assert pids, out.stdout + out.stderr
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.full
def test_scancel_and_a_killed_job_end_failed_with_the_reason(slurm, results):
    """A sweep of two jobs; once both train, job 0 is cancelled (scancel: SIGTERM, as at the time
    limit) and every process of job 1 gets SIGKILL (as on a node that dies: no result file). Both MLflow
    runs end FAILED with the reason (job 0 with its steps so far), the sweep run FAILED, nothing stays
    RUNNING; bench exits 1 with one line per failed job."""
    cmd = [sys.executable, "-m", "parabench", "run", "-m", *SLURM_JOB, "launcher.nproc_per_node=2"]
    cmd += ["run.steps=500", "device.threads_per_rank=1", "run.seed=1,2", f"run.results_dir={results}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=slurm, cwd=REPO)
    try:
        _wait_for_steps(results, proc, jobs=2)
        queue = subprocess.run(["squeue", "-h", "-o", "%i %A %N"], capture_output=True, text=True, env=slurm)
        tasks = {i: (raw, node) for i, raw, node in (line.split() for line in queue.stdout.splitlines())}
        job = next(iter(tasks)).split("_")[0]
        assert sorted(tasks) == [f"{job}_0", f"{job}_1"], tasks
        subprocess.run(["scancel", f"{job}_0"], check=True, env=slurm)
        _kill_on_node(*tasks[f"{job}_1"], slurm)  # scancel --signal=KILL would send SIGTERM first
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out[-2000:] + err[-3000:]
    assert "Traceback" not in err
    assert f"0: Slurm job {job}_0: interrupted by SIGTERM" in err, err
    assert re.search(rf"1: Slurm job {job}_1: ended \w+ \(reason .*\) without a result; see ", err), err
    runs = mlflow_runs(results)
    assert "RUNNING" not in set(runs["status"])
    children = runs[runs["tags.parabench.kind"] == "job"].set_index("tags.job_num")
    assert list(children.loc[["0", "1"], "status"]) == ["FAILED", "FAILED"]
    assert f"Slurm job {job}_0 ended by SIGTERM (scancel" in children.loc["0", "tags.failure_reason"]
    assert int(children.loc["0", "tags.interrupted_after_step"]) >= 1
    assert "without a result" in children.loc["1", "tags.failure_reason"]
    assert runs[runs["tags.parabench.kind"] == "sweep"]["status"].iloc[0] == "FAILED"


def test_sbatch_missing_is_refused_before_launch(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # no Slurm commands
    err = assert_refused_before_launch([*SLURM_JOB, "launcher.nproc_per_node=2"], "sbatch", tmp_path, capsys)
    assert "not on PATH" in err


@pytest.mark.e2e
def test_unknown_partition_is_refused_before_launch(slurm, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLURM_CONF", slurm["SLURM_CONF"])
    args = [*SLURM_JOB, "launcher.nproc_per_node=2", "hydra.launcher.partition=nosuch"]
    err = assert_refused_before_launch(args, "hydra.launcher.partition=nosuch", tmp_path, capsys)
    assert "no such Slurm partition (sinfo lists: debug)" in err


@pytest.mark.e2e
def test_submitting_without_launcher_slurm_is_refused(slurm, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLURM_CONF", slurm["SLURM_CONF"])
    args = [a for a in SLURM_JOB if a != "launcher.slurm=true"]
    assert_refused_before_launch(args, "launcher.slurm=true", tmp_path, capsys)


def test_without_the_slurm_extra_hydra_is_quiet_and_the_launcher_names_the_extra():
    """A plain install (no hydra-submitit-launcher): Hydra's plugin scan imports hydra_plugins.parabench_slurm
    at every start; it must import cleanly (no "Error importing" warning on every bench run) and the
    launcher must refuse with the extra to install."""
    code = """
import sys, warnings
sys.modules["hydra_plugins.hydra_submitit_launcher"] = None  # as if the slurm extra were not installed
warnings.simplefilter("error")
from hydra_plugins.parabench_slurm import NEEDS_EXTRA, SlurmLauncher
from parabench.errors import UserError
try:
    SlurmLauncher()
except UserError as exc:
    print(exc)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "pip install 'parabench[slurm]'" in out.stdout and "Error importing" not in out.stderr


def test_a_job_queued_under_the_callbacks_former_name_still_unpickles():
    """submitit pickles the launcher with Hydra's instantiated callbacks (hydra_context.callbacks): a
    job queued by a parabench whose sweep callback was ``parabench.sweep.MultirunCallback`` unpickles
    it by that name when it starts, after the callback moved to parabench.run.sweep."""
    import pickle

    from parabench.run.sweep import MultirunCallback

    queued = pickle.dumps(MultirunCallback(), protocol=2).replace(b"cparabench.run.sweep\n", b"cparabench.sweep\n")
    assert b"parabench.run" not in queued
    assert type(pickle.loads(queued)) is MultirunCallback
