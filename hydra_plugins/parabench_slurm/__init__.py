"""parabench's Slurm launcher where Hydra looks for launchers: Hydra instantiates a launcher only from
the ``hydra_plugins`` namespace package (hydra.core.plugins). The code is :mod:`parabench.slurm`."""

from parabench.slurm import SlurmLauncher as _SlurmLauncher


class SlurmLauncher(_SlurmLauncher):
    """``hydra/launcher=slurm_torchrun`` (conf/hydra/launcher/slurm_torchrun.yaml)."""
