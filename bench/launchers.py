"""How worker processes are started: torchrun (PyTorch stacks) or msrun (MindSpore).

An adapter names its launcher in ``capabilities.launcher``; the runner asks that launcher for the
command line, and each worker asks it where it sits in the world (the two tools export different
environment variables). The dry-run bundle (``launch.sh``) uses the same command, made relocatable.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import ClassVar

from parabench.spec import JobSpec

WORKER = ["-m", "parabench.worker"]


class Launcher:
    name: ClassVar[str]

    @classmethod
    def command(cls, job: JobSpec, port: int, run_dir: str, python: str = sys.executable) -> list[str]:
        raise NotImplementedError

    @classmethod
    def bundle_command(cls, job: JobSpec, port: int) -> str:
        """The shell line of ``launch.sh``; $RUN_DIR, $NODE_RANK and $MASTER_ADDR stay variables."""
        raise NotImplementedError

    @staticmethod
    def coords() -> tuple[int, int, int]:
        """(rank, local_rank, world_size) of this worker, from the launcher's environment."""
        raise NotImplementedError


class Torchrun(Launcher):
    name = "torchrun"

    @staticmethod
    def _args(job: JobSpec, port: int) -> list[str]:
        la = job.launch
        return [f"--nnodes={la.nnodes}", f"--nproc-per-node={la.nproc_per_node}", f"--master-port={port}", "--max-restarts=0"]

    @classmethod
    def command(cls, job: JobSpec, port: int, run_dir: str, python: str = sys.executable) -> list[str]:
        la = job.launch
        return [python, "-m", "torch.distributed.run", *cls._args(job, port), f"--node-rank={la.node_rank}",
                f"--master-addr={la.master_addr}", *WORKER, run_dir]

    @classmethod
    def bundle_command(cls, job: JobSpec, port: int) -> str:
        la = job.launch
        return ("torchrun " + " ".join(cls._args(job, port))
                + f' --node-rank="${{NODE_RANK:-{la.node_rank}}}" --master-addr="${{MASTER_ADDR:-{la.master_addr}}}"'
                + ' -m parabench.worker "$RUN_DIR"')

    @staticmethod
    def coords() -> tuple[int, int, int]:
        env = os.environ
        return int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0)), int(env.get("WORLD_SIZE", 1))


LAUNCHERS: dict[str, type[Launcher]] = {Torchrun.name: Torchrun}


def get_launcher(name: str) -> type[Launcher]:
    return LAUNCHERS[name]


def which(tool: str) -> str | None:
    """A launcher tool next to this interpreter first (a venv's bin need not be on PATH)."""
    beside = os.path.join(os.path.dirname(sys.executable), tool)
    return beside if os.access(beside, os.X_OK) else shutil.which(tool)
