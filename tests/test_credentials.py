"""A password given in ``tracking.uri`` (``http://user:password@host``) reaches MLflow through its
standard variables and nothing else: not a file under the results or the sweep directory (Hydra's
``.hydra/*.yaml`` and ``multirun.yaml``, submitit's pickles, the launch bundle), not the output, not
an MLflow param, tag or run name (issue 33, items 3 and 5; docs/security.md).

Hydra escapes a URI in the overrides it writes and prints (``http\\://user\\:pw@host``), so the
credentials are moved out of the command line before Hydra sees it
(:func:`parabench.tracking.store.overrides_without_credentials`). The end-to-end sweep against an MLflow
server with basic auth is in tests/test_mlflow_auth_ui.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import FAST

PASSWORD = "pw-9c41e7d2-unique"  # a unique string: a grep for it finds only leaks
USER = "carol"
DEAD = "127.0.0.1:9"  # discard port: nothing answers there
TINY = [*FAST, "run.steps=2", "run.checksum=false", "device=cpu"]


def leaks(root: Path, secret: str = PASSWORD) -> list[str]:
    """Every file under ``root`` whose bytes (text, YAML, JSON or pickle) contain ``secret``."""
    return [str(p) for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


@pytest.fixture
def mlflow_env(monkeypatch):
    """MLflow's credential variables restored after the test (bench sets them in its own process)."""
    for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(key, "")  # recorded, so that teardown restores the unset state
        monkeypatch.delenv(key)
    return os.environ


def test_redact_finds_the_escaped_form_hydra_writes():
    from parabench.tracking.store import redact

    escaped = f"- tracking.uri=http\\://{USER}\\:{PASSWORD}@127.0.0.1\\:5000"  # .hydra/overrides.yaml
    assert redact(escaped) == "- tracking.uri=http\\://***@127.0.0.1\\:5000"
    assert PASSWORD not in redact(f"http://{USER}:p@ss{PASSWORD}@host/x")  # a raw '@': urlsplit's split


def test_overrides_move_credentials_to_mlflow_variables(mlflow_env):
    from parabench.errors import SpecError
    from parabench.tracking.store import overrides_without_credentials

    given = ["+model=llama", f"tracking.uri=http://{USER}:{PASSWORD}@h1:5000,https://{USER}:{PASSWORD}@h2"]
    assert overrides_without_credentials(given, mlflow_env) == [
        "+model=llama",
        "tracking.uri=http://h1:5000,https://h2",
    ]
    assert mlflow_env["MLFLOW_TRACKING_USERNAME"] == USER and mlflow_env["MLFLOW_TRACKING_PASSWORD"] == PASSWORD
    escaped = [f"++tracking.uri=http\\://{USER}\\:p%40ss@h"]  # as Hydra writes it, percent-encoded '@'
    assert overrides_without_credentials(escaped, mlflow_env) == ["++tracking.uri=http\\://h"]
    assert mlflow_env["MLFLOW_TRACKING_PASSWORD"] == "p@ss"
    database = ["tracking.uri=postgresql://u:dbpw@db/mlflow"]  # the store's own login: MLflow needs it there
    assert overrides_without_credentials(database, mlflow_env) == database
    with pytest.raises(SpecError, match="tracking.uri: .*MLFLOW_TRACKING_USERNAME"):
        overrides_without_credentials(["tracking.uri=http://a:1@h1,http://b:2@h2"], mlflow_env)


