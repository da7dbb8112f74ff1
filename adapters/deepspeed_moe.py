"""DeepSpeed-MoE on the canonical Mixtral block (docs/moe.md#deepspeed).

Every layer's ``block_sparse_moe`` becomes :class:`DeepSpeedMoeBlock`: DeepSpeed's own
``deepspeed.moe.layer.MoE`` (its ``TopKGate`` router weight, its dispatch into the [E, C, h]
expert buffer, the all-to-all over the expert-parallel group, its ``Experts``, the all-to-all back
and the weighted combine) with ``ep_size = backend.ep``, ``k = num_experts_per_tok``, dropless
(``drop_tokens=False``: the capacity C is the largest number of tokens any expert of the layer gets
from one rank of the expert-parallel group), no random token selection, no noise, no sampled second
expert. The expert is the canonical SwiGLU ``Expert`` (w1, w3, w2). At k = 2 DeepSpeed's
``top2gating`` renormalises the two softmax weights to sum to 1, as Mixtral does; its ``l_aux`` is
not Mixtral's loss (it counts the first choice only, per layer), so the block returns the router
logits (DeepSpeed's own computation: fp32 input times the fp32 gate weight) and the canonical
``Llama.forward`` adds Mixtral's load-balancing loss over all layers from them, as on ddp.

Weights: the canonical ``block_sparse_moe.gate.weight`` is the gate's ``wg.weight``; expert
``e = r * E / ep + j`` is local expert j of expert-parallel rank r (DeepSpeed's ``Experts`` holds
``E / ep`` copies, and ``MOELayer`` sends the dispatch buffer's expert rows in that order).
"""

from __future__ import annotations

import re
from typing import Any

from parabench.errors import SpecError
from parabench.spec import JobSpec, ModelSpec

GATE = "block_sparse_moe.moe.deepspeed_moe.gate.wg.weight"
EXPERT = re.compile(r"block_sparse_moe\.moe\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.(w[123]\.weight)$")


def group_name(ep: int) -> str:
    """DeepSpeed's name of the expert-parallel group of ``ep`` ranks (``MoE.expert_group_name``)."""
    return f"ep_size_{ep}"


# --------------------------------------------------------------------------------------------
# Before launch: what DeepSpeed refuses with its MoE, and what parabench has not checked.
# --------------------------------------------------------------------------------------------
def _unchecked(job: JobSpec) -> list[tuple[str, bool, str]]:
    o = job.backend.options
    return [
        (
            "backend.zero_stage",
            o.zero_stage == 3,
            "DeepSpeed 0.19.8 refuses its native MoE layer under ZeRO-3 ('Native DeepSpeed MoE is not "
            "supported with ZeRO Stage 3', DeepSpeedEngine._validate_zero3_moe_compatibility): use 0, 1 or 2",
        ),
        (
            "backend.contiguous_gradients",
            o.zero_stage == 2 and o.contiguous_gradients is False,
            "DeepSpeed's ZeRO-2 asserts contiguous gradients with MoE (DeepSpeedZeroOptimizer._configure_moe_settings)",
        ),
        ("run.precision", job.run.precision != "fp32", "MoE on deepspeed is checked in fp32 only"),
        (
            "backend.offload_optimizer",
            o.offload_optimizer != "none",
            "offloading is not checked with DeepSpeed-MoE",
        ),
        (
            "backend.activation_checkpointing",
            o.activation_checkpointing,
            "the recompute would run the MoE layer's all-to-alls again; not checked with DeepSpeed-MoE",
        ),
        (
            "run.checkpoint.every",
            job.run.checkpoint.every > 0,
            "DeepSpeed-MoE checkpoints (its per-expert files) are not checked yet",
        ),
        (
            "run.resume",
            job.run.resume not in ("auto", "never"),
            "DeepSpeed-MoE checkpoints and bench convert with experts are not checked yet",
        ),
    ]


def check_moe(job: JobSpec, world_size: int) -> None:
    """``backend.ep`` and what DeepSpeed's MoE layer needs; one SpecError naming the key."""
    ep, m = job.backend.options.ep, job.model
    if ep < 1:
        raise SpecError("backend.ep", f"must be >= 1, got {ep}")
    if not m.is_moe:
        if ep > 1:
            raise SpecError(
                "backend.ep", f"expert parallelism (ep={ep}) needs a MoE model (model.num_local_experts > 0)"
            )
        return
    if m.num_local_experts % ep:
        raise SpecError(
            "backend.ep",
            f"model.num_local_experts={m.num_local_experts} is not divisible by ep={ep} (DeepSpeed's MoE asserts it)",
        )
    if world_size % ep:
        raise SpecError(
            "backend.ep",
            f"ep={ep} does not divide the {world_size} ranks (DeepSpeed's expert-parallel groups split the world)",
        )
    if m.shared_expert_intermediate_size:
        raise SpecError(
            "model.shared_expert_intermediate_size",
            "DeepSpeed's MoE has no Qwen2-MoE shared expert (its use_residual is Residual-MoE's softmax mix, "
            "another model)",
        )
    if m.num_experts_per_tok == 1:
        raise SpecError(
            "model.num_experts_per_tok",
            "DeepSpeed's top1gating weighs the expert by its softmax probability, not Mixtral's renormalised 1",
        )
    if not m.norm_topk_prob:
        raise SpecError(
            "model.norm_topk_prob",
            "false is not in DeepSpeed's MoE: its top2gating and topkgating always renormalise the k weights "
            "(deepspeed/moe/sharded_moe.py), as Mixtral does",
        )
    for key, bad, why in _unchecked(job):
        if bad:
            raise SpecError(key, f"with a MoE model (model.num_local_experts={m.num_local_experts}): {why}")


