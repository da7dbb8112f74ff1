"""``bench convert`` on DeepSpeed (the ``CanonicalIO`` role of ``DeepSpeedEngine``, worker side): the
full fp32 weights and AdamW moments of each parameter through DeepSpeed's own accessors, and the
canonical moments and step handed back to its ZeRO partitions.

``DeepSpeedCanonicalIO`` is a mixin of ``DeepSpeedEngine`` (adapters/deepspeed_engine.py): it reads
``ctx``, ``engine`` (DeepSpeed's), ``names``, ``params``, ``_torch`` and the engine's ``_master_for``
and ``_full_weight``.
"""

from __future__ import annotations

from parabench.adapters.base import CanonicalIO
from parabench.canonical import MOMENTS, CanonicalState, Lazy
from parabench.spec import JobSpec


class DeepSpeedCanonicalIO(CanonicalIO):
    """Canonical export and import of a ``DeepSpeedEngine``'s state."""

    # -- bench convert ------------------------------------------------------------------------
    # DeepSpeed's own accessors of the full fp32 optimizer state per parameter (deepspeed.utils
    # safe_get/set_full_optimizer_state; docs/sources.md#canonical-conversion): stage 3 all-gathers
    # its partitions (exact); stage 1/2 fragments are gathered bit-exactly (gather_hp_fragments).
    def _basic_optimizer(self):
        opt = self.engine.optimizer
        return getattr(opt, "optimizer", opt)  # ZeRO wraps the client AdamW

    def _full_moment(self, p, key: str):
        from deepspeed.utils import safe_get_full_optimizer_state

        if hasattr(p, "ds_id"):
            full = safe_get_full_optimizer_state(p, key)
        elif hasattr(p, "_hp_mapping"):
            full = gather_hp_fragments(p, key)
        else:  # no ZeRO: the client AdamW's own state, on the fp32 master where there is one
            master = self._master_for(p)
            full = self._basic_optimizer().state[p if master is None else master][key]
        return full.detach().float().cpu().reshape(full_shape(p)).clone()

    def export_canonical(self):
        """One parameter's weight or moment at a time, gathered when canonical.write (or checksum)
        reaches it, in the same order on every rank: a conversion holds one full tensor, not the model."""
        no_moe_conversion(self.ctx.job)
        self._link_optimizer_fragments()
        params = dict(zip(self.names, self.params))
        shapes = {n: tuple(full_shape(p)) for n, p in params.items()}
        weights = Lazy(shapes, lambda n: self._full_weight(params[n]))
        moments = {k: Lazy(shapes, lambda n, k=k: self._full_moment(params[n], k)) for k in MOMENTS}
        steps = {float(s["step"]) for s in self._basic_optimizer().state.values() if "step" in s}
        if len(steps) > 1:
            raise RuntimeError(f"AdamW step counts differ between parameter groups: {sorted(steps)}")
        return CanonicalState(weights, moments, int(steps.pop()) if steps else 0)

    def _ensure_optimizer_state(self) -> None:
        """torch's AdamW creates its state at the first step (ZeRO's initialize_optimizer_states no
        longer steps): create it as AdamW would (zero moments, step 0.0 as a CPU float32 tensor;
        torch/optim/adamw.py ``_init_group``) on each flat fp32 partition, and link ZeRO-1/2's
        per-parameter fragments to it as a checkpoint load does (``_link_all_hp_params``)."""
        opt, basic = self.engine.optimizer, self._basic_optimizer()
        flats = getattr(opt, "fp32_partitioned_groups_flat", None)  # stage 3
        if flats is None:
            flats = getattr(opt, "single_partition_of_fp32_groups", None) or []  # stage 1/2
        torch = self._torch
        for flat in flats:
            if "exp_avg" not in basic.state.get(flat, {}):
                basic.state[flat] = {
                    "step": torch.tensor(0.0, dtype=torch.float32),
                    "exp_avg": torch.zeros_like(flat, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(flat, memory_format=torch.preserve_format),
                }
        self._link_optimizer_fragments()

    def _link_optimizer_fragments(self) -> None:
        """ZeRO-1/2 link each parameter's view of the AdamW state only at the next step
        (``_lazy_init_hp_params_optimizer_state``); after a load or a fresh state, link them now."""
        opt = self.engine.optimizer
        if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
            opt._hp_optimizer_states_linked = False
            opt._lazy_init_hp_params_optimizer_state()

    def import_canonical(self, state):
        from deepspeed.utils import safe_set_full_optimizer_state

        no_moe_conversion(self.ctx.job)
        if state.moments is None:
            return  # weights only: AdamW starts fresh, as in a new run
        self._ensure_optimizer_state()
        dev = self.ctx.device.torch_device
        for name, p in zip(self.names, self.params):
            for key, values in state.moments.items():
                value = values[name].to(dev)
                if hasattr(p, "ds_id") or hasattr(p, "_hp_mapping"):
                    safe_set_full_optimizer_state(p, value, key)
                else:
                    master = self._master_for(p)
                    target = self._basic_optimizer().state[p if master is None else master][key]
                    target.copy_(value.view_as(target))
        for entry in self._basic_optimizer().state.values():
            if "step" in entry:
                old = entry["step"]
                entry["step"] = (
                    self._torch.tensor(float(state.step), dtype=old.dtype) if hasattr(old, "dtype") else state.step
                )
        self.engine.global_steps = state.step  # the checkpoint tag (global_step<N>) and DeepSpeed's counters
        self.engine.global_samples = state.step * self.engine.train_batch_size()


def no_moe_conversion(job: JobSpec) -> None:
    if job.model.is_moe:
        raise RuntimeError(
            "deepspeed: bench convert of a DeepSpeed-MoE model (its experts) is not mapped yet (docs/moe.md)"
        )


def gather_hp_fragments(param, optim_state_key: str | None = None):
    """The full fp32 master (or, with ``optim_state_key``, its AdamW moment) of a stage-1/2 (or
    BF16_Optimizer) parameter, bit-exact.

    DeepSpeed's ``safe_get_full_fp32_param`` sums zero-padded fragments with an all-reduce, which
    turns -0.0 into +0.0 (the canonical init has a few) and so changes the weights checksum. Summing
    the fragments' bit patterns as int32 instead is exact: every element is owned by one rank."""
    import torch
    import torch.distributed as dist

    mapping = param._hp_mapping
    buf = torch.zeros(param.numel(), dtype=torch.int32, device=param.device)
    if mapping is not None:  # None: no part of this parameter lives in this rank's partition
        address = mapping.lp_fragment_address
        fragment = mapping.get_hp_fragment(optim_state_key).detach().float().contiguous().view(torch.int32).flatten()
        buf.narrow(0, address.start, address.numel).copy_(fragment)
    dist.all_reduce(buf, group=param._dp_group)
    return buf.view(torch.float32).view(param.shape)


def full_shape(p):
    """A parameter's full shape (ZeRO-3 keeps it in ``ds_shape``; the tensor itself is empty)."""
    return p.ds_shape if hasattr(p, "ds_shape") else p.shape
