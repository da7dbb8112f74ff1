"""The ``bench`` command: run | comm | compare | convert | sync | plan | env | migrate | smoke.

Each command's module is imported when that command runs, and Hydra only by ``bench run``:
``bench --help`` loads neither torch nor Hydra nor any training framework.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from parabench import __version__
from parabench.devices import AUTOLOAD_ENV
from parabench.errors import RunFailed, UserError, stopped_by
from parabench.hydraconfig import compose, expand_sweep, register_resolvers, register_spec_defaults, to_plain
from parabench.jobs import prepare
from parabench.tracking import store as trackstore
from parabench.tracking.runs import close_abandoned, end_own_runs, store_uri, sync_main

USAGE = """usage: bench <command> [args]

commands:
  run       train the canonical Llama on a backend and measure it (Hydra overrides; -m for sweeps)
              bench run +model=llama
              bench run +model=llama backend=fsdp launcher.nproc_per_node=2
              bench run -m +model=llama backend=ddp,fsdp
              bench run +model=llama --cfg job      (print the composed config)
  comm      collectives benchmark (nccl-tests style): time, algbw, busbw per op and size: bench comm --help
              bench comm launcher.nproc_per_node=2
  compare   tables and an HTML report comparing recorded runs: bench compare --help
  sync      upload what runs spooled while their MLflow server was unreachable: bench sync [RUN_DIR...]
  convert   carry a checkpoint to another stack or layout (weights, AdamW state, step): bench convert --help
              bench convert results/.../checkpoints --to fsdp --out ckpt-fsdp
  plan      which backend and layout for a model on a cluster, predicted and explained:
              bench plan +model=llama3-70b cluster=h100-sxm plan.devices=64 run.precision=bf16
  env       list every backend and device, available or not, and why; the versions that matter
  migrate   migrate CUDA PyTorch code to Ascend (torch_npu / MindSpeed): bench migrate --help
  smoke     run a migrated (NPU) program on this CPU, NPU calls redirected: bench smoke --help

