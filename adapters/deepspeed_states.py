"""ZeRO's model-state bytes per rank, the published formula (Rajbhandari et al. 2019, ZeRO, arXiv
1910.02054, sec. 3 and 5; the adapter's module doc gives b and K): what ``expected_model_state``
predicts and the engine reports beside its measurement.
"""

from __future__ import annotations

from parabench.adapters.base import StateFormula
from parabench.adapters.deepspeed_moe import held_numel
from parabench.spec import JobSpec

SOURCE = "Rajbhandari et al. 2019 (ZeRO, arXiv 1910.02054) sec. 5; offload: Ren et al. 2021 (arXiv 2101.06840)"


def bytes_per(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def master_and_moment_bytes(job: JobSpec) -> int:
    """K of the module doc: fp32 master 4 + Adam moments 8 per parameter; stage 0 in fp32 keeps no master."""
    return 8 if job.backend.options.zero_stage == 0 and job.run.precision == "fp32" else 12


def sharded_psi(job: JobSpec) -> tuple[int, float]:
    """(parameters a rank holds whole, parameters per rank of a ZeRO partition). Dense: (Psi, Psi / Nd).
    MoE with ep: the rank holds the non-expert Psi_d and its E / ep experts Psi_e / ep; ZeRO splits
    Psi_d over the Nd data-parallel ranks and the experts over the Nd / ep expert-data-parallel ranks
    (the MoE param groups' ``real_dp_process_group``, DeepSpeedZeroOptimizer._configure_moe_settings)."""
    ep, nd = job.backend.options.ep, job.parallel.dp
    dense, experts = held_numel(job.model, ep)
    return dense + experts, dense / nd + experts / (nd // ep)


def zero_formula(job: JobSpec) -> StateFormula:
    """Per-rank model-state bytes for the job's stage (ZeRO paper, b and K as in the module doc)."""
    nd, stage, ep = job.parallel.dp, job.backend.options.zero_stage, job.backend.options.ep
    whole, part = sharded_psi(job)
    b, k = bytes_per(job.run.precision), master_and_moment_bytes(job)
    per = {0: (2 * b + k, 0), 1: (2 * b, k), 2: (b, b + k), 3: (0, 2 * b + k)}[stage]
    replicated, sharded = per
    where = " (optimizer states in host memory)" if job.backend.options.offload_optimizer != "none" else ""
    text = {
        0: f"({b} + {b} + {k}) * Psi",
        1: f"({b} + {b}) * Psi + {k} * Psi / {nd}",
        2: f"{b} * Psi + ({b} + {k}) * Psi / {nd}",
        3: f"({b} + {b} + {k}) * Psi / {nd}",
    }[stage]
    if job.model.is_moe:
        text += f"; MoE: Psi = Psi_dense + Psi_experts / {ep} (ep), experts partitioned over {nd} / {ep} ranks"
    return StateFormula(
        replicated * whole + sharded * part,
        f"ZeRO stage {stage}, {job.run.precision}: {text}; b={b} params/grads, K={k} fp32 master+Adam{where}",
        SOURCE,
    )


def optimizer_formula(job: JobSpec) -> float:
    """The optimizer-state part alone: K * Psi (stage 0) or K * Psi / Nd (stages 1-3)."""
    whole, part = sharded_psi(job)
    k = master_and_moment_bytes(job)
    return k * whole if job.backend.options.zero_stage == 0 else k * part
