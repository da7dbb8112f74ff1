"""DDP as PyTorch documents it: ``DistributedDataParallel(model)`` with its defaults and a plain loop
(forward, ``loss.backward()``, ``clip_grad_norm_``, ``optimizer.step()``, ``optimizer.zero_grad()``).

Recipe (docs/sources.md#documented-training-loops): PyTorch "Getting Started with Distributed Data Parallel"
(https://docs.pytorch.org/tutorials/intermediate/ddp_tutorial.html) and "Distributed Data Parallel" notes
(https://docs.pytorch.org/docs/stable/notes/ddp.html); clipping as in torch.nn.utils.clip_grad_norm_'s docs.

    python -m torch.distributed.run --standalone --nproc-per-node N ddp_native.py OUT OVERRIDES_JSON
"""

import time

import torch
import torch.distributed as dist
from native_common import batches, load_job, threads, write_times
from torch.nn.parallel import DistributedDataParallel

from parabench.model import build_llama, causal_lm_loss, decay_mask


def main() -> None:
    out, job = load_job()
    torch.set_num_threads(threads(job))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(build_llama(job.model, seed=job.run.seed))
    named = list(model.module.named_parameters())
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
    batch, times, first_loss = batches(job, rank, world), [], None
    for step in range(job.run.warmup_steps + job.run.steps):
        inputs, targets = (torch.from_numpy(a) for a in batch(step))
        t0 = time.perf_counter()
        loss = causal_lm_loss(model(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        if step >= job.run.warmup_steps:
            times.append(time.perf_counter() - t0)
        if step == 0:
            first_loss = float(loss)  # outside the timed region
    write_times(out, rank, job, times, first_loss)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
