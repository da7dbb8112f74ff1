"""Peak host memory and wall time of `bench convert` against a plain copy of the same bytes (issue 30).

    python benchmarks/convert_speed.py [--size tiny|small|0.3b|0.5b] [--keep DIR] [--via auto|files|launch]

Trains a Llama of the chosen size one step under DeepSpeed ZeRO-3 on 2 CPU ranks and checkpoints it
(with --keep, a checkpoint already in DIR is reused), then converts that checkpoint to Megatron tp=2
(2 ranks) with `bench convert` (from files to files unless --via launch), which records its
wall time, the bytes it read and wrote and the peak host memory of bench and all its workers
(convert.json; parabench.hostmem). In the same run it reads the source files and writes the same
number of bytes the conversion wrote, plainly (8 MiB blocks, no fsync, like the conversion's own
writers), and prints both ratios the acceptance names:

* peak host memory / the full fp32 state (weights + AdamW exp_avg + exp_avg_sq: 12 bytes a parameter);
* conversion wall time / plain read+write wall time.

The source checkpoint was just written, so both the conversion and the plain copy read it from the
page cache. On a shared machine the wall clock also measures the other jobs: the load average at
start and end is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BLOCK = 8 * 2**20
# model overrides per size; 0.5b: 24 layers, hidden 1024, 16 heads, MLP 4096, vocab 50176 = 505.5M parameters.
# Writing its ZeRO-3 source needs more than a 23 GiB host: the training step's rank was OOM-killed at 11.8 GB
# resident (2026-12-06), so 0.3b is the largest size measured here.
SIZES = {
    "tiny": [
        "model.vocab_size=512",
        "model.hidden_size=64",
        "model.intermediate_size=128",
        "model.num_hidden_layers=2",
    ],
    "small": [],  # conf/model/llama.yaml: 19.3M parameters
    "0.3b": [  # 0.5b's shape with 12 layers: 304M parameters
        "model.vocab_size=50176",
        "model.hidden_size=1024",
        "model.intermediate_size=4096",
        "model.num_hidden_layers=12",
        "model.num_attention_heads=16",
        "model.num_key_value_heads=16",
    ],
    "0.5b": [
        "model.vocab_size=50176",
        "model.hidden_size=1024",
        "model.intermediate_size=4096",
        "model.num_hidden_layers=24",
        "model.num_attention_heads=16",
        "model.num_key_value_heads=16",
    ],
}
COMMON = [
    "+model=llama",
    "data.seq_len=16",
    "data.global_batch_size=2",
    "data.micro_batch_size=1",
    "launcher.nproc_per_node=2",
    "tracking.enabled=false",
    "run.warmup_steps=0",
]


def _bench(args: list[str]) -> None:
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.run([sys.executable, "-m", "parabench", *args], cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"bench {args[0]} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    print(proc.stdout.strip(), flush=True)


def source_checkpoint(work: Path, size: str) -> Path:
    """One ZeRO-3 step on 2 ranks, checkpointed."""
    results = work / "train"
    args = ["run", *COMMON, *SIZES[size], "backend=deepspeed", "backend.zero_stage=3"]
    _bench([*args, "run.steps=1", "run.checkpoint.every=1", f"run.results_dir={results}"])
    (ckpt,) = results.glob("runs/*/*/deepspeed/checkpoints/step_000001")
    return ckpt


def synthetic_checkpoint(work: Path, size: str) -> Path:
    """A parabench ZeRO-3 checkpoint of 2 ranks at ``size`` whose DeepSpeed files are written here
    (random fp32 weights and moments, step 1, laid out as ZeRO-3 lays them out: each parameter's
    ceil(n/2) values per rank, in param_shapes order) and whose marker and harness files are a tiny
    ZeRO-3 run's, its model replaced: for sizes whose training step does not fit this host."""
    import numpy as np
    import torch

    from parabench.hydraconfig import compose, to_plain
    from parabench.jobs import from_config
    from parabench.resilience.checkpoint import MODEL_IGNORED
    from parabench.spec import to_dict

    tiny = source_checkpoint(work / "tiny", "tiny")
    spec = from_config(to_plain(compose(["+model=llama", *SIZES[size]]))).model
    ckpt = work / "synthetic" / tiny.name
    shutil.copytree(tiny / "harness", ckpt / "harness")
    tag = ckpt / "native" / "global_step1"
    tag.mkdir(parents=True)
    (ckpt / "native" / "latest").write_text(tag.name)
    shapes = spec.parameter_shapes()
    groups = [[n for n in shapes if not n.endswith("norm.weight")], [n for n in shapes if n.endswith("norm.weight")]]
    for rank in range(2):
        flat = {}
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            flat[state] = []
            for names in groups:
                parts = []
                for i, name in enumerate(names):  # the same values on both ranks' passes: seeded by name
                    rng = np.random.default_rng([i, len(name), ("fp32", "exp_avg", "exp_avg_sq").index(state)])
                    values = rng.standard_normal(int(np.prod(shapes[name])), dtype=np.float32)
                    if state == "exp_avg_sq":
                        values *= values
                    part = -(-values.size // 2)
                    values = np.concatenate([values, np.zeros(2 * part - values.size, np.float32)])
                    parts.append(values[rank * part : (rank + 1) * part].copy())
                    del values
                flat[state].append(torch.from_numpy(np.concatenate(parts)))
                del parts
        base = {i: {"step": torch.tensor(1.0), "exp_avg": flat["exp_avg"][i], "exp_avg_sq": flat["exp_avg_sq"][i]}
                for i in range(len(groups))}  # fmt: skip
        optim = {"fp32_flat_groups": flat["fp32"], "optimizer_state_dict": {"state": base, "param_groups": []}}
        torch.save({"optimizer_state_dict": optim}, tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
        del flat, base, optim
        param_shapes = [{n: torch.Size(shapes[n]) for n in names} for names in groups]
        states = {"param_shapes": param_shapes, "dp_world_size": 2, "mp_world_size": 1}
        torch.save(states, tag / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
    marker = json.loads((tiny / "COMPLETE").read_text())
    marker["job"]["model"] = {k: v for k, v in to_dict(spec).items() if k not in MODEL_IGNORED}
    files = sorted(p for p in ckpt.rglob("*") if p.is_file())
    marker["files"] = {str(p.relative_to(ckpt)): p.stat().st_size for p in files}
    (ckpt / "COMPLETE").write_text(json.dumps(marker, indent=1))
    return ckpt


def plain_copy(src: Path, dest: Path, write_bytes: int) -> float:
    """Seconds to read every file under ``src`` and write ``write_bytes`` bytes of it to ``dest``."""
    dest.mkdir(parents=True)
    t0, left = time.monotonic(), write_bytes
    with open(dest / "copy.bin", "wb") as out:
        for path in sorted(p for p in src.rglob("*") if p.is_file()):
            with open(path, "rb") as f:
                while block := f.read(BLOCK):
                    take = block[: max(left, 0)]
                    out.write(take)
                    left -= len(take)
        block = b"\0" * BLOCK
        while left > 0:  # the conversion may write more than it read (e.g. Megatron's grad-free files)
            out.write(block[:left])
            left -= min(left, BLOCK)
    return time.monotonic() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--keep", type=Path, help="work here and keep the files (default: a temporary directory)")
    parser.add_argument(
        "--synthetic",
        action="store_true",
        help="write the ZeRO-3 source's files directly (random state) instead of training a step: the "
        "0.5b step does not fit this host",
    )
    parser.add_argument(
        "--via",
        choices=("auto", "files", "launch"),
        default="auto",
        help="bench convert's --via: files (no framework launched; what auto takes for this pair) or launch",
    )
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="convert_speed_"))
    print(f"load average at start: {os.getloadavg()}", flush=True)
    try:
        pattern = "synthetic/step_000001" if args.synthetic else "train/runs/*/*/deepspeed/checkpoints/step_000001"
        ckpt = next(work.glob(pattern), None) if args.keep else None  # --keep: a source written there is reused
        ckpt = ckpt or (synthetic_checkpoint if args.synthetic else source_checkpoint)(work, args.size)
        out = work / "megatron"
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(work / "plain", ignore_errors=True)
        to = ["--to", "megatron", "backend.tp=2", "launcher.nproc_per_node=2", "--via", args.via, "--out", str(out)]
        _bench(["convert", str(ckpt), *to])
        record = json.loads((out / "convert.json").read_text())
        shutil.rmtree(out)  # room on the disk for the plain copy (the 0.5B conversion writes about 12 GB)
        plain_s = plain_copy(ckpt, work / "plain", record["written_file_bytes"])
        state = record["bytes"]  # the canonical state: fp32 weights + both moments
        summary = {
            "size": args.size,
            "source": "synthetic" if args.synthetic else "one ZeRO-3 training step",
            "via": record.get("via"),
            "state_bytes": state,
            "peak_host_memory_bytes": record["peak_host_memory_bytes"],
            "peak_over_state": round(record["peak_host_memory_bytes"] / state, 3),
            "seconds": record["seconds"],
            "read_bytes": record["source_file_bytes"],
            "written_bytes": record["written_file_bytes"],
            "plain_copy_seconds": round(plain_s, 2),
            "time_over_plain_copy": round(record["seconds"] / plain_s, 2),
            "load_average_end": os.getloadavg(),
        }
        print(json.dumps(summary, indent=1))
        print(
            f"peak host memory {summary['peak_over_state']:.1%} of the fp32 state (target <= 40%); "
            f"wall time {summary['time_over_plain_copy']}x the plain copy (target <= 3x)"
        )
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