def test_sweep_never_writes_or_prints_the_uri_password(tmp_path, capsys, monkeypatch, mlflow_env):
    """`bench run -m` (a dry run: Hydra writes its .hydra files, multirun.yaml and job lines all the
    same): the password is in no file and no output, and is in MLflow's variable for the client."""
    from parabench.cli import main

    monkeypatch.chdir(tmp_path)
    uri = f"http://{USER}:{PASSWORD}@{DEAD}"
    args = ["run", "-m", *TINY, "run.seed=1,2", f"tracking.uri={uri}", "launcher.dry_run=true"]
    code = main([*args, f"run.results_dir={tmp_path / 'results'}", f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert len(list((tmp_path / "sweep").rglob("launch.sh"))) == 2, out  # both jobs wrote their bundle
    assert (tmp_path / "sweep" / "multirun.yaml").is_file() and list((tmp_path / "sweep").rglob("overrides.yaml"))
    assert PASSWORD not in out + err
    assert not leaks(tmp_path), f"password written to {leaks(tmp_path)}"
    assert mlflow_env["MLFLOW_TRACKING_PASSWORD"] == PASSWORD  # MLflow's client sends it from there


def test_slurm_submission_never_writes_prints_or_pickles_the_uri_password(tmp_path, capsys, monkeypatch, mlflow_env):
    """`hydra/launcher=slurm_torchrun`: what bench submits - submitit's pickled launcher, config and
    overrides, the sbatch script, the sweep's spool of its parent run - and what it prints hold no
    password. Slurm is a stand-in (``sbatch`` answers a job id, nothing runs: the jobs are reported
    failed); tests/test_mlflow_auth_ui.py runs a sweep end to end against a server with basic auth."""
    from submitit.slurm.slurm import SlurmExecutor

    from parabench.cli import main
    from parabench.run import slurm

    monkeypatch.setattr(slurm, "check_submission", lambda partition: None)  # no controller to ask
    submitted = ["echo", "Submitted batch job 4242"]  # what sbatch answers (submitit parses the id)
    monkeypatch.setattr(SlurmExecutor, "_make_submission_command", lambda self, path: submitted)
    monkeypatch.setattr(SlurmExecutor, "affinity", staticmethod(lambda: 2))  # submitit looks for srun on PATH
    monkeypatch.setattr(slurm.SlurmLauncher, "_wait", staticmethod(lambda job: ([], "stopped by the test")))
    monkeypatch.chdir(tmp_path)
    uri = f"http://{USER}:{PASSWORD}@{DEAD}"
    args = ["run", "-m", "hydra/launcher=slurm_torchrun", "launcher.slurm=true", *TINY, "run.seed=1,2"]
    code = main(
        [
            *args,
            f"tracking.uri={uri}",
            f"run.results_dir={tmp_path / 'results'}",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 1 and "4242_0: stopped by the test" in err, out + err
    assert "parabench: submitting #1: " in out and "tracking.uri=http\\://127.0.0.1\\:9" in out, out
    pickles = list((tmp_path / "sweep").rglob("*_submitted.pkl"))
    assert len(pickles) == 2 and all(b"127.0.0.1" in p.read_bytes() for p in pickles)  # the URI is in them
    assert PASSWORD not in out + err
    assert not leaks(tmp_path), f"password written to {leaks(tmp_path)}"


def test_compare_messages_hold_no_uri_password(tmp_path, capsys, monkeypatch, mlflow_env):
    """`bench compare --tracking-uri http://user:pw@host`: MLflow's client is given the URI without
    the login, so neither bench's message nor MLflow's (which quotes the URL) holds the password. The
    server is one that answered the pre-flight probe and then went away (nothing listens)."""
    from parabench.compare import command as compare
    from parabench.tracking import store as trackstore

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(trackstore, "probe_server", lambda *args, **kwargs: None)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    uri = f"http://{USER}:{PASSWORD}@{DEAD}"
    code = compare.main(["--tracking-uri", uri, "--runs", "0123abcd", "--no-log", "--out", str(tmp_path / "r")])
    out, err = capsys.readouterr()
    assert code == 2 and err.startswith(f"bench compare: error: --runs: no run '0123abcd' in http://{DEAD}"), err
    assert PASSWORD not in out + err and not leaks(tmp_path)
    assert mlflow_env["MLFLOW_TRACKING_PASSWORD"] == PASSWORD


def test_comm_config_and_params_hold_no_uri_password(tmp_path, monkeypatch, mlflow_env):
    """`bench comm tracking.uri=http://user:pw@host`: the composed config - written to comm.json and
    flattened into the MLflow run's params - has the URI without the login (the run itself is not
    started here; tests/test_mlflow_auth_ui.py records one on a server with basic auth)."""
    from parabench.comm import command as comm

    seen = []
    monkeypatch.setattr(comm, "execute", lambda p, run_dir: seen.append(p) or 0)
    uri = f"http://{USER}:{PASSWORD}@{DEAD}"
    base = ["backend=ddp", "device=cpu", "launcher.nproc_per_node=2", "comm.max_bytes=4K"]
    assert comm.main(["-m", *base, f"tracking.uri={uri}", f"run.results_dir={tmp_path}"]) == 0
    assert [p.plain["tracking"]["uri"] for p in seen] == [f"http://{DEAD}"]
    assert PASSWORD not in repr(seen) and mlflow_env["MLFLOW_TRACKING_PASSWORD"] == PASSWORD


def test_plan_calibration_from_a_server_holds_no_uri_password(tmp_path, capsys, monkeypatch, mlflow_env):
    """`bench plan --calibrate EXP --tracking-uri http://user:pw@host` on a server that does not answer:
    one line naming the option, without the password (it was a traceback quoting the URL with it)."""
    from parabench.plan.command import main

    monkeypatch.chdir(tmp_path)
    code = main(["--calibrate", "nosuch", "--tracking-uri", f"http://{USER}:{PASSWORD}@{DEAD}"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("bench: error: --tracking-uri: ") and len(err.splitlines()) == 1, err
    assert PASSWORD not in err and mlflow_env["MLFLOW_TRACKING_PASSWORD"] == PASSWORD


def test_convert_keeps_a_login_in_tracking_uri_out_of_everything_it_writes(tmp_path, monkeypatch, capfd, mlflow_env):
    """``bench convert --tracking-uri http://user:pw@host`` (a server that does not answer: the record
    is spooled in --out): the password is in no file of --out and no output; it went to MLflow's
    variable."""
    import socket

    from test_convert import _tiny_hf

    from parabench.cli import main

    with socket.socket() as sock:  # a loopback port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    password = "convert-s3cret-7f3a"
    out = tmp_path / "out"
    hf = _tiny_hf(tmp_path / "hf")
    uri = f"http://alice:{password}@127.0.0.1:{port}"
    code = main(["convert", str(hf), "--to", "canonical", "--out", str(out), "--tracking-uri", uri])
    printed = capfd.readouterr()
    assert code == 0, printed.err
    assert password not in printed.out + printed.err
    leaked = [p for p in out.rglob("*") if p.is_file() and password.encode() in p.read_bytes()]
    assert not leaked and (out / "tracking").is_dir(), leaked
    assert mlflow_env["MLFLOW_TRACKING_PASSWORD"] == password
