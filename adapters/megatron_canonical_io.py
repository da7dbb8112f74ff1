"""``bench convert`` on Megatron-Core (the ``CanonicalIO`` role of ``MegatronEngine``, worker side):
the model's weights and AdamW state gathered over the tensor, expert and pipeline ranks and mapped
back to the canonical full tensors (``megatron_mapping.from_megatron``), and the canonical state
handed out to this rank's shards (``to_megatron``); the distributed optimizer's slices through
``megatron_distopt``.

``MegatronCanonicalIO`` is a mixin of ``MegatronEngine`` (adapters/megatron_engine.py): it reads
``ctx``, ``opts``, ``ps``, ``chunks``, ``layout``, ``stage``, ``tp_rank``, ``ep_rank``, ``steps`` and
the engine's ``_megatron_optimizers()``.
"""

from __future__ import annotations

from parabench.adapters import megatron_distopt
from parabench.adapters.base import CanonicalIO
from parabench.adapters.megatron_build import unwrap
from parabench.canonical import MOMENTS, CanonicalState, Lazy, view


class MegatronCanonicalIO(CanonicalIO):
    """Canonical export and import of a ``MegatronEngine``'s state."""

    def _gather_canonical(self, value_of, to_all: bool = True):
        """Canonical full tensors of ``value_of(name, param)`` over every chunk's parameters: gathered
        over the TP group and mapped back (fused QKV / gate-up split, megatron_mapping.from_megatron;
        elementwise states such as AdamW moments map exactly as the weights do), then over the stages.
        ``to_all=False``: only tensor-parallel rank 0 gathers and maps (the others return what their
        pipeline peers of the same tp rank hold: nothing), so rank 0 holds the whole state, not every rank."""
        import numpy as np
        import torch
        import torch.distributed as dist

        from parabench.adapters.megatron_mapping import from_megatron

        ps, spec = self.ps, self.ctx.job.model
        tp_group, tp = ps.get_tensor_model_parallel_group(), self.opts.tp
        canonical: dict[str, np.ndarray] = {}
        for c, chunk in enumerate(self.chunks):
            local = {n: value_of(n, p).detach().float() for n, p in unwrap(chunk).named_parameters()}
            shards = []
            if tp > 1 and not to_all:
                mine = self.tp_rank == 0
                for name in sorted(local):
                    parts = [torch.empty_like(local[name]) for _ in range(tp)] if mine else None
                    dist.gather(
                        local[name].contiguous(), parts, dst=ps.get_tensor_model_parallel_src_rank(), group=tp_group
                    )
                    local[name] = parts
                if not mine:
                    continue
                shards = [{n: local[n][r].cpu().numpy() for n in local} for r in range(tp)]
            elif tp > 1:
                gathered = {}
                for name in sorted(local):
                    parts = [torch.empty_like(local[name]) for _ in range(tp)]
                    dist.all_gather(parts, local[name].contiguous(), group=tp_group)
                    gathered[name] = parts
                shards = [{n: gathered[n][r].cpu().numpy() for n in gathered} for r in range(tp)]
            else:
                shards = [{n: t.cpu().numpy() for n, t in local.items()}]
            canonical.update(from_megatron(shards, spec, self.layout, self.stage, c, self.ep_rank))
        if self.opts.ep > 1:  # each expert-parallel rank mapped its own experts: merge them
            parts = [None] * self.opts.ep
            dist.all_gather_object(parts, canonical, group=ps.get_expert_model_parallel_group())
            canonical = {k: v for part in parts for k, v in part.items()}
        if self.opts.pp > 1:
            parts: list = [None] * self.opts.pp
            dist.all_gather_object(parts, canonical, group=ps.get_pipeline_model_parallel_group())
            canonical = {k: v for part in parts for k, v in part.items()}
        return {n: torch.from_numpy(v) for n, v in canonical.items()}

    def _main_param(self, p):
        """The fp32 copy of model parameter ``p`` the optimizer steps: Float16OptimizerWithFloat16Params'
        main param under bf16 (``fp32_from_float16_groups``, paired with ``float16_groups``), ``p``
        itself in fp32. Under bf16 it holds the bits the bf16 weights are rounded from."""
        for mo in self._megatron_optimizers():
            groups = zip(getattr(mo, "float16_groups", []), getattr(mo, "fp32_from_float16_groups", []))
            main = next((b for g16, g32 in groups for a, b in zip(g16, g32) if a is p), None)
            if main is not None:
                return main
        return p

    def _adam_state(self, p) -> dict:
        """The torch AdamW state of model parameter ``p``, on its main copy (:meth:`_main_param`);
        created as AdamW would (zero moments, step 0.0) where no step has run yet."""
        import torch

        main = self._main_param(p)
        for mo in self._megatron_optimizers():
            if any(q is main for g in mo.optimizer.param_groups for q in g["params"]):
                state = mo.optimizer.state[main]
                if "exp_avg" not in state:
                    state.update(
                        step=torch.tensor(0.0), exp_avg=torch.zeros_like(main), exp_avg_sq=torch.zeros_like(main)
                    )
                return state
        raise RuntimeError("a megatron parameter is in none of the optimizer's groups")

    def _gathered(self, value_of) -> Lazy:
        """The canonical tensors of ``value_of`` gathered (a collective) when canonical.write or
        checksum first reaches one of them, and dropped once it has passed them all: weights and
        the two moments are held one group at a time, not together."""
        shapes = self.ctx.job.model.parameter_shapes()
        return Lazy(shapes, whole=lambda: self._gather_canonical(value_of, to_all=False), complete=self.ctx.rank == 0)

    def export_canonical(self):
        if self.opts.distributed_optimizer:  # each data-parallel rank holds slices: put them together
            params = [p for c in self.chunks for p in unwrap(c).parameters()]
            whole, step = megatron_distopt.gather_whole(self._megatron_optimizers(), params)
            weights = self._gathered(lambda _n, p: whole[p]["param"])
            moments = {k: self._gathered(lambda _n, p, k=k: whole[p][k]) for k in MOMENTS}
            return CanonicalState(weights, moments, step)
        # the fp32 main copies, not the bf16 weights rounded from them: a bf16 run resumes exactly
        weights = self._gathered(lambda _n, p: self._main_param(p))
        moments = {k: self._gathered(lambda _n, p, k=k: self._adam_state(p)[k]) for k in MOMENTS}
        steps = {float(self._adam_state(p)["step"]) for c in self.chunks for p in unwrap(c).parameters()}
        if len(steps) != 1:
            raise RuntimeError(f"AdamW step counts differ between parameters: {sorted(steps)}")
        return CanonicalState(weights, moments, int(steps.pop()))

    def import_canonical(self, state):
        """The model's weights came from the canonical ones (``model.weights``), rounded to bf16 under
        bf16, and Megatron's fp32 main copies from those: set the main copies to the canonical fp32
        values, then the AdamW moments and step."""
        import torch

        from parabench.adapters.megatron_mapping import canonical_names, to_megatron

        spec = self.ctx.job.model
        for c, chunk in enumerate(self.chunks):
            params = dict(unwrap(chunk).named_parameters())
            wanted = canonical_names(spec, self.layout, self.stage, c, self.ep_rank)

            def shards(values, c=c, wanted=wanted):  # the full tensors read one at a time as the mapping takes them
                full = view(values, wanted, lambda t: t.numpy() if hasattr(t, "numpy") else t)
                return to_megatron(full, spec, self.layout, self.stage, c, self.tp_rank, self.ep_rank).items()

            if self.opts.distributed_optimizer:  # this rank's slices of the main params and moments
                whole = {"param": dict(shards(state.weights))}
                whole.update({key: dict(shards(values)) for key, values in (state.moments or {}).items()})
                for name, p in params.items():
                    step = None if state.moments is None else state.step
                    values = {key: whole[key][name] for key in whole}
                    megatron_distopt.put_piece(self._megatron_optimizers(), p, values, step)
                continue
            mains = {n: self._main_param(p) for n, p in params.items()}
            if any(mains[n] is not p for n, p in params.items()):  # bf16: separate fp32 main copies
                for name, value in shards(state.weights):
                    mains[name].data.copy_(torch.from_numpy(value).view_as(mains[name]))
            if state.moments is None:
                continue
            for key, values in state.moments.items():
                for name, value in shards(values):
                    target = self._adam_state(params[name])[key]
                    target.copy_(torch.from_numpy(value).view_as(target))
            for p in params.values():
                self._adam_state(p)["step"] = torch.tensor(float(state.step))
        if state.moments is not None:
            self.steps = state.step
