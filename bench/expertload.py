"""Tokens per expert: the load balance of a Mixture-of-Experts model, per layer and step.

A rank counts the (token, slot) assignments its router made to each expert of each MoE layer in the
forward passes of one step (every micro-batch; each token counts ``num_experts_per_tok`` times, once
per expert it is sent to, as Megatron-Core's ``routing_map.sum(dim=0)`` in ``TopKRouter`` and
DeepSpeed-MoE's ``exp_counts`` count them). The step's count is the sum over the ranks that routed
distinct tokens (:meth:`RoutedTokens.take`; which group that is, each engine says), so every row of
the global batch is counted once: per layer the counts add up to ``k x tokens per step``.

Load imbalance of a layer = ``max_e c_e / mean_e c_e`` with ``mean_e c_e = k x T / E``: 1 when
every expert gets the same share, ``E / k`` when all tokens go to the same k experts (the ratio
Megatron-LM and the Switch Transformer's capacity factor are stated in; docs/sources.md#moe-load).
torch is imported inside the functions that need it (``bench --help`` loads none of it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# one step's counts: [layer][expert] -> (token, slot) assignments, summed over the token-holding ranks
Counts = list[list[int]]


class RoutedTokens:
    """One rank's count of routed tokens since the last :meth:`take`, [layers, experts] on the device.

    Only forwards that build a graph count (``torch.is_grad_enabled()``, Megatron-Core's own rule for
    its ``local_tokens_per_expert``): an activation-recompute scheme whose first forward runs without
    grad (megatron-core's reentrant ``checkpoint``) counts its recomputation, once; an evaluation
    forward counts nothing."""

    def __init__(self, layers: int, experts: int, device: Any = "cpu"):
        import torch

        self.counts = torch.zeros(layers, experts, dtype=torch.int64, device=device)

    def add_top_k(self, layer: int, top_experts: Any) -> None:
        """``top_experts``: [tokens, k] expert ids of each token's k slots (the canonical router)."""
        import torch

        if torch.is_grad_enabled():
            ids = top_experts.detach().reshape(-1).to(torch.int64)
            # index_add_, not bincount: CUDA's bincount reads the largest id back to the host, a
            # synchronisation inside the timed step
            self.counts[layer].index_add_(0, ids, torch.ones_like(ids))

    def add_routing_map(self, layer: int, routing_map: Any) -> None:
        """``routing_map``: [tokens, experts] booleans, True where a token goes to an expert (Megatron-Core)."""
        import torch

        if torch.is_grad_enabled():
            self.counts[layer] += routing_map.detach().sum(dim=0).to(torch.int64)

    def take(self, group: Any = None) -> Counts:
        """Collective over ``group`` (None: the world): the counts summed over its ranks, then reset.
        ``group`` must hold each routed token on exactly one of its ranks."""
        import torch.distributed as dist

        total = self.counts.clone()
        if dist.is_initialized():
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        self.counts.zero_()
        return total.cpu().tolist()


def imbalance(counts: Counts) -> list[float]:
    """Per layer: tokens of the busiest expert / the mean over experts (1.0 = balanced)."""
    out = []
    for layer in counts:
        mean = sum(layer) / len(layer)
        out.append(max(layer) / mean if mean else float("nan"))
    return out


def step_metrics(step: int, counts: Counts) -> list[tuple[str, float, int]]:
    """The MLflow metrics of one step: every layer's count per expert, its imbalance, and the worst
    layer's imbalance as ``moe_load_imbalance``."""
    per_layer = imbalance(counts)
    out = [
        (f"moe_tokens_per_expert/layer{i}/expert{e}", float(c), step)
        for i, row in enumerate(counts)
        for e, c in enumerate(row)
    ]
    out += [(f"moe_load_imbalance/layer{i}", v, step) for i, v in enumerate(per_layer)]
    out.append(("moe_load_imbalance", max(per_layer), step))
    return out


def summary(per_step: Sequence[Sequence[Any]]) -> dict[str, Any]:
    """summary.json's figures from ``[[step, counts], ...]`` (empty for a dense model: no figures)."""
    if not per_step:
        return {}
    worst_per_step = [max(imbalance(counts)) for _, counts in per_step]
    # the worst (step, layer): its imbalance, then the earliest step and layer with it
    top, step, layer = max((v, -int(step), -i) for step, counts in per_step for i, v in enumerate(imbalance(counts)))
    return {
        "moe_tokens_per_expert": [counts for _, counts in per_step],
        "moe_tokens_per_expert_steps": [int(step) for step, _ in per_step],
        "moe_load_imbalance_mean": sum(worst_per_step) / len(worst_per_step),
        "moe_load_imbalance_max": top,
        "moe_load_imbalance_max_at": {"step": -step, "layer": -layer},
    }


FORMULA = (
    "max_e c_e / mean_e c_e of the worst layer, c_e = (token, slot) assignments to expert e summed over the "
    "ranks that route distinct tokens, mean = k x tokens / E; 1 = balanced, E/k = every token on the same k experts"
)


def summary_line(s: Mapping[str, Any]) -> list[str]:
    """The printed summary's line, for a MoE run."""
    if "moe_load_imbalance_mean" not in s:
        return []
    at = s["moe_load_imbalance_max_at"]
    return [
        f"  expert load    {s['moe_load_imbalance_mean']:.3f} max/mean tokens per expert, mean over "
        f"{len(s['moe_tokens_per_expert'])} steps (worst {s['moe_load_imbalance_max']:.3f} at step {at['step']}, "
        f"layer {at['layer']}); {FORMULA}"
    ]
