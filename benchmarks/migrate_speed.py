"""Speed of `bench migrate` over a generated tree shaped like a real training repository.

    python benchmarks/migrate_speed.py [--files 1200] [--jobs N] [--cuda-share 0.2] [--keep DIR] [--src DIR ...]
                                       [--against REV [--rounds 3]]

The tree mixes, like the repositories measured in docs/sources.md#cuda-constructs-survey: model/data/utility
modules that never touch CUDA (most files), modules that mention CUDA only in comments,
docstrings or log messages, and training/distributed modules with real CUDA constructs
(torch.cuda calls, .cuda(), device strings, nccl, env vars). Files are 150-450 lines (8.4 KiB on
average; DeepSpeed's .py files average 7.7 KiB, Megatron-LM's 12.8 KiB), about 35% of them mention
CUDA (DeepSpeed 20%, Megatron-LM 35%) and 20% use it in code (Megatron-LM: 24% use torch.cuda).
``--src DIR`` measures an existing tree instead (it is only read; repeat it for several trees in one run).
``--against REV`` measures this checkout's code and git revision REV's (its bench/ and migrate/,
exported into a temporary ``parabench`` package) over the same tree, alternated for ``--rounds``
rounds in fresh interpreters, and prints both medians and their ratio: a comparison measured in one
run on one machine, which the figures of different days on different machine instances are not.

It prints files/s for the whole run (discovery, pre-filter, LibCST where needed, writing the output
tree) by wall clock, and by CPU time: user+sys of this process and all its workers, as
files / (cpu_seconds / jobs), which is what the run gets when the jobs have their cores to
themselves. On a shared machine the wall clock mostly measures the other jobs: the load average
at start and end says how busy it was.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PLAIN_BLOCK = '''

class {name}(nn.Module):
    """{doc}"""

    def __init__(self, dim: int = {dim}, hidden: int = {hidden}, dropout: float = 0.{drop}):
        super().__init__()
        self.proj_in = nn.Linear(dim, hidden, bias=False)
        self.proj_out = nn.Linear(hidden, dim, bias=False)
        self.norm = nn.LayerNorm(dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = self.norm(x)
        h = F.gelu(self.proj_in(h))
        if mask is not None:
            h = h.masked_fill(~mask[..., None], 0.0)
        h = self.dropout(self.proj_out(h))
        return x + h


def {fname}(batch: dict, max_len: int = {dim}) -> dict:
    """Pad and stack a list of token sequences."""
    out = {{}}
    for key, values in batch.items():
        lengths = [len(v) for v in values]
        width = min(max(lengths), max_len)
        padded = torch.zeros(len(values), width, dtype=torch.long)
        for i, v in enumerate(values):
            n = min(len(v), width)
            padded[i, :n] = torch.as_tensor(v[:n])
        out[key] = padded
        out[key + "_len"] = torch.as_tensor(lengths)
    return out
'''

PROSE_BLOCK = '''

def {fname}(model: nn.Module, path: str) -> None:
    """Save a checkpoint; tensors saved on cuda are loaded back on the current device."""
    # NOTE: torch.cuda.synchronize() is not needed here, torch.save copies to host first.
    state = {{"model": model.state_dict(), "step": {dim}}}
    logger.info("saving checkpoint (cuda tensors are moved to cpu)")
    torch.save(state, path)
'''

CUDA_BLOCK = '''

def {fname}(model: nn.Module, loader, args) -> float:
    """One epoch on the GPU."""
    device = torch.device("cuda", args.local_rank)
    torch.cuda.set_device(device)
    model = model.cuda()
    scaler = torch.amp.GradScaler("cuda")
    total = 0.0
    for step, batch in enumerate(loader):
        x = batch["input_ids"].to(device, non_blocking=True)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            loss = model(x).float().mean()
        scaler.scale(loss).backward()
        if step % {dim} == 0:
            torch.cuda.synchronize()
            mem = torch.cuda.max_memory_allocated() / 2**30
            logger.info(f"step {{step}} loss {{loss.item():.3f}} mem {{mem:.1f}} GiB")
        total += loss.item()
    return total


def {fname}_setup(args):
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    dist.init_process_group(backend="nccl")
    return torch.cuda.device_count()
'''

# CUDA code inside a class, as in real trainers (Megatron-LM's optimizers and DDP wrappers,
# DeepSpeed's engine): most methods never touch CUDA, two do.
CUDA_CLASS_BLOCK = '''

class {name}Trainer:
    """Owns the model, the optimizer and the step loop."""

    def __init__(self, model: nn.Module, lr: float = 1e-3, clip: float = 1.0):
        self.model = model
        self.lr = lr
        self.clip = clip
        self.step_count = 0
        self.history: list = []

    def parameters(self):
        return [p for p in self.model.parameters() if p.requires_grad]

    def set_lr(self, lr: float) -> None:
        self.lr = lr
        for group in getattr(self, "groups", []):
            group["lr"] = lr

    def to_device(self, local_rank: int) -> None:
        torch.cuda.set_device(local_rank)
        self.model = self.model.cuda(local_rank)
        self.device = torch.device(f"cuda:{{local_rank}}")

    def clip_grads(self) -> float:
        norms = [p.grad.norm() for p in self.parameters() if p.grad is not None]
        total = torch.stack(norms).norm() if norms else torch.zeros(())
        scale = min(1.0, self.clip / (float(total) + 1e-6))
        for p in self.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
        return float(total)

    def train_step(self, batch: dict) -> float:
        self.model.train()
        x = batch["input_ids"].to(self.device, non_blocking=True)
        loss = self.model(x).float().mean()
        loss.backward()
        self.clip_grads()
        self.step_count += 1
        if self.step_count % {dim} == 0:
            torch.cuda.synchronize()
            logger.info("step %d mem %.1f GiB", self.step_count, torch.cuda.max_memory_allocated() / 2**30)
        return float(loss)

    def state_dict(self) -> dict:
        return {{"model": self.model.state_dict(), "step": self.step_count, "lr": self.lr}}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.step_count = state["step"]
        self.lr = state["lr"]

    def summary(self) -> str:
        n = sum(p.numel() for p in self.parameters())
        return f"{{type(self.model).__name__}}: {{n}} trainable parameters, step {{self.step_count}}"
'''

HEADER = '''"""{doc}"""
import logging
import math
import os
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

logger = logging.getLogger(__name__)
'''


def _module(rng: random.Random, kind: str, idx: int) -> str:
    parts = [HEADER.format(doc=f"Module {idx} of the generated benchmark repository.")]
    blocks = rng.randint(4, 11)
    for b in range(blocks):
        fmt = dict(
            name=f"Block{idx}_{b}",
            fname=f"fn_{idx}_{b}",
            doc="A residual MLP block.",
            dim=rng.choice([64, 128, 256]),
            hidden=rng.choice([256, 512, 1024]),
            drop=rng.randint(0, 3),
        )
        if kind == "cuda" and b % 3 == 1:
            # half the CUDA code sits in top-level functions, half in methods of a larger class
            parts.append((CUDA_CLASS_BLOCK if (idx + b) % 2 else CUDA_BLOCK).format(**fmt))
        elif kind == "prose" and b % 3 == 1:
            parts.append(PROSE_BLOCK.format(**fmt))
        else:
            parts.append(PLAIN_BLOCK.format(**fmt))
    return "".join(parts)


def generate(root: Path, n_files: int, cuda_share: float, prose_share: float, seed: int = 0) -> dict[str, int]:
    rng = random.Random(seed)
    counts = {"cuda": 0, "prose": 0, "plain": 0, "init": 0, "other": 0}
    for i in range(n_files):
        pkg = root / f"pkg{i % 17}" / f"sub{i % 5}"
        pkg.mkdir(parents=True, exist_ok=True)
        r = rng.random()
        if i % 20 == 0:
            (pkg / "__init__.py").write_text('"""Package."""\n')
            counts["init"] += 1
            continue
        kind = "cuda" if r < cuda_share else "prose" if r < cuda_share + prose_share else "plain"
        counts[kind] += 1
        (pkg / f"mod_{i}.py").write_text(_module(rng, kind, i))
    for i in range(n_files // 50):  # a few launch scripts and configs, as in real repositories
        (root / f"run_{i}.sh").write_text(
            "#!/bin/bash\nexport CUDA_VISIBLE_DEVICES=0,1\ntorchrun --nproc_per_node 2 train.py --backend nccl\n"
        )
        (root / f"cfg_{i}.yaml").write_text("trainer:\n  device: cuda\n  backend: nccl\nmodel:\n  dim: 256\n")
        counts["other"] += 2
    return counts


def cpu_seconds() -> float:
    """user+sys of this process and its joined children (the pool's workers)."""
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def measure(srcs: list[Path], out: Path, jobs: int) -> dict:
    """One timed ``bench migrate`` run (the engine's ``run``, as the CLI calls it) over ``srcs``."""
    from parabench.migrate.core import Options
    from parabench.migrate.engine import run

    c0, t0 = cpu_seconds(), time.perf_counter()
    result = run(srcs, Options(), out, jobs=jobs, progress=False)
    dt, dcpu = time.perf_counter() - t0, cpu_seconds() - c0  # workers are joined by now: their time is in CHILDREN
    return {
        "files": len(result.files),
        "py": sum(1 for r in result.files if r.kind == "python"),
        "full": sum(1 for r in result.files if r.full_parse and r.kind == "python"),
        "changed": sum(1 for r in result.files if r.status == "changed"),
        "wall": dt,
        "cpu": dcpu,
    }


def describe_tree(srcs: list[Path], counts) -> str:
    py_files = [p for src in srcs for p in src.rglob("*.py") if p.is_file()]
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in py_files]
    lines = sorted(t.count("\n") for t in texts) or [0]
    mention = sum(1 for t in texts if "cuda" in t.lower())
    code_use = re.compile(r"^(?!\s*#).*(?:torch\.cuda\.|\.cuda\()", re.MULTILINE)  # not in a comment line
    in_code = sum(1 for t in texts if code_use.search(t))
    py_kib = sum(len(t.encode()) for t in texts) / max(1, len(texts)) / 1024
    n = max(1, len(py_files))
    return (
        f"{len(py_files)} .py: {py_kib:.1f} KiB avg, lines min/median/max {lines[0]}/{lines[len(lines) // 2]}/"
        f"{lines[-1]}; {mention / n:.0%} mention cuda, {in_code / n:.0%} use torch.cuda./.cuda() outside comments; {counts}"
    )


