"""``bench convert`` from files to files: a parabench ZeRO-3 checkpoint to a parabench megatron one
without launching either framework (docs/convert.md#from-files-to-files).

The launched path loads the checkpoint into the source framework's ranks and saves it from the
target's: on one host the ranks' shares add up to the whole state and more. Here the command reads
DeepSpeed's flat fp32 partitions and moments a parameter at a time (parabench.convert.zero3_files)
and writes Megatron's ``torch_dist`` files a layer at a time (parabench.convert.megatron_files), with
the harness files a launched import writes (convert.worker.harness_state); the checksum after is
that of the written files read back. The command publishes ``step_N`` with the target job's marker
as it publishes a launched import's, so ``bench run ... run.resume=OUT`` continues from it.

Taken where both ends allow it (:func:`refusal` is None); ``--via launch`` takes the launched path.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from parabench import canonical
from parabench.convert import megatron_files, zero3_files
from parabench.convert.worker import harness_state
from parabench.resilience.checkpoint import TMP
from parabench.spec import JobSpec


def refusal(kind: str, identity: dict[str, Any], tjob: JobSpec | None) -> str | None:
    """Why this conversion cannot go from files to files (None: it can)."""
    if kind != "native" or identity.get("backend") != "deepspeed" or identity["options"].get("zero_stage") != 3:
        return "the source is not a parabench DeepSpeed ZeRO-3 checkpoint"
    if tjob is None or tjob.backend.name != "megatron":
        return "the target is not megatron"
    o, m = tjob.backend.options, tjob.model
    if identity["precision"] != "fp32" or tjob.run.precision != "fp32":
        return "fp32 source and target only"
    if (o.pp, o.vpp, o.cp, o.ep) != (1, 1, 1, 1) or o.distributed_optimizer or o.sequence_parallel:
        return "megatron with tp only (pp=vpp=cp=ep=1, no distributed optimizer, no sequence parallelism)"
    if m.is_moe or m.tie_word_embeddings or m.qkv_bias:
        return "dense models with untied embeddings and no QKV bias only"
    te = o.transformer_impl == "transformer_engine" or importlib.util.find_spec("transformer_engine") is not None
    if te and tjob.device.type != "cpu":
        return "Transformer Engine's layer spec saves other keys"
    return None


def convert(src: Path, marker: dict[str, Any], tjob: JobSpec, out: Path) -> dict[str, Any]:
    """The checkpoint ``src`` written as the megatron ``tjob``'s into ``out/step_N.tmp`` (unmarked):
    what an import launch returns (checksum read back, staging, step) and the source's checksum,
    tensors and bytes."""
    import torch

    spec, world = tjob.model, int(marker["world_size"])
    state = zero3_files.read(src / "native", world, spec.parameter_shapes())
    tensors, nbytes = canonical.size(state)
    saved = [torch.load(src / "harness" / f"rank{r}.pt", weights_only=True) for r in range(world)]
    step = int(saved[0]["step"])
    staging = out / f"step_{step:06d}{TMP}"
    (staging / "harness").mkdir(parents=True)
    before = megatron_files.write(staging / "native", state, spec, tjob.backend.options.tp, tjob.optim)
    tp, target_world = tjob.backend.options.tp, tjob.parallel.world_size
    for rank in range(target_world):  # megatron's rank order: tensor rank fastest, then data-parallel
        harness = harness_state(rank, rank // tp, target_world // tp, saved, step)
        torch.save(harness, staging / "harness" / f"rank{rank}.pt")
    after = megatron_files.checked(staging / "native", spec, state, before)  # the files read back
    return {
        "checksum": after,
        "staging": str(staging),
        "step": step,
        "checksum_before": before,
        "tensors": tensors,
        "bytes": nbytes,
        "optimizer_step": state.step,
    }
