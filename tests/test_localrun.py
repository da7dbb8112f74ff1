"""parabench.localrun: the ranks of one node forked from one process that imported torch once.

Which launcher a job gets; that a forked rank sees torchrun's environment, has torch already and joins
the launcher's store; that the first failure stops the others and is summarised the way torchrun does
(the runner's failure line reads it); that SIGTERM stops every rank."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_resilience import job_of

from conftest import REPO, alive
from parabench.launchers import Launch, Localrun, Torchrun
from parabench.run.command import ROOT_CAUSE

# The entry module the tests run under the launcher: records what it sees, joins the process group,
# sums its rank over the world; MODE=fail makes rank 1 exit 3 while rank 0 waits; MODE=wait waits.
PROBE = """
import json, os, sys, time
preloaded = "torch" in sys.modules and "torch._dynamo" in sys.modules
import torch, torch.distributed as dist
out, mode = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
seen = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
        "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS")}
seen.update(preloaded=preloaded, argv=sys.argv[1:], name=__name__, ppid=os.getppid(), threads=torch.get_num_threads())
with open(os.path.join(out, f"pid{rank}.tmp"), "w") as f:  # renamed whole: the test reads it once it exists
    f.write(str(os.getpid()))
os.rename(os.path.join(out, f"pid{rank}.tmp"), os.path.join(out, f"pid{rank}"))
if mode == "fail" and rank == 1:
    sys.exit(3)
if mode in ("fail", "wait"):
    time.sleep(120)
dist.init_process_group("gloo")
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
seen["sum"] = total.item()
dist.destroy_process_group()
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(seen, f)
"""


def _launch(*overrides: str) -> Launch:
    return Launch.of(job_of("launcher.nproc_per_node=2", *overrides), Path("/r"), env={})


def test_one_node_without_restarts_forks_its_ranks_and_everything_else_goes_through_torchrun():
    assert _launch().launcher is Localrun
    for other in (
        "launcher.start=torchrun",
        "launcher.max_restarts=1",
        "launcher.rdzv_backend=c10d",
        "launcher.nnodes=2 launcher.master_port=29500 data.micro_batch_size=1",
    ):
        other = other.split()
        assert _launch(*other).launcher is Torchrun, other
    command = _launch().command
    assert command[1:3] == ("-m", "parabench.localrun") and "--nproc-per-node=2" in command
    assert command[-4:] == ("--run-id=parabench", "-m", "parabench.worker", "/r")


def _start(tmp_path: Path, mode: str) -> subprocess.Popen:
    (tmp_path / "probe_entry.py").write_text(PROBE)
    # two OpenMP threads per rank: the launcher imports torch at one (a fork copies no thread pool), each
    # rank sets two again
    pythonpath = f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "2"}
    cmd = [sys.executable, "-m", "parabench.localrun", "--nproc-per-node=2", "-m", "probe_entry", str(tmp_path), mode]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.e2e
def test_forked_ranks_see_torchruns_environment_and_join_the_launchers_store(tmp_path):
    proc = _start(tmp_path, "ok")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, rank_saw in enumerate(seen):
        assert rank_saw["preloaded"] is True and rank_saw["name"] == "__main__"  # forked after the imports
        assert rank_saw["ppid"] == proc.pid and rank_saw["argv"] == [str(tmp_path), "ok"]
        assert (rank_saw["RANK"], rank_saw["LOCAL_RANK"], rank_saw["WORLD_SIZE"]) == (str(rank), str(rank), "2")
        assert rank_saw["LOCAL_WORLD_SIZE"] == "2" and rank_saw["GROUP_RANK"] == "0"
        assert rank_saw["TORCHELASTIC_RESTART_COUNT"] == "0" and rank_saw["TORCHELASTIC_RUN_ID"] == "parabench"
        assert rank_saw["threads"] == 2 and rank_saw["OMP_NUM_THREADS"] == "2"
        assert rank_saw["sum"] == 3.0  # 1 + 2 over gloo, through the launcher's store
    port = seen[0]["MASTER_PORT"]
    assert seen[1]["MASTER_PORT"] == port and port != "0"  # the store bound a free port itself
    assert f"2 ranks forked: pids [{min(proc_pids(tmp_path))}, {max(proc_pids(tmp_path))}]" in out, out


def proc_pids(tmp_path: Path) -> list[int]:
    return [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)]


@pytest.mark.e2e
def test_the_first_failed_rank_stops_the_others_and_is_named_like_torchrun_names_it(tmp_path):
    started = time.monotonic()
    proc = _start(tmp_path, "fail")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out
    assert time.monotonic() - started < 100  # rank 0 (asleep for 120 s) was stopped, not waited for
    found = ROOT_CAUSE.search(out)  # what the runner reads from launcher.log for its failure line
    assert found is not None and found.groups() == ("1", "3"), out
    assert not any(alive(pid) for pid in proc_pids(tmp_path))


@pytest.mark.e2e
def test_sigterm_to_the_launcher_stops_every_rank(tmp_path):
    proc = _start(tmp_path, "wait")
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"pid{r}").exists() for r in (0, 1)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "SIGTERM: stopping the ranks" in out and not any(alive(pid) for pid in proc_pids(tmp_path))
