"""Throughput of `bench run` vs each framework's own minimal training loop, per backend and world size.

For every backend (ddp, fsdp, deepspeed, megatron, mindspore) and world size, both sides train the
same job: the model, batch, AdamW hyper-parameters, steps and threads per rank that parabench's
composed config gives for the same overrides, on the same synthetic batches (parabench.data.TokenSource).
(a) `bench run` (tracking off), its summary.json tokens_per_s; (b) the loop in benchmarks/native/
<backend>_native.py, written as the framework's documentation writes it (docs/fairness.md; the
sources: docs/sources.md#documented-training-loops), launched with torchrun or msrun. Every run is a fresh process tree, and the
rounds alternate (native, harness, native, harness, ...) so that drift in machine load hits both.
Both sides time a step from a ready batch to a finished update and count tokens/s = tokens per step
x measured steps / sum over steps of the slowest rank's step time (parabench.metrics.summarize).
Prints per backend and world size the median tokens/s of each side, the ratio harness/native of the
medians (target >= 0.98) and the spread (min-max) of the per-round ratios.

    python benchmarks/fairness.py [--backends ddp,fsdp,...] [--worlds 1,2] [--rounds 3] [--steps 20] [--warmup 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
NATIVE_DIR = HERE / "native"
BACKENDS = ("ddp", "fsdp", "deepspeed", "megatron", "mindspore")
# The job both sides train: the tiny llama with a 2,048-token vocabulary and 64-token sequences (a
# CPU step of ~0.1 s), 4 sequences per step split over the ranks (one micro-batch per rank: the
# documented loops have no gradient accumulation), fp32, on the host.
MODEL = ("+model=llama", "model.vocab_size=2048", "data.seq_len=64", "device=cpu")
GLOBAL_BATCH = 4


@dataclass(frozen=True)
class Pair:
    """One backend at one world size: the two sides' median tokens/s and the per-round ratios."""

    backend: str
    world: int
    native: tuple[float, ...]
    harness: tuple[float, ...]

    @property
    def ratio(self) -> float:
        """harness / native of the medians."""
        return statistics.median(self.harness) / statistics.median(self.native)

    @property
    def spread(self) -> tuple[float, float]:
        """(min, max) of harness / native within each round."""
        ratios = [h / n for n, h in zip(self.native, self.harness, strict=True)]
        return min(ratios), max(ratios)

    def line(self) -> str:
        lo, hi = self.spread
        return (
            f"| {self.backend:<9} | {self.world} | {statistics.median(self.native):8.1f} | "
            f"{statistics.median(self.harness):8.1f} | {self.ratio:.3f} | {lo:.3f}-{hi:.3f} |"
        )


TABLE_HEAD = (
    "| backend   | ranks | native tokens/s | bench run tokens/s | bench/native | spread (per round) |\n"
    "|-----------|-------|-----------------|--------------------|--------------|--------------------|"
)


def job_overrides(backend: str, world: int, warmup: int, steps: int) -> list[str]:
    """The overrides both sides compose their job from."""
    if GLOBAL_BATCH % world:
        raise SystemExit(f"--worlds: {world} ranks do not divide the global batch of {GLOBAL_BATCH} sequences")
    return [
        f"backend={backend}",
        *MODEL,
        f"data.global_batch_size={GLOBAL_BATCH}",
        f"data.micro_batch_size={GLOBAL_BATCH // world}",
        f"launcher.nproc_per_node={world}",
        f"run.warmup_steps={warmup}",
        f"run.steps={steps}",
    ]


def tokens_per_s(rank_times: Sequence[Sequence[float]], tokens_per_step: int) -> float:
    """tokens per step x steps / sum over steps of the slowest rank's time (parabench.metrics.summarize)."""
    steps = len(rank_times[0])
    slowest = [max(times[i] for times in rank_times) for i in range(steps)]
    return tokens_per_step * steps / sum(slowest)


def native_command(
    backend: str, world: int, out: Path, overrides: list[str], python: str = sys.executable
) -> list[str]:
    script = str(NATIVE_DIR / f"{backend}_native.py")
    args = [script, str(out), json.dumps(overrides)]
    if backend != "mindspore":
        return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", *args]
    if world == 1:  # a one-process MindSpore script is started as a plain script
        return [python, *args]
    from parabench.launchers import unclaimed_port

    msrun = str(Path(python).parent / "msrun")
    return [
        msrun,
        f"--worker_num={world}",
        f"--local_worker_num={world}",
        f"--master_port={unclaimed_port()}",
        "--join=True",
        f"--log_dir={out / 'logs'}",
        "python",
        *args,
    ]