def report(m: dict, jobs: int, load0, load1) -> None:
    total, dt, dcpu = m["files"], m["wall"], m["cpu"]
    print(
        f"jobs: {jobs} on {os.cpu_count()} cores; .py files with findings or changes: {m['full']}; changed files: {m['changed']}"
    )
    print(f"wall: {dt:.2f} s -> {total / dt:.1f} files/s")
    cores = min(jobs, os.cpu_count() or 1)
    print(
        f"cpu:  {dcpu:.2f} s user+sys (all processes) -> {total / (dcpu / cores):.1f} files/s on {cores} free cores "
        f"({total / dcpu:.1f} files/s per core)"
    )
    print(
        f"load average (1/5/15 min): start {load0[0]:.1f}/{load0[1]:.1f}/{load0[2]:.1f}, "
        f"end {load1[0]:.1f}/{load1[1]:.1f}/{load1[2]:.1f}"
    )


def export_revision(rev: str, into: Path) -> Path:
    """The ``parabench`` package (bench/ with migrate/ inside, as package-dir maps them) of git
    revision ``rev``, written under ``into``; -> the directory to put on PYTHONPATH."""
    import tarfile

    repo = Path(__file__).resolve().parent.parent
    archive = subprocess.run(
        ["git", "-C", str(repo), "archive", "--format=tar", rev, "bench", "migrate"], check=True, capture_output=True
    ).stdout
    site = into / "site"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            top, _, rest = member.name.partition("/")
            member.name = "parabench/" + rest if top == "bench" else "parabench/migrate/" + rest
            tar.extract(member, site, filter="data")
    return site


