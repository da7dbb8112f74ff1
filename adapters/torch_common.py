"""Pieces shared by the adapters that train the canonical torch Llama directly (ddp, fsdp)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence

import torch

from parabench import untrusted
from parabench.adapters.base import CanonicalIO, Checkpointing, Engine, ModelStateBytes, WorkerContext
from parabench.canonical import MOMENTS, CanonicalState
from parabench.expertload import RoutedTokens
from parabench.metrics import torch_model_state
from parabench.model import DecoderLayer, decay_mask, route, training_loss
from parabench.spec import ModelSpec, OptimSpec


def adamw_param_groups(named_params: Sequence[tuple[str, torch.nn.Parameter]], spec: OptimSpec) -> list[dict]:
    """The two AdamW parameter groups: decay on 2-D weights (``decay_mask``), none on the rest."""
    decay = [p for n, p in named_params if decay_mask(n, p)]
    no_decay = [p for n, p in named_params if not decay_mask(n, p)]
    return [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def make_adamw(named_params: Sequence[tuple[str, torch.nn.Parameter]], spec: OptimSpec) -> torch.optim.AdamW:
    """torch.optim.AdamW with decay on 2-D weights only; the same algorithm every backend uses."""
    return torch.optim.AdamW(adamw_param_groups(named_params, spec), lr=spec.lr, betas=spec.betas, eps=spec.eps)


def dcp_failure(exc) -> str:
    """One line from DCP's CheckpointException: the first failing rank and its error."""
    rank, (error, _tb) = next(iter(sorted(exc.failures.items(), key=lambda kv: kv[0])))
    return f"rank {rank}: {type(error).__name__}: {error}"


def count_routed_tokens(model: torch.nn.Module, spec: ModelSpec, device) -> RoutedTokens | None:
    """Count each MoE layer's routed tokens (parabench.expertload) through a forward hook on every
    decoder layer of this engine's model (its own instance: nothing else is patched), from the router
    logits the layer returns, routed as the block routes them (``parabench.model.route``). Under
    activation checkpointing the recompute calls the layer's inner forward, not the module: once per
    forward. None for a dense model."""
    if not spec.is_moe:
        return None
    routed = RoutedTokens(spec.num_hidden_layers, spec.num_local_experts, device)
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    for index, layer in enumerate(layers):

        def hook(_module, _inputs, output, index=index):
            _, top_experts = route(output[1].detach(), spec.num_experts_per_tok)
            routed.add_top_k(index, top_experts)

        layer.register_forward_hook(hook)
    return routed