def native_env(backend: str, world: int) -> dict[str, str]:
    """The environment `bench run` gives this backend's workers: threads per rank and the adapter's
    launch_env (DS_ACCELERATOR and the JIT cache for DeepSpeed, MindSpore's log level)."""
    from parabench.adapters.registry import get_adapter
    from parabench.confutil import compose, to_plain
    from parabench.devices import cpu_threads
    from parabench.jobs import from_config

    job = from_config(to_plain(compose(job_overrides(backend, world, 0, 1))))
    threads = cpu_threads(job.launch.nproc_per_node, job.device.threads_per_rank)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), **get_adapter(backend).launch_env(job)}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # msrun's `python`
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(NATIVE_DIR), env.get("PYTHONPATH", "")]))
    return env


def run_checked(cmd: list[str], env: dict[str, str], what: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"{what} failed (exit {done.returncode}): {' '.join(cmd[:6])} ...\n{tail}")


def native(backend: str, world: int, overrides: list[str], work: Path) -> tuple[float, float]:
    """(tokens/s, loss at step 0 averaged over ranks) of one native run."""
    out = Path(tempfile.mkdtemp(prefix=f"native-{backend}-", dir=work))
    run_checked(native_command(backend, world, out, overrides), native_env(backend, world), f"native {backend}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    first_loss = statistics.fmean(r["first_loss"] for r in ranks)
    return tokens_per_s([r["step_times"] for r in ranks], ranks[0]["tokens_per_step"]), first_loss


def harness(overrides: list[str], results: Path) -> tuple[float, float]:
    """(tokens/s, loss at step 0) of one `bench run`, from its summary.json."""
    before = set(results.glob("runs/*/*/*/summary.json"))
    cmd = [sys.executable, "-m", "parabench", "run", *overrides, f"run.results_dir={results}", "tracking.enabled=false"]
    run_checked(cmd, {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}, "bench run")
    (new,) = set(results.glob("runs/*/*/*/summary.json")) - before
    summary = json.loads(new.read_text())
    return summary["tokens_per_s"], summary["loss_first"]


def measure(backend: str, world: int, args: argparse.Namespace, work: Path) -> Pair:
    overrides = job_overrides(backend, world, args.warmup, args.steps)
    natives: list[float] = []
    harnesses: list[float] = []
    for r in range(args.rounds):
        tps_native, loss_native = native(backend, world, overrides, work)
        tps_harness, loss_harness = harness(overrides, work / "results")
        natives.append(tps_native)
        harnesses.append(tps_harness)
        print(
            f"{backend} x{world} round {r + 1}: native {tps_native:.1f} tokens/s, bench run {tps_harness:.1f} "
            f"tokens/s, ratio {tps_harness / tps_native:.3f}; loss at step 0: native {loss_native:.6f}, "
            f"bench run {loss_harness:.6f}",
            flush=True,
        )
    return Pair(backend, world, tuple(natives), tuple(harnesses))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--backends", default=",".join(BACKENDS), help=f"comma-separated, of {', '.join(BACKENDS)}")
    p.add_argument("--worlds", default="1,2", help="comma-separated world sizes (ranks on this host)")
    p.add_argument("--rounds", type=int, default=3, help="alternating native/harness rounds per backend and world")
    p.add_argument("--steps", type=int, default=20, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps per run (run, not measured)")
    p.add_argument("--json", type=Path, help="also write the per-round figures to this file")
    args = p.parse_args(argv)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in args.backends if b not in BACKENDS]
    if unknown or not args.backends:
        p.error(f"--backends: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(BACKENDS)}")
    try:
        args.worlds = [int(w) for w in args.worlds.split(",")]
    except ValueError:
        p.error(f"--worlds: expected comma-separated integers, got {args.worlds!r}")
    for name in ("rounds", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.warmup < 0 or any(w < 1 or GLOBAL_BATCH % w for w in args.worlds):
        p.error(f"--warmup must be >= 0 and every --worlds entry must divide {GLOBAL_BATCH}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    pairs, failed = [], []
    with tempfile.TemporaryDirectory(prefix="fairness-") as tmp:
        for backend in args.backends:
            for world in args.worlds:
                try:
                    pairs.append(measure(backend, world, args, Path(tmp)))
                except RuntimeError as exc:  # one backend's failure is reported; the others still run
                    failed.append(f"{backend} x{world}: {exc}")
                    print(f"FAILED {failed[-1]}", file=sys.stderr, flush=True)
    print(
        f"\n{args.rounds} alternating rounds, {args.steps} measured steps after {args.warmup} warm-up, fp32, CPU; "
        f"{os.cpu_count()} cores, {(time.monotonic() - started) / 60:.1f} min"
    )
    print(TABLE_HEAD)
    for pair in pairs:
        print(pair.line())
    if args.json:
        args.json.write_text(json.dumps([vars(p) | {"ratio": p.ratio, "spread": p.spread} for p in pairs], indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