def _measured_in_child(srcs: list[Path], out: Path, jobs: int, site: Path | None) -> dict:
    """``measure`` in a fresh interpreter: this checkout's code, or (``site``) another revision's."""
    env = dict(os.environ)
    if site is not None:  # ahead of the editable install's finder (sys.meta_path's PathFinder comes first)
        env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, __file__, "--measure-json", "--jobs", str(jobs), "--out", str(out)]
    cmd += [a for src in srcs for a in ("--src", str(src))]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    m = json.loads(done.stdout.strip().splitlines()[-1])
    want = str(site) if site is not None else str(Path(__file__).resolve().parent.parent)
    if not m["code"].startswith(want):
        raise SystemExit(f"measured the wrong code: parabench.migrate from {m['code']}, expected under {want}")
    shutil.rmtree(out, ignore_errors=True)
    return m


def compare(srcs: list[Path], base: Path, jobs: int, rev: str, rounds: int) -> None:
    """This checkout against revision ``rev``, alternated (which goes first flips each round), in one run."""
    site = export_revision(rev, base)
    runs: dict[str, list[dict]] = {"this checkout": [], rev: []}
    for r in range(rounds):
        order = [("this checkout", None), (rev, site)]
        for name, where in order if r % 2 == 0 else order[::-1]:
            runs[name].append(_measured_in_child(srcs, base / "out", jobs, where))
    cores = min(jobs, os.cpu_count() or 1)
    medians = {}
    for name, ms in runs.items():
        walls = [m["files"] / m["wall"] for m in ms]
        cpus = [m["files"] / (m["cpu"] / cores) for m in ms]
        medians[name] = (statistics.median(walls), statistics.median(cpus))
        print(
            f"{name:>14}: files/s wall {', '.join(f'{w:.1f}' for w in walls)} (median {medians[name][0]:.1f}); "
            f"by CPU time {', '.join(f'{c:.1f}' for c in cpus)} (median {medians[name][1]:.1f})"
        )
    (w_new, c_new), (w_old, c_old) = medians["this checkout"], medians[rev]
    print(
        f"ratio this checkout / {rev}: wall {w_new / w_old:.3f}, by CPU time {c_new / c_old:.3f} (medians of {rounds})"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=1200, help="Python files to generate (default 1200)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count(), help="worker processes (default: all cores)")
    ap.add_argument("--cuda-share", type=float, default=0.2, help="share of modules with real CUDA code")
    ap.add_argument("--prose-share", type=float, default=0.15, help="share mentioning CUDA only in prose")
    ap.add_argument("--keep", type=Path, help="generate into this directory and keep it")
    ap.add_argument("--src", type=Path, action="append", help="measure this existing tree instead (repeatable)")
    ap.add_argument("--against", metavar="REV", help="also measure git revision REV's code, alternated with this one's")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each code with --against (default 3)")
    ap.add_argument("--measure-json", action="store_true", help=argparse.SUPPRESS)  # one run, JSON (--against's child)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.measure_json:
        import parabench.migrate

        m = measure(args.src, args.out, args.jobs)
        print(json.dumps({**m, "code": str(Path(parabench.migrate.__file__).resolve())}))
        return 0
    base = Path(tempfile.mkdtemp(prefix="migrate_speed_")) if args.keep is None else args.keep
    srcs = args.src or [base / "repo"]
    try:
        counts = "existing tree" if args.src else generate(srcs[0], args.files, args.cuda_share, args.prose_share)
        print(f"tree: {describe_tree(srcs, counts)}")
        if args.against:
            compare(srcs, base, args.jobs, args.against, args.rounds)
            return 0
        load0 = os.getloadavg()
        m = measure(srcs, base / "out", args.jobs)
        report(m, args.jobs, load0, os.getloadavg())
    finally:
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
