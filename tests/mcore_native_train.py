"""A checkpoint in Megatron-LM's own layout, not parabench's (tests/test_convert_mcore_native.py).

``torchrun --nproc-per-node TPxPPxDP tests/mcore_native_train.py OUT STEPS TP PP [bf16] [distopt|distopt_dp] [legacy]``: a tiny Llama-shaped
megatron-core ``GPTModel`` (local layer spec, RMSNorm, SwiGLU, RoPE, grouped-query attention, untied
output layer) at tensor-parallel size TP and pipeline-parallel size PP, Megatron's own weight init, wrapped in Megatron's
``DistributedDataParallel`` and trained STEPS steps with ``get_megatron_optimizer`` (Adam with
decoupled weight decay; fp32, or with ``bf16`` Megatron-LM's ``--bf16``: the model in bf16 inside
``Float16Module``, fp32 main params in the optimizer; with ``distopt`` Megatron-LM's
``--use-distributed-optimizer --dist-ckpt-optim-fully-reshardable``, with ``distopt_dp`` its default
``dp_reshardable`` format, the processes beyond TPxPP being data-parallel ranks) through ``get_forward_backward_func``, then saved as Megatron-LM's
``save_checkpoint`` saves with ``--ckpt-format torch`` when ``legacy`` is given (the legacy format
MindSpeed-LLM's training and converter write: ``OUT/ckpt/iter_{STEPS:07d}/mp_rank_TT[_PPP]/model_optim_rng.pt``,
one ``torch.save`` per tensor and pipeline rank of the first data-parallel replica, holding
``generate_state_dict``'s dict with the module's ``state_dict_for_save_checkpoint`` and the optimizer's
``state_dict``), otherwise as Megatron-LM's
``save_checkpoint`` saves with ``--ckpt-format torch_dist`` (its default): the state
``generate_state_dict`` builds (``args``, ``checkpoint_version`` 3.0, ``iteration``, ``model``,
``optimizer``, ``opt_param_scheduler``, ``rng_state``) through ``dist_checkpointing.save`` into
``OUT/ckpt/iter_{STEPS:07d}/``, and ``OUT/ckpt/latest_checkpointed_iteration.txt`` naming it
(NVIDIA/Megatron-LM ``megatron/training/checkpointing.py``: ``save_checkpoint``,
``generate_state_dict``, ``get_checkpoint_name``, ``get_checkpoint_tracker_filename``). Megatron-LM's
training package is not on PyPI (megatron-core is), so this script stands in for its loop; the files
are written by megatron-core's own ``sharded_state_dict`` and ``dist_checkpointing``.

megatron-core asks for CUDA devices and CUDA RNG; on this CPU the calls go through parabench's
CUDA -> CPU redirection, as ``bench run backend=megatron`` does.

Rank 0 also writes ``OUT/reference.pt``: every rank's parameters (under bf16 the optimizer's fp32 main
params) and AdamW moments under the module's own names with its (pipeline stage, tensor rank), and in
fp32 at PP=1 fixed tokens with the logits the
trained model gives for them (the vocab-parallel parts gathered) and the AdamW moments of the word
embeddings and the final norm, gathered over the tensor-parallel ranks, under canonical names.
"""

import argparse
import os
import random
import sys

import numpy as np
import torch
import torch.nn.functional as F

from parabench.redirect import install

SEQ = 32
SHAPE = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2)
VOCAB = 512
MAX_POSITIONS = 2048  # the tiny llama preset's, so that bench run resumes the same model


def megatron_lm_args(steps: int, tp: int, pp: int, bf16: bool, distopt: str | None) -> argparse.Namespace:
    """The arguments Megatron-LM pickles into every checkpoint (``state_dict['args']``), for this model:
    names and meanings of megatron/training/arguments.py."""
    from megatron.core.transformer.enums import AttnBackend

    return argparse.Namespace(
        **SHAPE,
        group_query_attention=True,
        kv_channels=SHAPE["hidden_size"] // SHAPE["num_attention_heads"],
        seq_length=SEQ,
        max_position_embeddings=MAX_POSITIONS,
        padded_vocab_size=VOCAB,
        make_vocab_size_divisible_by=128,
        normalization="RMSNorm",
        norm_epsilon=1e-5,
        swiglu=True,
        position_embedding_type="rope",
        rotary_base=10000,
        rotary_percent=1.0,
        rotary_interleaved=False,
        use_rope_scaling=False,
        untie_embeddings_and_output_weights=True,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=False,
        num_experts=None,
        multi_latent_attention=False,
        attention_backend=AttnBackend.auto,
        init_method_std=0.02,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None,
        context_parallel_size=1,
        use_distributed_optimizer=distopt is not None,
        bf16=bf16,
        fp16=False,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        optimizer="adam",
        lr=1e-3,
        weight_decay=0.1,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_eps=1e-8,
        clip_grad=1.0,
        ckpt_format="torch_dist",
        iteration=steps,
        train_iters=steps,
        micro_batch_size=2,
        global_batch_size=2,
        consumed_train_samples=2 * steps,
    )