# --------------------------------------------------------------------------------------------
# Formulas: model states and the all-to-all.
# --------------------------------------------------------------------------------------------
def expert_numel(model: ModelSpec) -> int:
    """All experts' parameters of all layers (the rest is replicated over the expert-parallel ranks)."""
    return model.num_hidden_layers * model.num_local_experts * 3 * model.expert_intermediate_size * model.hidden_size


def held_numel(model: ModelSpec, ep: int) -> tuple[int, int]:
    """(non-expert parameters, expert parameters) one rank holds: every expert-parallel rank holds
    all non-expert parameters and E / ep experts of every layer."""
    experts = expert_numel(model) if model.is_moe else 0
    return model.num_params() - experts, experts // ep


def all_to_all_bytes(model: ModelSpec, capacities: list[int], width: int) -> int:
    """One rank's all-to-all bytes of one step: per MoE layer forward, DeepSpeed's ``MOELayer`` sends
    the whole [E, C, h] dispatch buffer (``_AllToAll`` of ``dispatched_input``) and the [E, C, h]
    expert output back, and the backward sends both gradients again: 4 x E x C x h x width, C the
    layer's dropless capacity in that forward (``capacities``, one per layer and micro-batch)."""
    return 4 * model.num_local_experts * model.hidden_size * width * sum(capacities)


# --------------------------------------------------------------------------------------------
# Worker side: the block and the weight names.
# --------------------------------------------------------------------------------------------
def make_block(spec: ModelSpec, ep: int, expert_cls: Any):
    """The DeepSpeed-MoE block for one layer (weights set by :func:`load_block`)."""
    import torch
    import torch.nn.functional as F
    from deepspeed.moe.layer import MoE

    from parabench.model import route

    class DeepSpeedMoeBlock(torch.nn.Module):
        """DeepSpeed's MoE layer; returns (output, router logits) as the canonical block does."""

        def __init__(self):
            super().__init__()
            self.moe = MoE(
                spec.hidden_size,
                expert_cls(spec.hidden_size, spec.expert_intermediate_size),
                num_experts=spec.num_local_experts,
                ep_size=ep,
                k=spec.num_experts_per_tok,
                drop_tokens=False,
                use_rts=False,
                noisy_gate_policy=None,
                top2_2nd_expert_sampling=False,
            )
            self.loads: list = []  # per forward with grad: this rank's most tokens for one expert

        def forward(self, x):
            gate = self.moe.deepspeed_moe.gate.wg.weight
            logits = F.linear(x.reshape(-1, x.shape[-1]).float(), gate.float())  # as TopKGate.forward
            out, _l_aux, _counts = self.moe(x)
            if torch.is_grad_enabled():
                _, top = route(logits.detach(), spec.num_experts_per_tok)
                self.loads.append(torch.bincount(top.reshape(-1), minlength=spec.num_local_experts).max())
            return out, logits

    return DeepSpeedMoeBlock()


def canonical_name(name: str, spec: ModelSpec, ep: int, ep_rank: int) -> tuple[str, bool]:
    """(canonical name, is an expert) of a parameter of the DeepSpeed-MoE model on ``ep_rank``."""
    if name.endswith(GATE):
        return name[: -len(GATE)] + "block_sparse_moe.gate.weight", False
    match = EXPERT.search(name)
    if match is None:
        return name, False
    expert = ep_rank * (spec.num_local_experts // ep) + int(match.group(1))
    return f"{name[: match.start()]}block_sparse_moe.experts.{expert}.{match.group(2)}", True


def swap_blocks(model, spec: ModelSpec, ep: int, ep_rank: int) -> None:
    """Replace every layer's canonical block by DeepSpeed's, with the canonical router weight and
    this rank's E / ep experts copied in."""
    import torch

    from parabench.model import Expert

    for layer in model.model.layers:
        canonical = layer.block_sparse_moe
        block = make_block(spec, ep, Expert).to(canonical.gate.weight.device)
        with torch.no_grad():
            block.moe.deepspeed_moe.gate.wg.weight.copy_(canonical.gate.weight)
            local = block.moe.deepspeed_moe.experts.deepspeed_experts
            for j, expert in enumerate(local):
                expert.load_state_dict(canonical.experts[ep_rank * len(local) + j].state_dict())
        layer.block_sparse_moe = block


def gather_full_state(names: list[str], weights, spec: ModelSpec, ep: int, ep_rank: int) -> dict:
    """Collective: the canonical full state from this rank's DeepSpeed-MoE parameters, in the same
    order on every rank (``weights(i)``: parameter i's full fp32 weight over its ZeRO partitions); each
    expert all-gathered over the expert-parallel group and put back under its canonical index."""
    import torch
    import torch.distributed as dist
    from deepspeed.utils import groups

    group = groups._get_expert_parallel_group(group_name(ep))
    out = {}
    for i, name in enumerate(names):
        full = weights(i)
        canonical, is_expert = canonical_name(name, spec, ep, ep_rank)
        if not is_expert:
            out[canonical] = full
            continue
        parts = [torch.empty_like(full) for _ in range(ep)]
        dist.all_gather(parts, full.contiguous(), group=group)
        for r, part in enumerate(parts):
            out[canonical_name(name, spec, ep, r)[0]] = part
    return out
