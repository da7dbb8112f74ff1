"""One rank of DeepSpeed (the backend's declarations: parabench.adapters.deepspeed). Imported by the
worker processes only, so that the ``bench`` parent, which checks a job against the adapter's
declarations, never imports torch.

``DeepSpeedEngine`` steps, accounts and checkpoints (DeepSpeed's own ``save_checkpoint`` layout) here;
``bench convert``'s canonical export and import is ``deepspeed_canonical_io.DeepSpeedCanonicalIO``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import torch

from parabench.adapters.base import Checkpointing, Engine, ModelStateBytes, WorkerContext, torch_compile_as_identity
from parabench.adapters.deepspeed_canonical_io import DeepSpeedCanonicalIO, full_shape, gather_hp_fragments
from parabench.adapters.deepspeed_config import deepspeed_config, extensions_dir
from parabench.adapters.deepspeed_moe import all_to_all_bytes, gather_full_state, group_name, swap_blocks
from parabench.adapters.deepspeed_states import bytes_per, optimizer_formula, sharded_psi
from parabench.metrics import held_bytes, optimizer_state_tensors
from parabench.spec import JobSpec

MUON = "deepspeed.runtime.zero.muon.muon_optimizer"  # in 0.19.8 (tested); older releases may lack it


def import_deepspeed():
    """``import deepspeed`` without the ``import mlflow`` it makes: DeepSpeed's package import reaches
    its autotuner (deepspeed/__init__ -> runtime.config -> autotuning/autotuner.py), which tries
    ``import mlflow`` to log `deepspeed --autotuning` trials - 3.7 CPU-seconds of every rank here when
    MLflow is installed, as it is beside parabench. The workers never autotune: mlflow is made
    unimportable for the duration of this import (its ``try`` then sets ``has_mlflow = False``) and
    importable again after. ``torch.compile`` is the identity during the import too
    (adapters.base.torch_compile_as_identity) and for the Muon optimizer's module, which ZeRO's
    optimizers import on their first step (``isinstance(optimizer, MuonWithAuxAdam)``) and which
    compiles three helpers at import: that imported Inductor, 2.2 CPU-s a rank. parabench's optimizer
    is its own AdamW: the helpers are never called.
    A process that already holds mlflow or deepspeed imports as usual."""
    import sys

    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        import deepspeed

        return deepspeed

    sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import mlflow` raises ImportError
    try:
        with torch_compile_as_identity(torch):
            import deepspeed

            if importlib.util.find_spec(MUON) is not None:  # ZeRO's steps import it; it compiles at import
                importlib.import_module(MUON)
    finally:
        if "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]
    return deepspeed


class DeepSpeedEngine(DeepSpeedCanonicalIO, Checkpointing, Engine):
    def __init__(self, ctx: WorkerContext):

        deepspeed = import_deepspeed()

        from parabench.adapters.torch_common import adamw_param_groups, count_routed_tokens, make_adamw
        from parabench.model import build_llama, initial_weights, set_activation_checkpointing

        self.ctx = ctx
        job, o = ctx.job, ctx.job.backend.options
        _clear_stale_build_locks(
            Path(os.environ.get("TORCH_EXTENSIONS_DIR", extensions_dir(job))), job.launch.hang_timeout_s
        )
        self.config = deepspeed_config(job)
        _world_clone_with_timeout(job)
        model = build_llama(job.model, seed=job.run.seed).to(ctx.device.torch_device)
        self.ep_rank = _expert_parallel(model, job) if job.model.is_moe else 0
        set_activation_checkpointing(model, o.activation_checkpointing)
        named = list(model.named_parameters())
        if o.offload_optimizer != "none" and o.offload_adam == "cpu_adam":
            from deepspeed.ops.adam import DeepSpeedCPUAdam  # JIT-builds cpu_adam once (cached)

            spec = job.optim
            optimizer = DeepSpeedCPUAdam(
                adamw_param_groups(named, spec), lr=spec.lr, betas=spec.betas, eps=spec.eps, adamw_mode=True
            )
        elif job.model.is_moe:
            optimizer = _moe_adamw(named, job.optim)
        else:
            optimizer = make_adamw(named, job.optim)
        self.client_optimizer = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=self.config)
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.routed = count_routed_tokens(model, job.model, ctx.device.torch_device)
        self.moe_blocks = [layer.block_sparse_moe for layer in model.model.layers] if job.model.is_moe else []
        self.all_to_all_formula: list[int] = []  # MoE, ep > 1: bytes per step by formula (deepspeed_moe)
        self.gas = job.grad_accum
        if job.run.precision != "fp32":
            # DeepSpeed casts the model to bf16/fp16 and derives its fp32 masters from those copies;
            # put the canonical fp32 values back so every backend starts from the same weights.
            self._set_fp32_masters(initial_weights(job.model, job.run.seed))
        self._grad_snapshot: dict[str, int] | None = None
        self._steps = 0
        self._torch = torch

    # -- training ---------------------------------------------------------------------------
    def train_step(self, micro_batches):
        from parabench.model import training_loss

        n = len(micro_batches)
        if n != self.gas:
            raise RuntimeError(f"{n} micro-batches but gradient_accumulation_steps={self.gas}")
        total = self._torch.zeros((), device=self.ctx.device.torch_device)
        first, self._steps = self._steps == 0, self._steps + 1
        for inputs, targets in micro_batches:
            loss = training_loss(self.engine, self.ctx.job.model, inputs, targets)  # MoE: + coef x aux loss
            self.engine.backward(loss)  # scales by 1/gradient_accumulation_steps itself
            if first:
                # Gradients held after each micro-batch's backward (DeepSpeed frees them after the
                # step); the most over the micro-batches, taken in the first step only (the layout
                # repeats every step).
                held = self._grad_bytes()
                if self._grad_snapshot is None or held["grads"] > self._grad_snapshot["grads"]:
                    self._grad_snapshot = held
            self.engine.step()  # an optimizer step only at the accumulation boundary
            total += loss.detach() / n
        return total

    # -- weights ----------------------------------------------------------------------------
    def _master_for(self, param):
        """The fp32 master tensor a stage-0 bf16/fp16 optimizer keeps for ``param`` (or None)."""
        opt = self.engine.optimizer
        lp, hp = getattr(opt, "fp16_groups", None), getattr(opt, "fp32_groups", None)
        if lp is None or hp is None:
            return None
        for lg, hg in zip(lp, hp):
            for a, b in zip(lg, hg):
                if a is param:
                    return b
        return None

    def _set_fp32_masters(self, weights) -> None:
        from deepspeed.utils import safe_set_full_fp32_param

        for name, p in zip(self.names, self.params):
            value = torch.from_numpy(weights[name]).to(self.ctx.device.torch_device)
            if hasattr(p, "ds_id") or hasattr(p, "_hp_mapping"):
                safe_set_full_fp32_param(p, value)
            else:
                master = self._master_for(p)
                if master is None:
                    raise RuntimeError(f"no fp32 master found for {name} ({type(self.engine.optimizer).__name__})")
                master.data.copy_(value.view_as(master))

    def full_state_dict(self):
        """Full fp32 weights: the fp32 masters where DeepSpeed keeps them (gathered from the ZeRO
        partitions, a collective), else the parameters themselves (stage 0, fp32). MoE: the experts
        of every expert-parallel rank, under their canonical names (deepspeed_moe.gather_full_state)."""
        if self.ctx.job.model.is_moe:
            job = self.ctx.job
            return gather_full_state(
                self.names, lambda i: self._full_weight(self.params[i]), job.model, job.backend.options.ep, self.ep_rank
            )
        return {name: self._full_weight(p) for name, p in zip(self.names, self.params)}

    def _full_weight(self, p):
        """One parameter's full fp32 weight (collective under ZeRO: every rank calls it)."""
        from deepspeed.utils import safe_get_full_fp32_param

        if hasattr(p, "ds_id"):
            full = safe_get_full_fp32_param(p)  # an all-gather of the stage-3 partitions
        elif hasattr(p, "_hp_mapping"):
            full = gather_hp_fragments(p)  # collective: every rank calls it, fragment or not
        else:
            full = self._master_for(p)
            full = p if full is None else full
        return full.detach().float().cpu().reshape(full_shape(p)).clone()

    # -- checkpoints ------------------------------------------------------------------------
    def save_checkpoint(self, directory: Path, *, async_save: bool = False) -> None:
        """DeepSpeed's own layout: ``<directory>/global_step<N>/`` with the module states
        (``mp_rank_00_model_states.pt``), one ZeRO optimizer partition per rank
        (``*_optim_states.pt``: fp32 masters, Adam moments and step) and ``latest`` naming the tag."""
        if async_save:
            raise RuntimeError(f"deepspeed: {self.ctx.job.backend.adapter.capabilities.checkpoint.async_save}")
        self.engine.save_checkpoint(str(directory))

    def load_checkpoint(self, directory: Path) -> None:
        """Everything save_checkpoint wrote; the working weights come from the fp32 masters
        (``load_from_fp32_weights``, DeepSpeed's default), so a bf16 resume is exact too."""
        path, _ = self.engine.load_checkpoint(
            str(directory), load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if path is None:
            raise RuntimeError(f"deepspeed found no checkpoint in {directory} (no 'latest' tag file)")

    # -- MoE ---------------------------------------------------------------------------------
    def tokens_per_expert(self):
        """Collective, after each step: the canonical count of the router logits each layer returned
        (as ddp counts), summed over the world (every rank routes its own rows before the all-to-all);
        and, with ep > 1, the step's all-to-all bytes by formula from each layer forward's capacity."""
        if self.routed is None:
            return None
        loads = [load for block in self.moe_blocks for load in block.loads]
        for block in self.moe_blocks:
            block.loads.clear()
        job = self.ctx.job
        ep = job.backend.options.ep
        if ep > 1 and loads:
            from deepspeed.utils import groups

            # DeepSpeed's dropless capacity: the most tokens one expert gets from one rank of the group
            most = self._torch.stack(loads)
            self._torch.distributed.all_reduce(
                most, op=self._torch.distributed.ReduceOp.MAX, group=groups._get_expert_parallel_group(group_name(ep))
            )
            self.all_to_all_formula.append(all_to_all_bytes(job.model, most.tolist(), bytes_per(job.run.precision)))
        return self.routed.take(group=None)

    # -- accounting -------------------------------------------------------------------------
    def _grad_bytes(self) -> dict[str, int]:
        opt = self.engine.optimizer
        tensors = [p.grad for p in self.params]
        inner = getattr(opt, "optimizer", None)
        if inner is not None:
            tensors += [p.grad for g in inner.param_groups for p in g["params"]]
        buckets, sources = [], {"grads.param.grad": held_bytes(tensors)}
        for attr, value in vars(opt).items():
            if "grad" not in attr.lower() and "ipg" not in attr.lower():
                continue
            found = [t for t in _tensors(value) if t.dim() > 0]
            if found:
                is_bucket = "ipg" in attr.lower()  # reduce buckets: communication buffers, not gradients
                (buckets if is_bucket else tensors).extend(found)
                sources[f"{'buckets' if is_bucket else 'grads'}.{attr.split('__')[-1]}"] = held_bytes(found)
        return {"grads": held_bytes(tensors), "comm_buckets": held_bytes(buckets), "sources": sources}

    def model_state_bytes(self) -> ModelStateBytes:
        job, o = self.ctx.job, self.ctx.job.backend.options
        opt = self.engine.optimizer
        inner = getattr(opt, "optimizer", opt)
        working = [getattr(p, "ds_tensor", None) for p in self.params] + [p.data for p in self.params]
        params = held_bytes(working)
        param_ptrs = {t.untyped_storage().data_ptr() for t in working if t is not None and t.numel()}
        # The fp32 masters are the tensors the wrapped optimizer steps: its state keys (ZeRO-3 empties
        # its param_groups between steps) and param groups; stage-0 fp32 steps the parameters themselves.
        candidates = list(inner.state.keys()) + [p for g in inner.param_groups for p in g["params"]]
        masters, seen = [], set()
        for t in candidates:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in param_ptrs and id(t) not in seen:
                seen.add(id(t))
                masters.append(t)
        moments, other = optimizer_state_tensors([inner])
        master_bytes, moment_bytes = held_bytes(masters), held_bytes(moments)
        master_elements = sum(p.numel() for p in masters)
        nd = job.parallel.dp
        snap = self._grad_snapshot or self._grad_bytes()
        detail = {
            "fp32_master_bytes": master_bytes,
            "adam_moment_bytes": moment_bytes,
            "fp32_master_elements": master_elements,
            "optimizer_formula_bytes": int(optimizer_formula(job)),
            "comm_bucket_bytes": snap["comm_buckets"],
            **{k: v for k, v in snap.get("sources", {}).items() if v},  # where the gradient bytes live
        }
        if o.zero_stage >= 1:
            # DeepSpeed pads each flat group so that it splits evenly (and aligned) over Nd ranks
            # (MoE: the experts' groups over the Nd / ep expert-data-parallel ranks; x Nd as if every
            # rank padded alike)
            detail["padding_elements"] = round((master_elements - sharded_psi(job)[1]) * nd)
        if o.zero_stage == 3:
            persistent = [p.data for p in self.params if getattr(p, "ds_persist", False)]
            detail["zero3_persistent_param_bytes"] = held_bytes(persistent)
            detail["zero3_persistent_params"] = len(persistent)
        host = 0
        if o.offload_optimizer != "none":
            host += master_bytes + moment_bytes
        if o.offload_param != "none":
            host += held_bytes(getattr(p, "ds_tensor", None) for p in self.params)
        return ModelStateBytes(
            params=params,
            grads=snap["grads"],
            optimizer=master_bytes + moment_bytes,
            optimizer_other=held_bytes(other),
            host=host,
            detail=detail,
        )

    def extra_metrics(self) -> dict[str, float]:
        ms = self.model_state_bytes()
        out = {
            f"zero.rank{self.ctx.rank}.optimizer_minus_formula_bytes": ms.optimizer
            - ms.detail["optimizer_formula_bytes"]
        }
        if "padding_elements" in ms.detail:
            out["zero.padding_elements"] = ms.detail["padding_elements"]
        measured = self.all_to_all_formula[self.ctx.job.run.warmup_steps :]
        if measured:  # MoE, ep > 1: read by parabench.run.comm_report beside the measured all-to-all bytes
            out[f"moe.rank{self.ctx.rank}.all_to_all_formula_bytes"] = sum(measured) / len(measured)
        return out

    def artifacts(self) -> dict[str, Any]:
        import deepspeed

        zc = self.engine._config.zero_config
        return {
            "deepspeed_config": self.config,
            "config_file": self.ctx.job.backend.options.config_file,
            "zero_config_resolved": json.loads(zc.model_dump_json()) if hasattr(zc, "model_dump_json") else str(zc),
            "client_optimizer": self.client_optimizer,
            "deepspeed_optimizer": type(self.engine.optimizer).__name__,
            "deepspeed_version": deepspeed.__version__,
            "torch_extensions_dir": os.environ.get("TORCH_EXTENSIONS_DIR"),
        }


def _expert_parallel(model, job: JobSpec) -> int:
    """DeepSpeed's expert-parallel groups of ``backend.ep`` ranks (made now, as DeepSpeed-MoE would
    at ``deepspeed.initialize``, to know this rank's experts), then every layer's canonical block
    swapped for DeepSpeed's MoE layer holding them. Returns this rank's expert-parallel rank."""
    from deepspeed import comm
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import groups

    ep = job.backend.options.ep
    comm.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    if group_name(ep) not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(ep)
    ep_rank = groups._get_expert_parallel_rank(group_name(ep))
    swap_blocks(model, job.model, ep, ep_rank)
    return ep_rank


def _moe_adamw(named, spec):
    """The harness's AdamW groups, named, with the experts moved into DeepSpeed's MoE groups (ZeRO
    partitions those over the expert-data-parallel ranks): DeepSpeed's own
    ``split_params_into_different_moe_groups_for_optimizer``."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    from parabench.adapters.torch_common import adamw_param_groups

    groups = adamw_param_groups(named, spec)
    for group, name in zip(groups, ("decay", "no_decay"), strict=True):
        group["name"] = name
    groups = split_params_into_different_moe_groups_for_optimizer(groups)
    return torch.optim.AdamW(groups, lr=spec.lr, betas=spec.betas, eps=spec.eps)


def _world_clone_with_timeout(job: JobSpec) -> None:
    """Make DeepSpeed's clone of the world group with ``launcher.collective_timeout_s``.

    Without a model-parallel unit, ZeRO reduces gradients and gathers parameters on the group
    ``deepspeed.utils.groups._clone_world_group()`` creates with ``dist.new_group(ranks)``: no
    timeout, so torch's 30-minute default, not the job's. Measured (2 gloo ranks, ZeRO-2, rank 1 hung
    before step 5): rank 0 waited in ZeRO's reduction until the runner's hang watchdog killed the
    job, FAILED, instead of failing the collective and being restarted. DeepSpeed has no setting for
    that group's timeout; create the clone it would create (same ranks), with the timeout, first.
    Sources: deepspeed/utils/groups.py (``_clone_world_group``, ``_get_data_parallel_group``) in
    deepspeed 0.19.8; torch/distributed/distributed_c10d.py (``new_group`` with
    ``timeout=None`` takes ``_get_default_timeout``: 30 minutes but for NCCL's 10) in torch 2.13."""
    import datetime

    import torch.distributed as dist
    from deepspeed.utils import groups

    if getattr(groups, "_WORLD_GROUP", None) is None:
        timeout = datetime.timedelta(seconds=job.launch.collective_timeout_s)
        groups._WORLD_GROUP = dist.new_group(ranks=list(range(dist.get_world_size())), timeout=timeout)


def _clear_stale_build_locks(root: Path, max_age_s: float) -> None:
    """Remove JIT-build lock files left by a killed build. torch's build baton waits forever on a
    lock file; one older than the runner's hang watchdog belongs to a run that was killed."""
    import time

    for lock in root.glob("*/lock") if root.is_dir() else []:
        try:
            age = time.time() - lock.stat().st_mtime
            if age > max_age_s:
                lock.unlink()
                print(f"[parabench deepspeed] removed a stale build lock {lock} ({age:.0f} s old)", flush=True)
        except FileNotFoundError:
            pass


def _tensors(value, depth: int = 0):
    """Tensors inside an attribute value (tensor, list/tuple, dict, dataclass; up to three levels)."""
    if hasattr(value, "untyped_storage"):
        yield value
    elif depth < 3 and isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v, depth + 1)
    elif depth < 3 and isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v, depth + 1)
    elif depth < 3 and hasattr(value, "__dataclass_fields__"):  # e.g. the stage-1/2 IPGBucket
        for v in vars(value).values():
            yield from _tensors(v, depth + 1)