def build(args: argparse.Namespace):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        **SHAPE,
        kv_channels=args.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        init_method_std=args.init_method_std,
        use_cpu_initialization=True,
        bf16=args.bf16,
        params_dtype=args.params_dtype,
        pipeline_dtype=args.params_dtype,
        # no fused CUDA kernels on the host
        bias_activation_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=VOCAB,
        max_sequence_length=MAX_POSITIONS,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=args.rotary_base,
    )
    if args.bf16:  # as Megatron-LM's get_model wraps it
        model = Float16Module(config, model)
    distopt = args.use_distributed_optimizer
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distopt)
    model = DistributedDataParallel(config=config, ddp_config=ddp, module=model)
    fields = {f for f in OptimizerConfig.__dataclass_fields__}
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=args.lr,
            min_lr=args.lr,
            weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2,
            adam_eps=args.adam_eps,
            clip_grad=args.clip_grad,
            bf16=args.bf16,
            params_dtype=args.params_dtype,
            use_distributed_optimizer=distopt,
            **({"decoupled_weight_decay": True} if "decoupled_weight_decay" in fields else {}),
        ),
        [model],
    )
    return model, optimizer


def _loss(per_token):
    loss = per_token.float().mean()
    return loss, {"loss": loss.detach()}


def train(model, optimizer, steps: int) -> list[float]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    data = torch.Generator().manual_seed(100)  # the same batches on every rank
    forward_backward, losses = get_forward_backward_func(), []

    def forward_step(batches, model):
        tokens = next(batches)
        positions = torch.arange(SEQ).unsqueeze(0).expand_as(tokens)
        labels = torch.roll(tokens, -1, dims=1)
        return model(tokens, positions, None, labels=labels), _loss

    for _ in range(steps):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        batch = torch.randint(0, VOCAB, (2, SEQ), generator=data)
        out = forward_backward(
            forward_step_func=forward_step,
            data_iterator=iter([batch]),
            model=model,
            num_microbatches=1,
            seq_length=SEQ,
            micro_batch_size=2,
            forward_only=False,
        )
        ok, _, _ = optimizer.step()
        assert ok, "the optimizer skipped a step"
        if out:  # the last pipeline stage
            losses.append(float(out[0]["loss"]))
    return losses


def save_as_megatron_lm(model, optimizer, args: argparse.Namespace, root: str, distopt: str | None) -> None:
    """What Megatron-LM's save_checkpoint writes for --ckpt-format torch_dist, on every rank. With the
    distributed optimizer, the format ``distopt`` passed to its sharded_state_dict and recorded as
    content_metadata, as Megatron-LM's _build_sharded_state_dict_metadata and save_checkpoint do."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    from megatron.core.utils import unwrap_model

    iteration = args.iteration
    directory = os.path.join(root, f"iter_{iteration:07d}")
    if torch.distributed.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    torch.distributed.barrier()
    rng = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": get_cuda_rng_tracker().get_states(),
    }
    state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration}
    state["model"] = unwrap_model(model).sharded_state_dict()  # Megatron-LM unwraps DDP and Float16Module
    metadata = {"distrib_optim_sharding_type": distopt, "chained_optim_avoid_prefix": True} if distopt else None
    state["optimizer"] = optimizer.sharded_state_dict(state, **({"metadata": metadata} if distopt else {}))
    state["opt_param_scheduler"] = {"max_lr": args.lr, "min_lr": args.lr, "num_steps": iteration * 2}
    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    pp_rank, pp_size = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    state["rng_state"] = ShardedObject(
        "rng_state", [rng], (pp_size, tp_size), (pp_rank, tp_rank), replica_id=ps.get_data_parallel_rank()
    )
    recorded = {"content_metadata": metadata} if distopt else {}
    dist_checkpointing.save(state, directory, get_default_save_sharded_strategy("torch_dist"), **recorded)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))


def save_as_megatron_lm_legacy(model, optimizer, args: argparse.Namespace, root: str) -> None:
    """What Megatron-LM's save_checkpoint writes for --ckpt-format torch: on the ranks of the first
    data-parallel replica, generate_state_dict's dict (args, checkpoint_version, iteration, the model's
    state_dict_for_save_checkpoint, the optimizer's state_dict, the scheduler's, the RNG states) through
    torch.save into get_checkpoint_name's mp_rank_TT[_PPP]/model_optim_rng.pt."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    from megatron.core.utils import unwrap_model

    args = argparse.Namespace(**{**vars(args), "ckpt_format": "torch"})
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    name = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if args.pipeline_model_parallel_size > 1 else "")
    directory = os.path.join(root, f"iter_{args.iteration:07d}", name)
    if ps.get_data_parallel_rank() == 0:
        rng = {
            "random_rng_state": random.getstate(),
            "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "rng_tracker_states": get_cuda_rng_tracker().get_states(),
        }
        state = {"args": args, "checkpoint_version": 3.0, "iteration": args.iteration}
        state["model"] = unwrap_model(model).state_dict_for_save_checkpoint()
        state["optimizer"] = optimizer.state_dict()
        state["opt_param_scheduler"] = {"max_lr": args.lr, "min_lr": args.lr, "num_steps": args.iteration * 2}
        state["rng_state"] = [rng]
        os.makedirs(directory, exist_ok=True)
        torch.save(state, os.path.join(directory, "model_optim_rng.pt"))
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(args.iteration))


