"""Building Megatron-Core's side of one rank (the construction half of ``MegatronEngine``, worker side):
parallel state, the TransformerConfig of the canonical Llama (its recompute and MoE fields), the model
chunks holding the canonical weights' shards, Megatron's DDP and optimizer, the schedules, and the
instrumentation the engine's metrics read (``Counters``). megatron-core is imported inside the functions.

``MegatronBuild`` is a mixin of ``MegatronEngine`` (adapters/megatron_engine.py): it sets ``ps``,
``chunks``, ``config``, ``optimizer``, ``forward_backward``, ``layout``, ``stage``, ``tp_rank``,
``ep_rank`` and reads ``ctx``, ``opts``, ``device_type``, ``counters`` the engine set.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

from parabench.adapters.megatron_compat import (
    adamw_options,
    build_chunk,
    define_router_gemm_without_te,
    num_layers_to_build,
    patch_fp8_fallback,
)
from parabench.spec import JobSpec, ModelSpec

if TYPE_CHECKING:  # pragma: no cover
    from parabench.adapters.megatron import MegatronOptions


def megatron_layout(job: JobSpec, te_names: bool = False):
    from parabench.adapters.megatron_mapping import Layout

    o = job.backend.options
    return Layout(tp=o.tp, pp=o.pp, vpp=o.vpp, te_names=te_names, ep=o.ep)


def recompute_settings(o: MegatronOptions) -> dict[str, Any]:
    """TransformerConfig's recompute fields for these options: full without a method or a layer count
    recomputes every layer on its own (uniform, units of 1 layer); megatron-core itself requires both."""
    if o.recompute_granularity != "full":
        return {"recompute_granularity": o.recompute_granularity}
    return {
        "recompute_granularity": "full",
        "recompute_method": o.recompute_method or "uniform",
        "recompute_num_layers": 1 if o.recompute_num_layers is None else o.recompute_num_layers,
    }


class Counters:
    """Scoped, reversible instrumentation: TP collectives and schedule compute time."""

    def __init__(self, tp_group: Any = None):
        self.tp_group = tp_group
        self.tp_calls = 0
        self.tp_bytes = 0
        self.compute_s = 0.0
        self.active = False  # count only inside train_step (not the checksum's gathers)
        self._undo: list = []

    def patch(self, obj: Any, name: str, make) -> None:
        old = getattr(obj, name)
        setattr(obj, name, make(old))
        self._undo.append(lambda: setattr(obj, name, old))

    def define(self, obj: Any, name: str, value: Any) -> None:
        """Give ``obj`` an attribute it lacks, removed again by restore()."""
        setattr(obj, name, value)
        self._undo.append(lambda: delattr(obj, name))

    def collective(self, fn):
        def counted(tensor, *args, **kwargs):
            group = kwargs.get("group")
            if group is None:
                group = next(
                    (a for a in args if a is not None and hasattr(a, "size") and not hasattr(a, "dtype")), None
                )
            if self.active and group is self.tp_group:
                self.tp_calls += 1
                t = tensor[0] if isinstance(tensor, (list, tuple)) else tensor
                self.tp_bytes += (
                    t.numel() * t.element_size() * (len(tensor) if isinstance(tensor, (list, tuple)) else 1)
                )
            return fn(tensor, *args, **kwargs)

        return counted

    def timed(self, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.compute_s += time.perf_counter() - t0

        return wrapper

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()


def moe_config(spec: ModelSpec, opts: MegatronOptions) -> dict:
    """The canonical MoE block as megatron-core's MoELayer (docs/moe.md#megatron): top-k over the
    logits then softmax over the k (= Mixtral's softmax, top-k, renormalised), or with
    ``norm_topk_prob: false`` moe_router_pre_softmax, the softmax over all experts then top-k, not
    renormalised (megatron-core 0.16 moe/moe_utils.py ``topk_routing_with_score_function``: no
    scaling factor, Qwen2-MoE's weights); dropless (no capacity factor), SequentialMLP experts (no
    grouped GEMM kernel on a CPU). Megatron's own
    load-balancing loss is off: it is computed per layer and divided by top-k (moe_utils.
    switch_load_balancing_loss_func), not Mixtral's over all layers' tokens together, so the
    engine adds the canonical one to the loss (:meth:`MegatronEngine._aux_loss`)."""
    if not spec.is_moe:
        return {}
    return {
        "num_moe_experts": spec.num_local_experts,
        "moe_router_topk": spec.num_experts_per_tok,
        "moe_ffn_hidden_size": spec.expert_intermediate_size,
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not spec.norm_topk_prob,
        "moe_expert_capacity_factor": None,
        "moe_grouped_gemm": False,
        "moe_token_dispatcher_type": opts.moe_token_dispatcher,
        # also on the config, not only in parallel_state: the expert linears read it to mark their
        # weights expert-parallel (allreduce=False); unset, Megatron's DDP broadcast rank 0's
        # experts over the dp group at start and all-reduced expert grads across the ep ranks
        "expert_model_parallel_size": opts.ep,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        # Qwen2-MoE's shared expert: SharedExpertMLP (moe/shared_experts.py) with its sigmoid gate
        "moe_shared_expert_intermediate_size": spec.shared_expert_intermediate_size or None,
        "moe_shared_expert_gate": bool(spec.shared_expert_intermediate_size),
    }


def _mark_tensor_parallel(model) -> None:
    """Give every tensor-parallel weight the marks Megatron's own init sets
    (``set_tensor_model_parallel_attributes``), which ``perform_initialization=False`` skips
    (docs/sources.md#megatron-tensor-parallel-marks). Unmarked, ``param_is_not_tensor_parallel_duplicate``
    counts the shards of tp rank 0 only in the gradient norm: with tp=2 it was the true norm / sqrt(2),
    so ``optim.grad_clip`` let through sqrt(2) x the clipped gradient, and AdamW's moments had twice
    the scale (squared) of a tp=1 run's (a tp=2 -> tp=1 resume then went wrong)."""
    from megatron.core.tensor_parallel import layers

    dims = {layers.ColumnParallelLinear: 0, layers.VocabParallelEmbedding: 0, layers.RowParallelLinear: 1}
    for module in model.modules():
        mode = {"column": 0, "row": 1}.get(getattr(module, "parallel_mode", None))  # Transformer Engine layers
        dim = next((d for cls, d in dims.items() if isinstance(module, cls)), mode)
        weight = getattr(module, "weight", None)
        if dim is not None and weight is not None and not getattr(weight, "tensor_model_parallel", False):
            layers.set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=1)


def _sequence_parallel_rmsnorm():
    import torch

    class SequenceParallelRMSNorm(torch.nn.RMSNorm):
        """torch RMSNorm whose weight is marked for the TP all-reduce of sequence-parallel grads."""

        def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_ignored):
            super().__init__(hidden_size, eps=eps)
            self.weight.sequence_parallel = bool(config.sequence_parallel)

    return SequenceParallelRMSNorm


