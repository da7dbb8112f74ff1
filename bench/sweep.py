"""The sweep's Hydra callback under its former name, for Slurm jobs already in the queue: submitit
pickles the launcher with Hydra's instantiated callbacks (``hydra_context.callbacks``), so a job
submitted by an earlier parabench unpickles ``parabench.sweep.MultirunCallback`` by this name when it
starts, possibly after an upgrade. The code is :mod:`parabench.run.sweep`; ``conf/config.yaml``
names it there. Nothing else may import this module."""

from parabench.run.sweep import MultirunCallback

__all__ = ["MultirunCallback"]