Results: run directories under results/runs/, MLflow store sqlite:///results/mlflow.db
(view with: mlflow ui --backend-store-uri sqlite:///results/mlflow.db).
"""


def _quiet_environment() -> None:
    # torch_npu installed without CANN makes `import torch` fail unless autoload is off
    # (docs/sources.md#device-backend-autoload); NPU workers import torch_npu explicitly.
    for key, value in AUTOLOAD_ENV.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # no network calls from the harness
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    trackstore.bound_retries(os.environ)  # a server that went away: seconds, then the run spools


class _PreparedJobs:
    """The jobs the pre-flight composed and validated, by their resolved config. The Hydra task takes
    its job from here instead of validating it (and probing backends and devices) a second time. A
    task that runs in another process (a Slurm node, through submitit) validates there: that
    machine's devices and Slurm placement are the ones that count."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.jobs: dict[str, Any] = {}
        self.failed: list[str] = []  # "<job number>: <reason>" of the sweep's jobs that failed

    def _stores(self) -> list[tuple[str, str]]:
        """(results_dir, store) of the jobs that record runs."""
        stores = {
            (job.run.results_dir, store_uri(job.tracking, job.run.results_dir))
            for job in self.jobs.values()
            if job.tracking.enabled and not job.launch.dry_run
        }
        return sorted(stores)

    def close_abandoned(self) -> None:
        """Close the runs a killed bench left RUNNING in the stores these jobs write to (once each)."""
        for results_dir, store in self._stores():
            for line in close_abandoned(Path(results_dir), store):
                print(line, file=sys.stderr)

    def end_own_runs(self, status: str, why: str) -> None:
        """End the runs this process left open in the jobs' stores (a sweep's parent)."""
        for results_dir, store in self._stores():
            end_own_runs(Path(results_dir), store, status, why)

    @staticmethod
    def _key(plain: dict[str, Any]) -> str:
        return json.dumps(plain, sort_keys=True, default=str)

    def add(self, plain: dict[str, Any], remote: bool = False) -> None:
        """Validate a job; one that ``remote`` (a Slurm node) runs is checked as far as it can be
        here, without this machine's devices and Slurm placement (its node prepares it again)."""
        if not remote:
            self.jobs[self._key(plain)] = prepare(plain)
            return
        launcher = plain.get("launcher") or {}
        if not launcher.get("slurm"):
            raise UserError(
                "hydra/launcher=slurm_torchrun runs one task per node: add launcher.slurm=true "
                "(each node takes its rank and the master address from the allocation)"
            )
        prepare({**plain, "launcher": {**launcher, "dry_run": True}})

    def job(self, plain: dict[str, Any]):
        job = self.jobs.get(self._key(plain)) if os.getpid() == self.pid else None
        return job if job is not None else prepare(plain)


def _preflight(args) -> _PreparedJobs | None:
    """Compose and validate every job of the command before anything starts. Returns None when
    Hydra should only print (--cfg/--info/--help), in which case there is nothing to validate."""
    if args.cfg or args.info or args.help or args.hydra_help or args.shell_completion:
        return None
    combos = expand_sweep(args.overrides) if args.multirun else [list(args.overrides)]
    first = compose(combos[0], return_hydra_config=True)
    remote = first.hydra.launcher.get("_target_") == "hydra_plugins.parabench_slurm.SlurmLauncher"
    if remote:  # Hydra starts its launcher only in multirun mode: one job is a sweep of one (docs/slurm.md)
        from parabench.run.slurm import check_submission, register_launcher

        check_submission(first.hydra.launcher.get("partition"))
        register_launcher()
        args.multirun, combos = True, expand_sweep(args.overrides)
    if args.multirun:  # an experiment's hydra.sweeper.params add sweep dimensions of their own
        sweep_params = first.hydra.sweeper.get("params") or {}
        given = {o.split("=", 1)[0].lstrip("+~") for o in args.overrides}
        extra = [f"{k}={v}" for k, v in sweep_params.items() if k not in given]
        if extra:
            combos = expand_sweep(list(args.overrides) + extra)
            first = compose(combos[0])
    prepared = _PreparedJobs()
    for i, combo in enumerate(combos):
        prepared.add(to_plain(first if i == 0 else compose(combo)), remote)
    return prepared


def _job(cfg, prepared: _PreparedJobs):
    """The Hydra task: one job (called once, or once per sweep combination)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from parabench.run.command import execute

    hc = HydraConfig.get()
    plain = to_plain(cfg)
    job = prepared.job(plain)
    out = Path(hc.runtime.output_dir)
    tags = {
        "backend_config": hc.runtime.choices.get("backend"),
        "job_num": hc.job.num if hc.mode == RunMode.MULTIRUN else None,
    }
    try:
        summaries = []
        for rep in range(job.run.repeats):
            run_dir = out / f"rep{rep}" if job.run.repeats > 1 else out
            summaries.append(execute(job, plain, run_dir, {**tags, "repeat": rep}))
        return summaries
    except UserError as exc:  # found once the run directory is known (e.g. its checkpoints)
        if os.getpid() != prepared.pid:  # on a Slurm node: the launcher that submitted it reports it
            raise
        print(f"bench: error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except RunFailed as exc:
        if os.getpid() != prepared.pid:
            raise
        if hc.mode == RunMode.MULTIRUN:
            prepared.failed.append(f"{hc.job.num}: {exc}")
            return None
        print(f"bench: {exc}", file=sys.stderr)
        sys.exit(1)


def cmd_run(argv: list[str]) -> int:
    from hydra._internal.utils import _run_hydra, get_args_parser
    from hydra.version import setbase

    try:
        args = get_args_parser().parse_args(argv)
    except SystemExit:  # argparse already printed the reason
        return 2
    try:  # before Hydra saves, prints or pickles an override: a login stays in MLflow's variables
        args.overrides = trackstore.overrides_without_credentials(args.overrides, os.environ)
        prepared = _preflight(args)
    except UserError as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return exc.exit_code

    if prepared is not None:
        prepared.close_abandoned()
    register_resolvers()
    register_spec_defaults()

    def task(cfg):
        return _job(cfg, prepared)

    task.failed = prepared.failed if prepared is not None else []  # type: ignore[attr-defined]  # parabench.run.slurm

    # What @hydra.main does, with our parsed arguments instead of sys.argv.
    setbase("1.3")
    try:
        _run_hydra(
            args=args,
            args_parser=get_args_parser(),
            task_function=task,
            config_path="pkg://parabench.conf",
            config_name="config",
        )
    except ValueError as exc:  # Hydra's own argument checks (e.g. -m together with --cfg)
        print(f"bench: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (parabench.errors.Interrupted)
        signum = stopped_by(exc)
        name = signum.name
        if prepared is not None:  # a sweep's parent run: Hydra's end callback does not run on a signal
            prepared.end_own_runs("KILLED", f"bench interrupted by {name}")
        print(f"bench: interrupted by {name}: workers stopped, run recorded as KILLED", file=sys.stderr)
        return 128 + signum
    if prepared is not None and prepared.failed:
        print("bench: failed jobs:\n  " + "\n  ".join(prepared.failed), file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"parabench {__version__}")
        return 0
    _quiet_environment()
    command, rest = argv[0], argv[1:]
    if command == "run":
        return cmd_run(rest)
    if command == "comm":
        from parabench.comm.command import main as comm_main

        return comm_main(rest)
    if command == "compare":
        from parabench.compare.command import main as compare_main

        return compare_main(rest)
    if command == "sync":
        return sync_main(rest)
    if command == "convert":
        from parabench.convert.command import main as convert_main

        return convert_main(rest)
    if command == "plan":
        from parabench.plan.command import main as plan_main

        return plan_main(rest)
    if command == "env":
        from parabench.env.command import main as env_main

        return env_main(rest)
    if command == "migrate":
        from parabench.migrate.cli import main as migrate_main

        return migrate_main(rest)
    if command == "smoke":
        from parabench.migrate.smoke import main as smoke_main

        return smoke_main(rest)
    print(
        f"bench: error: unknown command {command!r} (choose from run, comm, compare, convert, sync, plan, env, migrate, smoke; see bench --help)",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