def unwrap(module):
    while hasattr(module, "module"):
        module = module.module
    return module


class MegatronBuild:
    """The construction of a ``MegatronEngine`` (called from its ``__init__``)."""

    def _build(self, torch) -> None:
        o = self.opts
        ps = self._init_parallel_state(torch)
        bf16 = self.ctx.job.run.precision == "bf16"
        dtype = torch.bfloat16 if bf16 else torch.float32
        use_te = self._use_te()
        config = self._transformer_config(dtype, use_te)
        self.config = config
        layer_spec = self._layer_spec(use_te, config)

        chunks = self._build_chunks(torch, ps, config, layer_spec, use_te)
        self.chunks = self._wrap_ddp(chunks, config)
        self._build_optimizer(dtype)
        self.forward_backward = self._wire_schedules(config)
        self.counters.tp_group = ps.get_tensor_model_parallel_group()
        self._instrument()
        if o.distributed_optimizer:
            patch_fp8_fallback(self.counters.patch)  # 0.12 without Transformer Engine
        self.steps = 0
        self.schedule_s = 0.0

    def _build_chunks(self, torch, ps, config, layer_spec, use_te: bool) -> list:
        """This rank's model chunks (one per virtual stage) as megatron-core GPTModels holding the
        canonical weights' shards, on the device (wrapped for bf16)."""
        from megatron.core.models.gpt.gpt_model import GPTModel

        job, o, spec = self.ctx.job, self.opts, self.ctx.job.model
        bf16 = job.run.precision == "bf16"
        chunks = []
        stage = ps.get_pipeline_model_parallel_rank()
        tp_rank = ps.get_tensor_model_parallel_rank()
        self.ep_rank = ps.get_expert_model_parallel_rank()
        layout = megatron_layout(job, te_names=use_te)
        self.layout, self.stage, self.tp_rank = layout, stage, tp_rank
        self._router_logits: list = []  # this micro-batch's router logits per MoE layer (the aux loss)
        self._aux_sends: list = []  # pp > 1: (request, tensor) of the router statistics sent this step
        self.routed = None  # MoE: tokens per expert of this step (parabench.expertload)
        for c in range(o.vpp):
            vp_stage = c if o.vpp > 1 else None
            model = build_chunk(
                GPTModel,
                ps,
                vp_stage,
                config=config,
                transformer_layer_spec=layer_spec(vp_stage),
                vocab_size=spec.vocab_size,
                max_sequence_length=job.data.seq_len,
                pre_process=layout.is_first(stage, c),
                post_process=layout.is_last(stage, c),
                share_embeddings_and_output_weights=spec.tie_word_embeddings,
                position_embedding_type="rope",
                rotary_percent=1.0,
                rotary_base=spec.rope_theta,
            )
            self._load_canonical(model, c)
            model.to(torch.cuda.current_device())
            if bf16:
                from megatron.core.transformer.module import Float16Module

                model = Float16Module(config, model)
            chunks.append(model)
        return chunks

    def _build_optimizer(self, dtype) -> None:
        """megatron-core's Adam (AdamW semantics) over the chunks, constant LR, weight decay per group."""
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        o = self.opts
        bf16 = self.ctx.job.run.precision == "bf16"
        opt = self.ctx.job.optim
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=opt.lr,
                min_lr=opt.lr,
                weight_decay=opt.weight_decay,
                adam_beta1=opt.betas[0],
                adam_beta2=opt.betas[1],
                adam_eps=opt.eps,
                clip_grad=opt.grad_clip,
                bf16=bf16,
                params_dtype=dtype,
                use_distributed_optimizer=o.distributed_optimizer,
                **adamw_options(OptimizerConfig),
            ),
            self.chunks,
        )
        for group in self.param_groups():
            # Megatron's LR scheduler applies wd_mult (0 for 1-D params); we run a constant LR, no scheduler.
            group["weight_decay"] = opt.weight_decay * group.get("wd_mult", 1.0)
            group["lr"] = opt.lr * group.get("lr_mult", 1.0)

    def _load_canonical(self, model, chunk: int) -> None:
        """Model chunk ``chunk``'s canonical initial weights, mapped onto this tp/ep rank's shards, and
        the marks and MoE hooks Megatron's own initialisation would have left."""
        from parabench.adapters.megatron_mapping import canonical_names, to_megatron
        from parabench.model import initial_weights

        job, spec, layout = self.ctx.job, self.ctx.job.model, self.layout
        canonical = initial_weights(spec, job.run.seed, canonical_names(spec, layout, self.stage, chunk, self.ep_rank))
        self._load(model, to_megatron(canonical, spec, layout, self.stage, chunk, self.tp_rank, self.ep_rank))
        _mark_tensor_parallel(model)
        if spec.is_moe:
            self._capture_router_logits(model)
            self._count_routed_tokens(model)
            define_router_gemm_without_te(self.counters.define)

    def _init_parallel_state(self, torch):
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        o = self.opts
        torch.cuda.set_device(self.ctx.local_rank)
        ps.initialize_model_parallel(
            tensor_model_parallel_size=o.tp,
            pipeline_model_parallel_size=o.pp,
            virtual_pipeline_model_parallel_size=o.vpp if o.vpp > 1 else None,
            context_parallel_size=o.cp,
            expert_model_parallel_size=o.ep,
            # every group Megatron creates (tp, pp, dp, ...) gets the job's collective timeout, not
            # Megatron's 30-minute default, so a hung peer fails the tp all-reduce or pp send/recv
            # (megatron/core/parallel_state.py: timedelta(minutes=distributed_timeout_minutes) for
            # every new_group, megatron-core 0.16.1). Measured without it (tp=2, rank 1 hung):
            # rank 0 waited until the runner's launcher.hang_timeout_s killed the job, no restart.
            distributed_timeout_minutes=self.ctx.job.launch.collective_timeout_s / 60,
        )
        self.ps = ps
        model_parallel_cuda_manual_seed(self.ctx.job.run.seed)  # dropout is 0; the RNG tracker must exist anyway
        return ps

    def _transformer_config(self, dtype, use_te: bool):
        """The canonical Llama as a megatron-core TransformerConfig, in this job's parallel layout."""
        import torch.nn.functional as F
        from megatron.core.transformer.transformer_config import TransformerConfig

        o, spec = self.opts, self.ctx.job.model
        return TransformerConfig(
            num_layers=spec.num_hidden_layers,
            hidden_size=spec.hidden_size,
            ffn_hidden_size=spec.intermediate_size,
            num_attention_heads=spec.num_attention_heads,
            num_query_groups=spec.num_key_value_heads,
            kv_channels=spec.head_dim,
            layernorm_epsilon=spec.rms_norm_eps,
            normalization="RMSNorm",
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=spec.qkv_bias,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            tensor_model_parallel_size=o.tp,
            pipeline_model_parallel_size=o.pp,
            virtual_pipeline_model_parallel_size=o.vpp if o.vpp > 1 else None,
            context_parallel_size=o.cp,
            sequence_parallel=o.sequence_parallel,
            params_dtype=dtype,
            pipeline_dtype=dtype,
            bf16=self.ctx.job.run.precision == "bf16",
            # Weights come from the canonical mapping: skip Megatron's own (full-matrix) init.
            perform_initialization=False,
            use_cpu_initialization=True,
            # Fused CUDA kernels are not available on the host / through the redirection.
            bias_activation_fusion=use_te,
            apply_rope_fusion=False,
            masked_softmax_fusion=use_te,
            persist_layer_norm=False,
            gradient_accumulation_fusion=False,
            bias_dropout_fusion=False,
            # Megatron-LM's training defaults: the interleaved schedule overlaps p2p with compute
            # (individual isend/irecv), 1F1B batches its p2p ops.
            overlap_p2p_comm=o.vpp > 1,
            batch_p2p_comm=o.vpp == 1,
            # Megatron frees a stage's output right after posting its send. On CUDA the caching
            # allocator keeps the memory until the send's stream is done; on the host a gloo isend
            # still in flight (overlapped p2p) then reads reused memory and the next stage gets
            # garbage (seen: wrong losses for micro-batches 3 and 4 at pp=2, vpp=2). Keep outputs.
            deallocate_pipeline_outputs=self.device_type == "cuda",
            **recompute_settings(o),
            **moe_config(self.ctx.job.model, self.opts),
        )

    def _wrap_ddp(self, chunks: list, config) -> list:
        """Megatron's DDP around each model chunk (bucketing on the first only), replicas identical."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        o = self.opts
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=o.overlap_grad_reduce,
            overlap_param_gather=o.overlap_param_gather,
            use_distributed_optimizer=o.distributed_optimizer,
            bucket_size=o.bucket_size or None,
            average_in_collective=False,
        )
        wrapped = [
            DistributedDataParallel(config=config, ddp_config=ddp_config, module=m, disable_bucketing=(i > 0))
            for i, m in enumerate(chunks)
        ]
        for m in wrapped:  # DDP copied the weights into its buffers; broadcast keeps replicas identical
            m.broadcast_params()
        return wrapped

    def _wire_schedules(self, config):
        """Wire the schedules to the DDP wrappers, as megatron's training loop does; returns the
        forward-backward schedule function."""
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.pipeline_parallel import get_forward_backward_func

        o = self.opts
        one = lambda fns: fns[0] if len(fns) == 1 else fns  # noqa: E731
        if o.overlap_grad_reduce:
            config.no_sync_func = one([m.no_sync for m in self.chunks])
            config.grad_sync_func = one([m.start_grad_sync for m in self.chunks])
        if o.overlap_param_gather:
            config.param_sync_func = one([m.start_param_sync for m in self.chunks])
        config.finalize_model_grads_func = finalize_model_grads
        return get_forward_backward_func()

    def _redirect_inside_backward(self, torch) -> None:
        """Keep the redirection's device-rewriting TorchFunctionMode active in autograd backward.

        The autograd engine runs ``torch.autograd.Function.backward`` with an empty mode stack, so
        ``torch.empty(..., device=torch.cuda.current_device())`` in megatron-core's backward passes
        (sequence-parallel reduce-scatter/all-gather) would name the absent CUDA device 0. The
        engine calls ``BackwardCFunction.apply``: re-enter the mode there (scoped, undone in close).
        """
        from torch.overrides import _get_current_function_mode_stack

        stack = _get_current_function_mode_stack()
        if not stack:
            return
        mode = stack[-1]  # parabench.redirect enters its device mode last

        def make(apply):
            def apply_redirected(ctx, *args):
                if _get_current_function_mode_stack():
                    return apply(ctx, *args)
                with mode:
                    return apply(ctx, *args)

            return apply_redirected

        self.counters.patch(torch.autograd.function.BackwardCFunction, "apply", make)

    def _use_te(self) -> bool:
        impl = self.opts.transformer_impl
        if impl == "local" or self.device_type != "cuda" or self.ctx.job.model.is_moe:
            return False
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            if impl == "transformer_engine":
                raise RuntimeError(
                    "backend.transformer_impl=transformer_engine but transformer_engine is not importable"
                ) from None
            return False
        return True

    @staticmethod
    def _layer_spec(use_te: bool, config):
        from megatron.core.models.gpt import gpt_layer_specs

        # Returns vp_stage -> spec (a ModuleSpec is itself callable: it builds the module).
        if use_te:
            te_spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
            return lambda vp_stage: te_spec
        # num_experts: MoELayer (router, token dispatcher, SequentialMLP experts) as every layer's MLP
        spec = gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=config.num_moe_experts, moe_grouped_gemm=False, normalization="RMSNorm"
        )
        if not config.sequence_parallel:
            return lambda vp_stage: spec
        # Without Apex the local spec's norm is torch's (WrappedTorchNorm), which asserts
        # sequence_parallel is off: its weight lacks the ``sequence_parallel`` mark that makes
        # finalize_model_grads all-reduce norm gradients over the TP group (each rank saw only its
        # sequence slice). Same math, marked weight (as Megatron's FusedLayerNorm marks it).
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

        norm = _sequence_parallel_rmsnorm()
        layer = dataclasses.replace(
            spec, submodules=dataclasses.replace(spec.submodules, input_layernorm=norm, pre_mlp_layernorm=norm)
        )
        return lambda vp_stage: TransformerBlockSubmodules(
            layer_specs=[layer] * num_layers_to_build(config, vp_stage), layer_norm=norm
        )

    @staticmethod
    def _load(model, shard: dict) -> None:
        import torch

        params = dict(model.named_parameters())
        differ = set(params) ^ set(shard)
        if differ:
            raise RuntimeError(f"megatron and mapped parameter names differ: {sorted(differ)[:6]}")
        with torch.no_grad():
            for name, value in shard.items():
                p = params[name]
                if tuple(p.shape) != value.shape:
                    raise RuntimeError(f"{name}: megatron shape {tuple(p.shape)} != mapped {value.shape}")
                p.copy_(torch.from_numpy(value))

    def _instrument(self) -> None:
        import torch.distributed as dist
        from megatron.core.pipeline_parallel import schedules
        from megatron.core.tensor_parallel import mappings

        c = self.counters
        for name in (
            "all_reduce",
            "all_gather",
            "all_gather_into_tensor",
            "reduce_scatter_tensor",
            "_all_gather_base",
            "_reduce_scatter_base",
        ):
            if hasattr(dist, name):
                c.patch(dist, name, c.collective)
        for name in ("dist_all_gather_func", "dist_reduce_scatter_func"):  # bound at megatron import
            c.patch(mappings, name, c.collective)
        c.patch(schedules, "forward_step", c.timed)
        c.patch(schedules, "backward_step", c.timed)
