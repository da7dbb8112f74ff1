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

    python benchmarks/fairness.py [--backends ddp,fsdp,...] [--worlds 1,2] [--rounds 2] [--steps 10] [--warmup 2]
"""

from __future__ import annotations

import argparse
import contextlib
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
class Figures:
    """One run: tokens/s over its measured steps, the same from its median step alone (less moved
    by a few steps that other processes on the machine slowed down), its loss at step 0."""

    tokens_per_s: float
    median_step_tokens_per_s: float
    first_loss: float


@dataclass(frozen=True)
class Pair:
    """One backend at one world size: each round's tokens/s of both sides, and the same from each
    run's median step (``*_step``)."""

    backend: str
    world: int
    native: tuple[float, ...]
    harness: tuple[float, ...]
    native_step: tuple[float, ...] = ()
    harness_step: tuple[float, ...] = ()

    @property
    def ratio(self) -> float:
        """harness / native of the medians."""
        return statistics.median(self.harness) / statistics.median(self.native)

    @property
    def step_ratio(self) -> float:
        """harness / native of the medians of the runs' median-step tokens/s."""
        return statistics.median(self.harness_step) / statistics.median(self.native_step)

    @property
    def spread(self) -> tuple[float, float]:
        """(min, max) of harness / native within each round."""
        ratios = [h / n for n, h in zip(self.native, self.harness, strict=True)]
        return min(ratios), max(ratios)

    def line(self) -> str:
        lo, hi = self.spread
        return (
            f"| {self.backend:<9} | {self.world} | {statistics.median(self.native):8.1f} | "
            f"{statistics.median(self.harness):8.1f} | {self.ratio:.3f} | {lo:.3f}-{hi:.3f} | {self.step_ratio:.3f} |"
        )


