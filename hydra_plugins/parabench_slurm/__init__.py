"""parabench's Slurm launcher where Hydra looks for launchers: Hydra instantiates a launcher only from
the ``hydra_plugins`` namespace package (hydra.core.plugins). The code is :mod:`parabench.run.slurm`.

Hydra imports every module of ``hydra_plugins`` at each start. Without the slurm extra
(hydra-submitit-launcher) a stand-in is defined instead, so a plain install prints no "Error importing
'hydra_plugins.parabench_slurm'" warning at every `bench run`, and ``hydra/launcher=slurm_torchrun``
says which extra to install."""

from hydra.plugins.launcher import Launcher

from parabench.errors import UserError

SUBMITIT = "hydra_plugins.hydra_submitit_launcher"
NEEDS_EXTRA = (
    "hydra/launcher=slurm_torchrun: needs hydra-submitit-launcher, which is not installed "
    "(pip install 'parabench[slurm]')"
)

try:
    from parabench.run.slurm import SlurmLauncher as _SlurmLauncher
except ModuleNotFoundError as exc:
    if not (exc.name or "").startswith(SUBMITIT):
        raise

    class SlurmLauncher(Launcher):
        """Stands in for the Slurm launcher without the slurm extra: refuses with the install line."""

        def __init__(self, **_options: object) -> None:
            raise UserError(NEEDS_EXTRA)

        def setup(self, **_kwargs: object) -> None:
            raise UserError(NEEDS_EXTRA)

        def launch(self, job_overrides, initial_job_idx):  # type: ignore[no-untyped-def]
            raise UserError(NEEDS_EXTRA)

else:

    class SlurmLauncher(_SlurmLauncher):  # type: ignore[no-redef]
        """``hydra/launcher=slurm_torchrun`` (conf/hydra/launcher/slurm_torchrun.yaml)."""
