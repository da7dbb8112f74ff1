"""A checkpoint written by DeepSpeed's own tools, not by parabench (tests/test_convert_ds_native.py).

``torchrun --nproc-per-node 2 tests/ds_native_train.py OUT STAGE STEPS``: a tiny transformers
``LlamaForCausalLM`` trained through ``deepspeed.initialize`` (ZeRO-STAGE, torch's AdamW, gloo on a
CPU), saved with ``engine.save_checkpoint(OUT/ckpt)`` beside its ``config.json``, as the Hugging Face
Trainer lays out ``checkpoint-N/``. Rank 0 also writes ``OUT/reference.safetensors``: the full fp32
weights and AdamW moments read back through DeepSpeed's own API (``safe_get_full_fp32_param``,
``safe_get_full_optimizer_state``), and ``OUT/reference.json`` (the optimizer step, the losses).
"""

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def main(out: str, stage: int, steps: int) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    config = LlamaConfig(**TINY)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_force_ds_cpu_optimizer": False,  # keep torch's AdamW (no cpu_adam build)
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    data = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, TINY["vocab_size"], (2, 32), generator=data)
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    engine.save_checkpoint(os.path.join(out, "ckpt"))
    reference = {}
    for name, param in engine.module.named_parameters():  # collective under ZeRO-3
        reference[name] = safe_get_full_fp32_param(param).detach().float().cpu().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            reference[f"{key}/{name}"] = safe_get_full_optimizer_state(param, key).detach().float().cpu().clone()
    if rank == 0:
        config.architectures = [type(model).__name__]  # what model.save_pretrained records
        config.save_pretrained(os.path.join(out, "ckpt"))  # config.json, as the Trainer writes it
        save_file(reference, os.path.join(out, "reference.safetensors"))
        with open(os.path.join(out, "reference.json"), "w") as f:
            json.dump({"step": steps, "losses": losses}, f)
    torch.distributed.barrier()
    # A process that exits holding its process group tears gloo's threads down during interpreter
    # shutdown: CI saw rank 1 abort there ('terminate called without an active exception', SIGABRT)
    # after every step and the save had finished. Every worker parabench starts destroys its group.
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