TABLE_HEAD = (
    "| backend   | ranks | native tokens/s | bench run tokens/s | bench/native | spread (per round) | median-step bench/native |\n"
    "|-----------|-------|-----------------|--------------------|--------------|--------------------|--------------------------|"
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


def slowest_rank(rank_times: Sequence[Sequence[float]]) -> list[float]:
    """Per measured step, the slowest rank's time (parabench.metrics.summarize's step_times_max)."""
    return [max(times[i] for times in rank_times) for i in range(len(rank_times[0]))]


def tokens_per_s(rank_times: Sequence[Sequence[float]], tokens_per_step: int) -> float:
    """tokens per step x steps / sum over steps of the slowest rank's time (parabench.metrics.summarize)."""
    slowest = slowest_rank(rank_times)
    return tokens_per_step * len(slowest) / sum(slowest)


def native_figures(out: Path) -> Figures:
    """A native run's figures from its rank files."""
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    times, tokens = [r["step_times"] for r in ranks], ranks[0]["tokens_per_step"]
    first_loss = statistics.fmean(r["first_loss"] for r in ranks)
    return Figures(tokens_per_s(times, tokens), tokens / statistics.median(slowest_rank(times)), first_loss)


def harness_figures(summary: dict) -> Figures:
    """A `bench run`'s figures from its summary.json."""
    tokens = summary["tokens_per_step"]
    return Figures(summary["tokens_per_s"], tokens / summary["step_time_median_s"], summary["loss_first"])


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
    from parabench.devices import cpu_threads
    from parabench.hydraconfig import compose, to_plain
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


def native(backend: str, world: int, overrides: list[str], work: Path) -> Figures:
    out = Path(tempfile.mkdtemp(prefix=f"native-{backend}-x{world}-", dir=work))
    run_checked(native_command(backend, world, out, overrides), native_env(backend, world), f"native {backend}")
    return native_figures(out)


def harness(overrides: list[str], results: Path) -> Figures:
    before = set(results.glob("runs/*/*/*/summary.json"))
    cmd = [sys.executable, "-m", "parabench", "run", *overrides, f"run.results_dir={results}", "tracking.enabled=false"]
    run_checked(cmd, {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}, "bench run")
    (new,) = set(results.glob("runs/*/*/*/summary.json")) - before
    return harness_figures(json.loads(new.read_text()))


def measure(backend: str, world: int, args: argparse.Namespace, work: Path) -> Pair:
    overrides = job_overrides(backend, world, args.warmup, args.steps)
    natives: list[Figures] = []
    harnesses: list[Figures] = []
    for r in range(args.rounds):
        natives.append(native(backend, world, overrides, work))
        harnesses.append(harness(overrides, work / "results"))
        print(round_line(backend, world, r, natives[-1], harnesses[-1]), flush=True)
    return pair_of(backend, world, natives, harnesses)


def round_line(backend: str, world: int, r: int, n: Figures, h: Figures) -> str:
    return (
        f"{backend} x{world} round {r + 1}: native {n.tokens_per_s:.1f} tokens/s, bench run {h.tokens_per_s:.1f} "
        f"tokens/s, ratio {h.tokens_per_s / n.tokens_per_s:.3f} (median step: {h.median_step_tokens_per_s / n.median_step_tokens_per_s:.3f}); "
        f"loss at step 0: native {n.first_loss:.6f}, bench run {h.first_loss:.6f}"
    )


def pair_of(backend: str, world: int, natives: list[Figures], harnesses: list[Figures]) -> Pair:
    return Pair(
        backend,
        world,
        tuple(f.tokens_per_s for f in natives),
        tuple(f.tokens_per_s for f in harnesses),
        tuple(f.median_step_tokens_per_s for f in natives),
        tuple(f.median_step_tokens_per_s for f in harnesses),
    )


def pairs_from_kept(work: Path) -> list[Pair]:
    """The pairs of a run kept with --keep (also an interrupted one): the k-th native run of a
    backend and world size with its k-th `bench run`, in the order they ran."""
    natives: dict[tuple[str, int], list[Figures]] = {}
    for out in sorted(work.glob("native-*"), key=lambda p: p.stat().st_mtime):
        if any(out.glob("rank*.json")):
            backend, world = out.name.split("-")[1], len(list(out.glob("rank*.json")))
            natives.setdefault((backend, world), []).append(native_figures(out))
    harnesses: dict[tuple[str, int], list[Figures]] = {}
    for path in sorted(work.glob("results/runs/*/*/*/summary.json")):  # timestamped directories
        summary = json.loads(path.read_text())
        harnesses.setdefault((summary["backend"], summary["world_size"]), []).append(harness_figures(summary))
    pairs = []
    for key, ns in natives.items():
        hs = harnesses.get(key, [])
        n = min(len(ns), len(hs))
        if n:
            pairs.append(pair_of(*key, ns[:n], hs[:n]))
    return pairs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--backends", default=",".join(BACKENDS), help=f"comma-separated, of {', '.join(BACKENDS)}")
    p.add_argument("--worlds", default="1,2", help="comma-separated world sizes (ranks on this host)")
    p.add_argument("--rounds", type=int, default=2, help="alternating native/harness rounds per backend and world")
    p.add_argument("--steps", type=int, default=10, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps per run (run, not measured)")
    p.add_argument("--json", type=Path, help="also write the per-round figures to this file")
    p.add_argument("--keep", type=Path, help="keep every run's files in this directory (default: a temporary one)")
    p.add_argument("--from-kept", type=Path, help="run nothing: print the table of a directory kept with --keep")
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
    if args.from_kept:
        print(TABLE_HEAD)
        for pair in pairs_from_kept(args.from_kept):
            print(pair.line())
        return 0
    started = time.monotonic()
    pairs, failed = [], []
    with contextlib.ExitStack() as stack:
        work = args.keep or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fairness-")))
        work.mkdir(parents=True, exist_ok=True)
        for backend in args.backends:
            for world in args.worlds:
                try:
                    pairs.append(measure(backend, world, args, work))
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
        figures = [vars(p) | {"ratio": p.ratio, "spread": p.spread, "step_ratio": p.step_ratio} for p in pairs]
        args.json.write_text(json.dumps(figures, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