def shards(model, optimizer) -> list:
    """Every rank's (stage, tensor rank, {name: weight}, {name: exp_avg}, {name: exp_avg_sq}) under
    the module's own parameter names (layer indices within the stage), gathered on every rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import unwrap_model

    main = {}  # bf16 param -> its fp32 main param (Float16OptimizerWithFloat16Params, maybe in a chain)
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        pairs = zip(getattr(opt, "float16_groups", []), getattr(opt, "fp32_from_float16_groups", []), strict=True)
        main.update({id(a): b for g16, g32 in pairs for a, b in zip(g16, g32, strict=True)})
    params = {n: main.get(id(p), p) for n, p in unwrap_model(model).named_parameters()}
    if distributed(optimizer):
        moments = distopt_moments(model, optimizer)
    else:
        states = optimizer.optimizer.state
        moments = [{n: states[p][key].clone() for n, p in params.items()} for key in ("exp_avg", "exp_avg_sq")]
    mine = (
        ps.get_pipeline_model_parallel_rank(),
        ps.get_tensor_model_parallel_rank(),
        {n: p.detach().float().clone() for n, p in params.items()},
        *moments,
    )
    everyone: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    return everyone


def distopt_moments(model, optimizer) -> list:
    """The distributed optimizer's AdamW moments of every parameter, whole: megatron-core's own
    get_parameter_state_dp_zero (the data-parallel ranks' buffer shards put together, by buffer) cut
    at each parameter's place in its buffer (``param_index_map``: start, end in the buffer). The
    weights are the model's own: the step all-gathers the updated fp32 params into every rank."""
    from megatron.core.utils import unwrap_model

    names = {p: n for n, p in unwrap_model(model).named_parameters()}
    out: list[dict] = [{}, {}]
    for opt in distributed(optimizer):
        world = opt.get_parameter_state_dp_zero(use_gloo_comm=False, return_on_all_ranks=True)
        for index, buffer in enumerate(opt.buffers):
            (tensors,) = world[index].values()  # one (param, grad) dtype per buffer
            for param, (start, end, _bucket) in buffer.param_index_map.items():
                for i, key in enumerate(("exp_avg", "exp_avg_sq")):
                    out[i][names[param]] = tensors[key][start:end].view(param.shape).clone()
    return out


def distributed(optimizer) -> list:
    """The distributed optimizers inside ``optimizer`` (a ChainedOptimizer holds several); [] without."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return inner if all(hasattr(o, "model_param_gbuf_map") for o in inner) else []


def logits_and_moments(model, optimizer, tp: int) -> dict:
    """Logits for fixed tokens (vocab-parallel parts gathered) and two parameters' AdamW moments (PP=1)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    gpt = model.module
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).unsqueeze(0).expand_as(tokens)
    gpt.eval()
    with torch.no_grad():
        logits = gather_from_tensor_model_parallel_region(gpt(tokens, positions, None))
    out = {"tokens": tokens, "logits": logits.float().clone()}
    if distributed(optimizer):  # its moments are in reference["shards"]
        return out
    states = optimizer.optimizer.state
    embedding, norm = gpt.embedding.word_embeddings.weight, gpt.decoder.final_layernorm.weight
    for key in ("exp_avg", "exp_avg_sq"):
        parts = [torch.empty_like(states[embedding][key]) for _ in range(tp)]
        torch.distributed.all_gather(parts, states[embedding][key].contiguous())
        out[f"{key}/model.embed_tokens.weight"] = torch.cat(parts)
        out[f"{key}/model.norm.weight"] = states[norm][key].clone()
    return out


def main(out: str, steps: int, tp: int, pp: int, bf16: bool, distopt: str | None, legacy: bool = False) -> None:
    torch.distributed.init_process_group("gloo")
    install("cuda", "cpu")
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(1234)
    args = megatron_lm_args(steps, tp, pp, bf16, distopt)
    model, optimizer = build(args)
    train(model, optimizer, steps)
    if legacy:
        save_as_megatron_lm_legacy(model, optimizer, args, os.path.join(out, "ckpt"))
    else:
        save_as_megatron_lm(model, optimizer, args, os.path.join(out, "ckpt"), distopt)
    ref = {"shards": shards(model, optimizer), "step": steps}
    if pp == 1 and not bf16:
        ref.update(logits_and_moments(model, optimizer, tp))
    if torch.distributed.get_rank() == 0:
        torch.save(ref, os.path.join(out, "reference.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    flags = sys.argv[5:]
    formats = {"distopt": "fully_reshardable", "distopt_dp": "dp_reshardable"}
    distopt = next((formats[f] for f in flags if f in formats), None)
    main(sys.argv[1], *(int(a) for a in sys.argv[2:5]), bf16="bf16" in flags, distopt=distopt, legacy="legacy" in flags)
