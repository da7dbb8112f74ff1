"""What `bench run` prints when a worker fails (issue 26): one line naming the failed rank and its own
error, taken from the logs, never torchrun's ChildFailedError traceback; the logs' last lines only
where no log names the cause. The launcher logs below are torchrun 2.13's own text, as written into
``logs/launcher.log`` by a run with fault.kind=exception (trimmed to the lines the reader uses)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from parabench.run.command import _report_failure, failure_cause

TORCHRUN_FAILED = """\
E1205 22:34:44.337000 28085 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: {code}) local_rank: {rank} (pid: 28121) of binary: python
Traceback (most recent call last):
  File "torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
parabench.worker FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-05_22:34:44
  host      : localhost
  rank      : {rank} (local_rank: {rank})
  exitcode  : {code} (pid: 28121) 
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""  # noqa: W291 (torchrun's own trailing spaces)

RANK_RAISED = """\
[parabench worker] rank {rank}/2 local_rank {rank} pid 28121
step 1/3 loss 10.424134 step_time 2.0603s
[parabench] injected fault: exception on rank {rank} before step 1
Traceback (most recent call last):
  File "bench/loop.py", line 48, in train
    fire_fault(job, ctx.run_dir, ctx.rank, step)
  File "bench/resilience/faults.py", line 58, in fire_fault
    raise InjectedFault(f"fault.kind=exception on rank {{rank}} {{where}}")
parabench.resilience.faults.InjectedFault: fault.kind=exception on rank {rank} before step 1
"""

RANK_QUIET = "[parabench worker] rank {rank}/2 local_rank {rank} pid 28122\nstep 1/3 loss 10.424134\n"


def logs(tmp_path: Path, launcher: str | None, ranks: dict[int, str]) -> Path:
    folder = tmp_path / "logs"
    folder.mkdir()
    if launcher is not None:
        (folder / "launcher.log").write_text(launcher)
    for rank, text in ranks.items():
        (folder / f"rank{rank}.log").write_text(text.format(rank=rank))
    return folder


@pytest.mark.parametrize(
    ("launcher", "ranks", "cause"),
    [
        (
            TORCHRUN_FAILED.format(rank=1, code=1),
            {0: RANK_QUIET, 1: RANK_RAISED},
            "rank 1: parabench.resilience.faults.InjectedFault: fault.kind=exception on rank 1 before step 1",
        ),
        (
            TORCHRUN_FAILED.format(rank=1, code=-9),
            {0: RANK_QUIET, 1: RANK_QUIET},
            "rank 1: killed by signal 9 (SIGKILL)",
        ),
        (  # msrun writes no root cause: the first rank log that ends in an exception
            "msrun: worker exited with 1\n",
            {0: RANK_QUIET, 1: RANK_RAISED},
            "rank 1: parabench.resilience.faults.InjectedFault: fault.kind=exception on rank 1 before step 1",
        ),
        ("", {0: RANK_QUIET}, None),
    ],
)
def test_the_failed_rank_and_its_own_error_are_found(tmp_path, launcher, ranks, cause):
    assert failure_cause(logs(tmp_path, launcher, ranks)) == cause


def test_a_worker_failure_is_one_line_not_torchruns_traceback(tmp_path, capsys):
    logs(tmp_path, TORCHRUN_FAILED.format(rank=0, code=1), {0: RANK_RAISED})
    tags: dict[str, str] = {}
    _report_failure(tmp_path, "a worker failed (torchrun exit code 1)", SimpleNamespace(set_tags=tags.update))
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "parabench: run FAILED: a worker failed (torchrun exit code 1): rank 0: "
        "parabench.resilience.faults.InjectedFault: fault.kind=exception on rank 0 before step 1"
    ]
    assert tags["failure_reason"] == err[0].removeprefix("parabench: run FAILED: ")


def test_without_a_cause_in_the_logs_their_last_lines_are_printed(tmp_path, capsys):
    logs(tmp_path, "torchrun: something else\n", {0: RANK_QUIET})
    _report_failure(tmp_path, "a worker failed (torchrun exit code 1)", SimpleNamespace(set_tags=lambda tags: None))
    err = capsys.readouterr().err
    assert "last lines of" in err and "something else" in err and "step 1/3" in err


def test_the_summary_mentions_faults_restarts_resumes_and_checkpoints_only_when_there_were_any():
    from parabench.run.command import resilience_lines

    plain = {"restarts": 0, "ckpt_saves": 0, "goodput": 0.9, "wall_time_s": 10.0}
    assert resilience_lines(plain) == []
    recovered = {
        **plain,
        "restarts": 1,
        "fault": "kill on rank 1 before step 12",
        "time_to_detect_s": 20.04,
        "resumed_step": 10,
        "resumed_from": "/ck/step_000010",
        "steps_recomputed": 2,
        "ckpt_saves": 3,
        "ckpt_save_blocking_s": 0.654,
        "ckpt_bytes_total": 221 * 2**20,
        "goodput": 0.236,
    }
    assert resilience_lines(recovered) == [
        "  fault          kill on rank 1 before step 12, detected after 20.0 s",
        "  restarts       1 (torchrun restarted the workers)",
        "  resumed        from step 10 of /ck/step_000010; 2 steps recomputed",
        "  checkpoints    3 saved (longest blocking 0.65 s; last 221.0 MiB)",
        "  goodput        0.236 (kept step time / wall time)",
    ]