class TorchEngine(Engine, Checkpointing, CanonicalIO):
    """Gradient accumulation over micro-batches, global-norm clipping, AdamW step.

    ``sync_context(last)`` is entered around each micro-batch's forward/backward: backends use it to
    skip gradient communication on all but the last micro-batch (DDP no_sync, FSDP2 requires_grad_sync).
    """

    def __init__(
        self,
        ctx: WorkerContext,
        model: torch.nn.Module,
        named_params: Sequence[tuple[str, torch.nn.Parameter]],
        sync_context: Callable[[bool], contextlib.AbstractContextManager],
        autocast_dtype: torch.dtype | None,
    ):
        self.ctx = ctx
        self.model = model
        self.named_params = list(named_params)
        self.params = [p for _, p in self.named_params]
        self.optimizer = make_adamw(self.named_params, ctx.job.optim)
        self.sync_context = sync_context
        device_type = torch.device(ctx.device.torch_device).type
        self.autocast = (
            (lambda: torch.autocast(device_type, dtype=autocast_dtype)) if autocast_dtype else contextlib.nullcontext
        )
        self.routed = count_routed_tokens(model, ctx.job.model, ctx.device.torch_device)

    def train_step(self, micro_batches):
        n = len(micro_batches)
        total = torch.zeros((), device=self.ctx.device.torch_device)
        for i, (inputs, targets) in enumerate(micro_batches):
            with self.sync_context(i == n - 1):
                with self.autocast():
                    loss = training_loss(self.model, self.ctx.job.model, inputs, targets) / n
                loss.backward()
            total += loss.detach()
        if self.ctx.job.optim.grad_clip > 0:
            self.clip_gradients(self.ctx.job.optim.grad_clip)
        self.optimizer.step()
        # Keep gradient buffers allocated (as DDP buckets and DeepSpeed do): memory stays steady
        # and the model-state accounting sees the gradients a rank really holds.
        self.optimizer.zero_grad(set_to_none=False)
        return total

    def tokens_per_expert(self):
        if self.routed is None:
            return None
        # every rank of ddp and fsdp is a data-parallel rank that routes rows of its own (fsdp's tensor
        # parallelism, whose tp ranks share rows, is refused with a MoE model before launch): the sum
        # over the world counts each token once
        return self.routed.take(group=None)

    def clip_gradients(self, max_norm: float) -> None:
        """Scale the gradients to a global L2 norm of at most ``max_norm`` (over every rank's shard)."""
        torch.nn.utils.clip_grad_norm_(self.params, max_norm)

    def model_state_bytes(self) -> ModelStateBytes:
        return torch_model_state(self.params, self.optimizer)

    # -- checkpoints: torch.distributed.checkpoint (DCP) ------------------------------------------
    # get_state_dict/set_state_dict give the model and optimizer state under the unwrapped module's
    # names (no DDP "module." prefix; FSDP2 parameters as DTensors), so one format serves ddp and
    # fsdp at any world size: DCP reshards on load (docs/sources.md#dcp).
    def _dcp_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def save_checkpoint(self, directory, *, async_save=False):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        state = self._dcp_state()
        if not async_save:
            try:
                dcp.save(state, checkpoint_id=str(directory))
            except CheckpointException as exc:  # a BaseException carrying each failed rank's error
                raise OSError(dcp_failure(exc)) from None
            return
        self._done_at = None
        self._pending = dcp.async_save(state, checkpoint_id=str(directory))
        self._pending.add_done_callback(lambda _f: setattr(self, "_done_at", time.perf_counter()))

    def finish_checkpoint(self):
        from torch.distributed.checkpoint.api import CheckpointException

        pending, self._pending = getattr(self, "_pending", None), None
        if pending is None:
            return None
        try:
            pending.result()  # re-raises a failed background write
        except CheckpointException as exc:
            raise OSError(dcp_failure(exc)) from None
        return self._done_at or time.perf_counter()

    def load_checkpoint(self, directory):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._dcp_state()
        trusted = (
            self.ctx.job.run.trust_checkpoint
        )  # else metadata and non-tensor items are checked (parabench.untrusted)
        reader, planner = untrusted.dcp_reader(directory, trusted), untrusted.dcp_planner(directory, trusted)
        try:
            dcp.load(state, storage_reader=reader, planner=planner)
        except CheckpointException as exc:
            raise OSError(dcp_failure(exc)) from None
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    # -- bench convert: the canonical state through torch.distributed.checkpoint.state_dict ----------
    # The full (unsharded) optimizer state dict under the unwrapped module's names, which are the
    # canonical names: DDP's replicated tensors as they are, FSDP2's DTensor shards all-gathered
    # (set_* scatters them back); docs/sources.md#canonical-conversion.
    def export_canonical(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        weights = self.full_state_dict()
        optim = get_optimizer_state_dict(self.model, self.optimizer, options=StateDictOptions(full_state_dict=True))
        state = optim["state"]
        moments = {k: {n: state[n][k].detach().float().cpu().clone() for n in weights} for k in MOMENTS}
        steps = {float(state[n]["step"]) for n in weights}
        if len(steps) != 1:
            raise RuntimeError(f"AdamW step counts differ between parameters: {sorted(steps)}")
        return CanonicalState(weights, moments, int(steps.pop()))

    def import_canonical(self, state):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        if state.moments is None:
            return  # weights only (e.g. from Hugging Face): AdamW starts fresh, as in a new run
        options = StateDictOptions(full_state_dict=True)
        optim = get_optimizer_state_dict(self.model, self.optimizer, options=options)  # initialises the state
        for name, entry in optim["state"].items():
            for key in entry:
                if key == "step":
                    entry[key] = torch.tensor(float(state.step), dtype=entry[key].dtype)
                else:
                    entry[key] = state.moments[key][name].to(entry[key].device, entry[key].dtype)
        set_optimizer_state_dict(self.model, self.optimizer, optim_state_dict=optim, options=options)
