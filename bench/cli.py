"""The ``bench`` command: run | env | migrate | smoke.

Imports are lazy: ``bench --help`` loads neither torch nor any training framework.
"""

from __future__ import annotations

import os
import sys

from parabench.devices import AUTOLOAD_ENV

USAGE = """usage: bench <command> [args]

commands:
  run       train the canonical Llama on a backend and measure it (Hydra overrides; -m for sweeps)
              bench run +model=llama
              bench run +model=llama backend=fsdp launcher.nproc_per_node=2
              bench run -m +model=llama backend=ddp,fsdp
              bench run +model=llama --cfg job      (print the composed config)
  compare   tables and an HTML report comparing recorded runs: bench compare --help
  env       list every backend and device, available or not, and why; the versions that matter
  migrate   migrate CUDA PyTorch code to Ascend (torch_npu / MindSpeed): bench migrate --help
  smoke     run a migrated (NPU) program on this CPU, NPU calls redirected: bench smoke --help

Results: run directories under results/runs/, MLflow store sqlite:///results/mlflow.db
(view with: mlflow ui --backend-store-uri sqlite:///results/mlflow.db).
"""

_FAILED_JOBS: list[str] = []


def _quiet_environment() -> None:
    # torch_npu installed without CANN makes `import torch` fail unless autoload is off
    # (docs/sources.md#device-backend-autoload); NPU workers import torch_npu explicitly.
    for key, value in AUTOLOAD_ENV.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # no network calls from the harness
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")


def _preflight(argv: list[str]) -> bool:
    """Validate every job of the command before anything starts. Returns True when Hydra should
    only print (--cfg/--info/--help), in which case there is nothing to validate."""
    from hydra._internal.utils import get_args_parser

    from parabench.confutil import compose, expand_sweep, to_plain
    from parabench.runner import prepare

    try:
        args = get_args_parser().parse_args(argv)
    except SystemExit as exc:  # argparse already printed the reason
        raise _ExitCode(2) from exc
    if args.cfg or args.info or args.help or args.hydra_help or args.shell_completion:
        return True
    combos = expand_sweep(args.overrides) if args.multirun else [list(args.overrides)]
    if args.multirun:
        sweep_params = compose(combos[0], return_hydra_config=True).hydra.sweeper.get("params") or {}
        given = {o.split("=", 1)[0].lstrip("+~") for o in args.overrides}
        extra = [f"{k}={v}" for k, v in sweep_params.items() if k not in given]
        if extra:
            combos = expand_sweep(list(args.overrides) + extra)
    for combo in combos:
        prepare(to_plain(compose(combo)))
    return False


class _ExitCode(Exception):
    def __init__(self, code: int):
        self.code = code


def _job(cfg):
    """The Hydra task: one job (called once, or once per sweep combination)."""
    from pathlib import Path

    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from parabench.confutil import to_plain
    from parabench.errors import RunFailed
    from parabench.runner import execute, prepare

    hc = HydraConfig.get()
    plain = to_plain(cfg)
    job = prepare(plain)
    out = Path(hc.runtime.output_dir)
    tags = {"backend_config": hc.runtime.choices.get("backend"), "job_num": hc.job.num if hc.mode == RunMode.MULTIRUN else None}
    try:
        summaries = []
        for rep in range(job.run.repeats):
            run_dir = out / f"rep{rep}" if job.run.repeats > 1 else out
            summaries.append(execute(job, plain, run_dir, {**tags, "repeat": rep}))
        return summaries
    except RunFailed as exc:
        if hc.mode == RunMode.MULTIRUN:
            _FAILED_JOBS.append(f"{hc.job.num}: {exc}")
            return None
        print(f"bench: {exc}", file=sys.stderr)
        sys.exit(1)


def cmd_run(argv: list[str]) -> int:
    from parabench.errors import UserError

    try:
        print_only = _preflight(argv)
    except _ExitCode as exc:
        return exc.code
    except UserError as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return exc.exit_code

    import hydra

    from parabench.confutil import register_resolvers

    register_resolvers()

    @hydra.main(version_base="1.3", config_path="pkg://parabench.conf", config_name="config")
    def task(cfg):
        return _job(cfg)

    saved = sys.argv
    sys.argv = ["bench run", *argv]
    try:
        task()
    except ValueError as exc:  # Hydra's own argument checks (e.g. -m together with --cfg)
        print(f"bench: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    finally:
        sys.argv = saved
    if _FAILED_JOBS and not print_only:
        print("bench: failed jobs:\n  " + "\n  ".join(_FAILED_JOBS), file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from parabench import __version__

        print(f"parabench {__version__}")
        return 0
    _quiet_environment()
    command, rest = argv[0], argv[1:]
    if command == "run":
        return cmd_run(rest)
    if command == "compare":
        from parabench.compare import main as compare_main

        return compare_main(rest)
    if command == "env":
        from parabench.envreport import main as env_main

        return env_main(rest)
    if command == "migrate":
        from parabench.migrate.cli import main as migrate_main

        return migrate_main(rest)
    if command == "smoke":
        from parabench.migrate.smoke import main as smoke_main

        return smoke_main(rest)
    print(f"bench: error: unknown command {command!r} (choose from run, compare, env, migrate, smoke; see bench --help)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
