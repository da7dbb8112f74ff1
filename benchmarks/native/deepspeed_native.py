"""DeepSpeed as its documentation writes a training loop: ``deepspeed.initialize(model=...,
optimizer=..., config=...)``, then per step ``loss = engine(batch)``, ``engine.backward(loss)``,
``engine.step()`` (clipping and the ZeRO stage from the config).

Recipe (docs/sources.md#documented-training-loops): DeepSpeed "Getting Started", sections "Writing DeepSpeed Models" and "Training"
(https://www.deepspeed.ai/getting-started/); a client optimizer (torch AdamW) with
``zero_allow_untested_optimizer`` as in the config docs (https://www.deepspeed.ai/docs/config-json/).
On a CPU: ``DS_ACCELERATOR=cpu`` and gloo, as DeepSpeed's CPU accelerator runs (the caller sets the env).

    DS_ACCELERATOR=cpu python -m torch.distributed.run --standalone --nproc-per-node N deepspeed_native.py OUT OVERRIDES_JSON
"""

import time

from native_common import batches, load_job, threads, write_times


def ds_config(job) -> dict:
    """The DeepSpeed config for the job's batch, clipping, precision and ZeRO stage (docs/config-json)."""
    return {
        "train_micro_batch_size_per_gpu": job.data.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": job.optim.grad_clip,
        "bf16": {"enabled": job.run.precision == "bf16"},
        "zero_optimization": {"stage": job.backend.options.zero_stage},
        "zero_allow_untested_optimizer": True,
    }


def main() -> None:
    import deepspeed
    import torch

    from parabench.model import build_llama, causal_lm_loss, decay_mask

    out, job = load_job()
    torch.set_num_threads(threads(job))
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = build_llama(job.model, seed=job.run.seed)
    named = list(model.named_parameters())
    spec = job.optim
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for n, p in named if decay_mask(n, p)], "weight_decay": spec.weight_decay},
            {"params": [p for n, p in named if not decay_mask(n, p)], "weight_decay": 0.0},
        ],
        lr=spec.lr,
        betas=spec.betas,
        eps=spec.eps,
    )
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(job))
    batch, times, first_loss = batches(job, rank, world), [], None
    for step in range(job.run.warmup_steps + job.run.steps):
        inputs, targets = (torch.from_numpy(a) for a in batch(step))
        t0 = time.perf_counter()
        loss = causal_lm_loss(engine(inputs), targets)
        engine.backward(loss)
        engine.step()
        if step >= job.run.warmup_steps:
            times.append(time.perf_counter() - t0)
        if step == 0:
            first_loss = float(loss)  # outside the timed region
    write_times(out, rank, job, times, first_loss)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
