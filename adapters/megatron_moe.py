"""A Mixture-of-Experts model on Megatron-Core (the MoE half of ``MegatronEngine``, worker side,
docs/moe.md#megatron): the canonical load-balancing loss over every layer's router logits (with
tensor-parallel slices and across pipeline stages), and the tokens each expert was routed.

``MegatronMoE`` is a mixin of ``MegatronEngine`` (adapters/megatron_engine.py): it reads ``ctx``,
``opts``, ``ps`` and the lists ``_router_logits``, ``_aux_sends`` and ``routed`` the build set.
"""

from __future__ import annotations

from parabench.expertload import RoutedTokens

_AUX_TAG = 3100  # p2p tags of the load-balancing loss's exchange between stages (megatron's own p2p: 0)


class MegatronMoE:
    """The MoE parts of a ``MegatronEngine``."""

    def _capture_router_logits(self, model) -> None:
        """Keep each MoE layer's router logits of the running forward (``TopKRouter.gating``, wrapped
        on this model's routers only) for the canonical load-balancing loss."""
        from megatron.core.transformer.moe.router import TopKRouter

        for module in model.modules():
            if isinstance(module, TopKRouter):

                def gating(hidden, gate=module.gating):
                    logits = gate(hidden)
                    self._router_logits.append(logits)
                    return logits

                module.gating = gating

    def _count_routed_tokens(self, model) -> None:
        """Count each MoE layer's routed tokens (parabench.expertload) from the routing map its
        ``TopKRouter`` returns, the one the token dispatcher sends by: a forward hook on this model's
        routers only. ``layer_number`` is megatron-core's global 1-based layer number (offset by the
        stage's first layer)."""
        from megatron.core.transformer.moe.router import TopKRouter

        spec = self.ctx.job.model
        if self.routed is None:
            self.routed = RoutedTokens(spec.num_hidden_layers, spec.num_local_experts, self.ctx.device.torch_device)
        routed = self.routed
        for module in model.modules():
            if isinstance(module, TopKRouter):
                module.register_forward_hook(
                    lambda router, _inputs, output: routed.add_routing_map(router.layer_number - 1, output[1])
                )

    def tokens_per_expert(self):
        if self.routed is None:
            return None
        # Summed over tp x cp x dp, the group megatron-core itself sums its routers' local_tokens_per_expert
        # over (moe_utils.get_updated_expert_bias): the ranks of one pipeline stage that route distinct
        # tokens - data-parallel ranks their own rows (the expert-parallel ranks are data-parallel ranks
        # and route their own tokens before the all-to-all), context-parallel ranks their sequence chunks,
        # tensor-parallel ranks their sequence-parallel slices (megatron-core's MoELayer refuses tp > 1
        # without sequence parallelism in training). With pp > 1 each stage counted its own layers:
        # summed over the pipeline group too.
        counts = self.routed.take(self.ps.get_tensor_and_data_parallel_group(with_context_parallel=True))
        if self.opts.pp == 1:
            return counts
        import torch
        import torch.distributed as dist

        total = torch.tensor(counts, dtype=torch.int64)
        dist.all_reduce(total, group=self.ps.get_pipeline_model_parallel_group())
        return total.tolist()

    def _aux_loss(self):
        """``router_aux_loss_coef`` x the Switch load-balancing loss over this micro-batch's router
        logits of all layers, as the canonical ``training_loss`` (parabench.model.load_balancing_loss).
        With pp > 1, on the last stage: the earlier stages' routed assignments and probabilities
        (``_stage_aux``) received, the whole loss's value, its gradient through this stage's routers."""
        from parabench.model import load_balancing_loss

        spec = self.ctx.job.model
        logits = [x.reshape(-1, spec.num_local_experts) for x in self._router_logits]
        self._router_logits.clear()
        if self.opts.tp > 1:  # sequence parallel: this rank's routers saw its slice of the tokens
            return self._tp_aux_loss(logits)
        if self.opts.pp == 1:
            return spec.router_aux_loss_coef * load_balancing_loss(
                logits, spec.num_local_experts, spec.num_experts_per_tok
            )
        import torch
        import torch.distributed as dist

        assigned, probs = _router_sums(logits, spec.num_local_experts, spec.num_experts_per_tok)
        group, ranks = self._pp_ranks()
        others = [torch.empty(2, spec.num_local_experts) for _ in ranks[:-1]]
        for src, part in zip(ranks[:-1], others, strict=True):
            dist.recv(part, src=src, group=group, tag=_AUX_TAG)
        assigned = assigned + sum(part[0] for part in others)
        for dst in ranks[:-1]:  # every stage's gradient needs every layer's assignments
            self._aux_sends.append((dist.isend(assigned, dst=dst, group=group, tag=_AUX_TAG + 1), assigned))
        total = probs + sum(part[1] for part in others)  # the earlier stages' without gradient
        return self._aux_scale(logits) * torch.sum(assigned * total)

    def _aux_scale(self, logits: list, slices: int = 1) -> float:
        """coef x E / N^2, N = the micro-batch's (token, layer) rows over all layers: the load-balancing
        loss is coef x E x sum_e (assignments to e / N) (probabilities of e / N). ``slices``: the
        tensor-parallel ranks whose sequence slices together make the micro-batch's tokens."""
        spec = self.ctx.job.model
        rows = logits[0].shape[0] * slices * spec.num_hidden_layers
        return spec.router_aux_loss_coef * spec.num_local_experts / rows**2

    def _tp_aux_loss(self, logits: list):
        """The load-balancing loss of the micro-batch's tokens when tensor-parallel ranks route the
        slices sequence parallelism gives them (megatron-core refuses tp > 1 with MoE without it): the
        assignments and probabilities summed over the tensor-parallel group, the whole loss on every
        rank, its gradient through this rank's probabilities only - megatron-core sums the router's
        gradient over the group (a ``sequence_parallel`` parameter), which adds the other slices'."""
        import torch
        import torch.distributed as dist

        spec = self.ctx.job.model
        assigned, probs = _router_sums(logits, spec.num_local_experts, spec.num_experts_per_tok)
        group = self.ps.get_tensor_model_parallel_group()
        sums = torch.stack([assigned, probs.detach()])
        dist.all_reduce(sums, group=group)
        total_probs = probs + (sums[1] - probs.detach())  # the value of the sum, the gradient of this slice
        return self._aux_scale(logits, self.opts.tp) * torch.sum(sums[0] * total_probs)

    def _pp_ranks(self):
        import torch.distributed as dist

        group = self.ps.get_pipeline_model_parallel_group()
        return group, dist.get_process_group_ranks(group)

    def _stage_aux(self, hidden, micro_batches: int):
        """A stage before the last (pp > 1): its layers' share of the load-balancing loss of Mixtral, a
        product of sums over all layers that no stage can compute alone. Its routed assignments and
        summed router probabilities go to the last stage, which computes the loss's value; in the
        backward its probabilities get the loss's gradient, coef x E / N^2 x the assignments summed over
        all layers (received from the last stage) / the micro-batches (the schedule's averaging)."""
        import torch
        import torch.distributed as dist

        spec = self.ctx.job.model
        logits = [x.reshape(-1, spec.num_local_experts) for x in self._router_logits]
        self._router_logits.clear()
        assigned, probs = _router_sums(logits, spec.num_local_experts, spec.num_experts_per_tok)
        group, ranks = self._pp_ranks()
        sent = torch.stack([assigned, probs.detach()])
        self._aux_sends.append((dist.isend(sent, dst=ranks[-1], group=group, tag=_AUX_TAG), sent))

        def received():
            out = assigned.new_empty(assigned.shape)
            dist.recv(out, src=ranks[-1], group=group, tag=_AUX_TAG + 1)
            return out * (self._aux_scale(logits) / micro_batches)

        return _aux_gradient().apply(hidden, probs, received)


def _router_sums(logits: list, experts: int, top_k: int):
    """(assignments to each expert, router probabilities of each expert) summed over the rows of
    ``logits`` (one [rows, experts] tensor per layer), as ``load_balancing_loss`` computes them: softmax
    in fp32, the top-k of it, one assignment per (row, slot); the probabilities keep their gradient."""
    import torch
    import torch.nn.functional as F

    probs = F.softmax(torch.cat(logits, dim=0), dim=-1, dtype=torch.float)
    _, selected = torch.topk(probs, top_k, dim=-1)
    assigned = F.one_hot(selected, experts).float().sum(dim=(0, 1))
    return assigned, probs.sum(dim=0)


def _aux_gradient():
    """An autograd function: the stage's output unchanged forward; backward, its gradient unchanged and
    the router probabilities' of the load-balancing loss (``received()``), as a stage before the last
    one cannot add the loss to a loss of its own (megatron-core backpropagates its output)."""
    import torch

    class AuxGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, probs, received):
            ctx.received = received
            return hidden.view_as(hidden)

        @staticmethod
        def backward(ctx, grad):
            return grad, ctx.received(), None

    return AuxGradient
