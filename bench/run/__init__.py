"""``bench run``: one job from its spec to its summary and MLflow run (``command``), the parent run of
a ``-m`` sweep (``sweep``, a Hydra callback), submitting to Slurm and waiting (``slurm``, the Hydra
launcher of ``hydra/launcher=slurm_torchrun``) and a run's communication measured against its
layout's formula (``comm_report``).

What one rank runs stays beside the launchers, on the processes floor: ``parabench.worker`` is the
module every launch bundle names (``launch.sh``, ``pytorchjob.yaml``, written by ``bench run`` and
``bench plan --emit-bundle`` and kept by users), ``parabench.loop`` its measured loop, and
``parabench.jobs`` (config or spec.json -> JobSpec) is shared by every command that composes a job."""
