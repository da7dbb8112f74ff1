"""Megatron-Core as Megatron-LM's training loop drives it: a ``GPTModel`` (local layer spec) wrapped in
megatron-core's ``DistributedDataParallel`` (default ``DistributedDataParallelConfig``), the optimizer
from ``get_megatron_optimizer`` (Adam with decoupled weight decay, global-norm clipping), and per step
``zero_grad_buffer()``, ``optimizer.zero_grad()``, ``get_forward_backward_func()(...)``,
``optimizer.step()`` with ``config.finalize_model_grads_func = finalize_model_grads``.

Recipe (docs/sources.md#documented-training-loops): NVIDIA/Megatron-LM ``megatron/training/training.py`` (``get_model``, ``setup_model_and_optimizer``,
``train_step``, ``train``) and megatron-core's quick start ``examples/run_simple_mcore_train_loop.py``.
Megatron's own weight init (the model class and shapes are the adapter's). megatron-core asks for
CUDA; on this CPU its CUDA calls go through ``parabench.redirect`` as under `bench run backend=megatron`.

    python -m torch.distributed.run --standalone --nproc-per-node N megatron_native.py OUT OVERRIDES_JSON
"""

import time

from native_common import batches, load_job, threads, write_times


def transformer_config_kwargs(job) -> dict:
    """The job's Llama as TransformerConfig arguments (shapes from the composed config), tp = pp = 1."""
    import torch
    import torch.nn.functional as F

    spec = job.model
    return dict(
        num_layers=spec.num_hidden_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.intermediate_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_key_value_heads,
        kv_channels=spec.head_dim,
        layernorm_epsilon=spec.rms_norm_eps,
        normalization="RMSNorm",
        gated_linear_unit=True,  # SwiGLU
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        # no fused CUDA kernels on the host
        bias_activation_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
    )


def build(job):
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(**transformer_config_kwargs(job))
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=job.model.vocab_size,
        max_sequence_length=job.data.seq_len,
        share_embeddings_and_output_weights=job.model.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=job.model.rope_theta,
    )
    model.cuda(torch.cuda.current_device())  # Megatron-LM's get_model (redirected to the host)
    model = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(), module=model)
    spec = job.optim
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=spec.lr,
            min_lr=spec.lr,
            weight_decay=spec.weight_decay,
            adam_beta1=spec.betas[0],
            adam_beta2=spec.betas[1],
            adam_eps=spec.eps,
            clip_grad=spec.grad_clip,
            decoupled_weight_decay=True,  # AdamW
        ),
        [model],
    )
    config.finalize_model_grads_func = finalize_model_grads  # Megatron-LM's train(): the DP grad all-reduce
    return model, optimizer


def loss_func(per_token):
    loss = per_token.float().mean()
    return loss, {"lm loss": loss.detach().clone()}


def main() -> None:
    import torch
    import torch.distributed as dist

    from parabench.redirect import install

    out, job = load_job()
    torch.set_num_threads(threads(job))
    dist.init_process_group("gloo")
    install("cuda", "cpu")
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(job.run.seed)
    model, optimizer = build(job)
    forward_backward = get_forward_backward_func()
    rank, world = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()

    def forward_step(data_iterator, model):
        tokens, labels = next(data_iterator)
        positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        return model(tokens, positions, None, labels=labels), loss_func

    batch, times, first_loss = batches(job, rank, world), [], None
    for step in range(job.run.warmup_steps + job.run.steps):
        inputs, targets = (torch.from_numpy(a) for a in batch(step))
        t0 = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(
            forward_step_func=forward_step,
            data_iterator=iter([(inputs, targets)]),
            model=model,
            num_microbatches=1,
            seq_length=job.data.seq_len,
            micro_batch_size=job.data.micro_batch_size,
            forward_only=False,
        )
        ok, _grad_norm, _ = optimizer.step()
        if not ok:
            raise RuntimeError("the megatron optimizer skipped a step")
        if step >= job.run.warmup_steps:
            times.append(time.perf_counter() - t0)
        if step == 0:
            first_loss = float(losses[0]["lm loss"])  # outside the timed region
    write_times(out, dist.get_rank(), job, times, first_loss)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
