"""Throughput of `bench run` (ddp, 1 rank) vs a minimal hand-written loop on the same model and data.

Both sides: the canonical llama (or --model), the same synthetic batches, torch.optim.AdamW with
the same hyper-parameters, gradient accumulation over the same micro-batches, grad clipping, the
same thread count, the same warm-up/measured steps; each side runs in its own fresh process, and
the rounds alternate (hand, harness, hand, harness, ...) so that drift in machine load hits both.
Prints tokens/s per round, the medians and their ratio (target >= 0.98).
With --tracking the harness records into a local MLflow store as a user's run does, live per-step
metrics included (logged by the runner process, outside the workers' timed region).

    python benchmarks/harness_overhead.py [--rounds 3] [--steps 10] [--warmup 2] [--tracking]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HAND_LOOP = r"""
import json, sys, time, torch
from parabench.hydraconfig import compose, to_plain
from parabench.jobs import from_config
from parabench.data import TokenSource
from parabench.model import build_llama, causal_lm_loss
from parabench.adapters.torch_common import make_adamw

overrides, warmup, steps = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
job = from_config(to_plain(compose(overrides)))
torch.set_num_threads(int(sys.argv[4]))
model = build_llama(job.model, seed=job.run.seed)
opt = make_adamw(list(model.named_parameters()), job.optim)
src = TokenSource(job.data, job.model.vocab_size)
times = []
for step in range(warmup + steps):
    batches = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in src.rank_micro_batches(step, 0, 1)]
    t0 = time.perf_counter()
    for x, y in batches:
        (causal_lm_loss(model(x), y) / len(batches)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), job.optim.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=False)
    if step >= warmup:
        times.append(time.perf_counter() - t0)
print(json.dumps({"tokens_per_s": job.tokens_per_step * steps / sum(times)}))
"""


def hand(overrides: list[str], warmup: int, steps: int, threads: int) -> float:
    out = subprocess.run(
        [sys.executable, "-c", HAND_LOOP, json.dumps(overrides), str(warmup), str(steps), str(threads)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": str(threads)},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["tokens_per_s"]


def harness(overrides: list[str], warmup: int, steps: int, results: Path, tracking: bool) -> float:
    before = set(results.glob("runs/*/*/*/summary.json"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "parabench",
            "run",
            *overrides,
            f"run.warmup_steps={warmup}",
            f"run.steps={steps}",
            f"run.results_dir={results}",
            f"tracking.enabled={str(tracking).lower()}",
        ],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"},
    )
    (new,) = set(results.glob("runs/*/*/*/summary.json")) - before
    return json.loads(new.read_text())["tokens_per_s"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--model", default="llama")
    p.add_argument("--tracking", action="store_true", help="bench run records into MLflow (live metrics on)")
    args = p.parse_args()
    threads = os.cpu_count() or 1
    overrides = [f"+model={args.model}"]
    hands, harnesses = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            hands.append(hand(overrides, args.warmup, args.steps, threads))
            harnesses.append(harness(overrides, args.warmup, args.steps, Path(tmp), args.tracking))
            print(
                f"round {r + 1}: hand-written loop {hands[-1]:.1f} tokens/s, "
                f"bench run (ddp, 1 rank, tracking {'on' if args.tracking else 'off'}) {harnesses[-1]:.1f} tokens/s",
                flush=True,
            )
    h, b = statistics.median(hands), statistics.median(harnesses)
    print(
        f"median: hand-written {h:.1f} tokens/s, bench run {b:.1f} tokens/s; "
        f"ratio bench/hand = {b / h:.3f} (target >= 0.98; {threads} threads, {args.steps} measured steps, "
        f"{args.rounds} alternating rounds)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
