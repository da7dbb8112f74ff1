"""bench convert (issue 19, docs/convert.md): a DeepSpeed ZeRO-3 checkpoint carried to FSDP resumes as
an uninterrupted DDP run does; DeepSpeed -> canonical -> DeepSpeed is bitwise in DeepSpeed's own files;
the Hugging Face export reads back as the same model; bad input is refused before anything is written.

One tiny model (2 layers, hidden 64, vocab 512) keeps every launch short: the DeepSpeed run that
writes the source checkpoint is shared by the module's tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import FAST, TINY, bench

DS3 = ["backend=deepspeed", "backend.zero_stage=3"]
MEGATRON = ["backend.tp=2", "backend.pp=2", "launcher.nproc_per_node=4"]
STEPS = 20
SAVED = 10


def _losses(results: Path, backend: str) -> list[float]:
    (path,) = results.glob(f"runs/*/*/{backend}/ranks/rank0.json")
    return json.loads(path.read_text())["losses"]


def _run(args: list[str], results: Path):
    proc = bench(["run", *FAST, *TINY, *args], results)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _convert(args: list[str]):
    proc = bench(["convert", *args], Path("."))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def ds_checkpoint(tmp_path_factory) -> tuple[Path, Path]:
    """ZeRO-3 on 2 ranks, checkpointed after step 10 (run to 11). Only the tests that use it need
    DeepSpeed (the module's other conversions run without it)."""
    pytest.importorskip("deepspeed")
    results = tmp_path_factory.mktemp("ds")
    _run([*DS3, f"run.steps={SAVED + 1}", f"run.checkpoint.every={SAVED}"], results)
    (ckpt,) = results.glob(f"runs/*/*/deepspeed/checkpoints/step_{SAVED:06d}")
    return results, ckpt


@pytest.fixture(scope="module")
def ddp_losses(tmp_path_factory) -> list[float]:
    """The uninterrupted reference: ddp on 2 ranks for 20 steps."""
    results = tmp_path_factory.mktemp("ddp")
    _run(["backend=ddp", f"run.steps={STEPS}"], results)
    return _losses(results, "ddp")


@pytest.fixture(scope="module")
def to_fsdp(ds_checkpoint, tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("conv") / "fsdp"
    return out, _convert([str(ds_checkpoint[1]), "--to", "fsdp", "--out", str(out), *TINY[:-2]])


@pytest.mark.full
@pytest.mark.deepspeed
def test_deepspeed_zero3_to_fsdp_resumes_like_ddp(ds_checkpoint, to_fsdp, ddp_losses, tmp_path):
    out, printed = to_fsdp
    record = json.loads((out / "convert.json").read_text())
    assert record["checksum_before"] == record["checksum_after"], printed
    assert "(match)" in printed and "optimizer state: included" in printed, printed
    assert "deepspeed (deepspeed; world_size=2 dp=2 zero_stage=3; fp32) step 10" in printed, printed
    assert (out / f"step_{SAVED:06d}" / "COMPLETE").is_file()

    _run(["backend=fsdp", f"run.steps={STEPS}", f"run.resume={out}"], tmp_path / "fsdp")
    resumed, reference = _losses(tmp_path / "fsdp", "fsdp"), ddp_losses
    source = _losses(ds_checkpoint[0], "deepspeed")
    assert len(resumed) == len(reference) == STEPS
    assert resumed[:SAVED] == source[:SAVED]  # the loss history travels with the harness state
    rel = [abs(a - b) / abs(b) for a, b in zip(resumed, reference, strict=True)]
    print(f"fsdp resumed from the converted ZeRO-3 checkpoint vs ddp: max relative {max(rel):.3g}")
    assert max(rel[SAVED:]) < 1e-5, rel


def _tensors(value, prefix: str = ""):
    """Every tensor inside a (nested) torch.load result, by its path."""
    import torch

    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, dict):
        for k in sorted(value, key=str):
            yield from _tensors(value[k], f"{prefix}/{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _tensors(v, f"{prefix}/{i}")


@pytest.mark.full
@pytest.mark.deepspeed
def test_deepspeed_round_trip_is_bitwise(ds_checkpoint, tmp_path):
    """ZeRO-3 -> canonical -> ZeRO-3 with the same layout: every tensor of DeepSpeed's own files
    (fp32 partitions, both moments, step) and the harness state are bit-for-bit the original's."""
    import torch

    out = tmp_path / "ds"
    printed = _convert([str(ds_checkpoint[1]), "--to", "deepspeed", "--out", str(out), *TINY[:-2]])
    assert "(match)" in printed, printed
    new = out / f"step_{SAVED:06d}"
    for old_file in sorted((ds_checkpoint[1] / "native").rglob("*.pt")):
        rel = old_file.relative_to(ds_checkpoint[1] / "native")
        a = dict(_tensors(torch.load(old_file, weights_only=False, map_location="cpu")))
        b = dict(_tensors(torch.load(new / "native" / rel, weights_only=False, map_location="cpu")))
        assert a.keys() == b.keys(), rel
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), f"{rel}{key}"
    for r in range(2):
        a = torch.load(ds_checkpoint[1] / "harness" / f"rank{r}.pt", weights_only=True)
        b = torch.load(new / "harness" / f"rank{r}.pt", weights_only=True)
        assert (a["step"], a["history"], a["ledger"]) == (b["step"], b["history"], b["ledger"])
        assert torch.equal(a["rng"]["torch"], b["rng"]["torch"])


@pytest.fixture(scope="module")
def hf_export(to_fsdp, tmp_path_factory) -> tuple[Path, str]:
    """--to hf from the canonical directory of the ZeRO-3 -> fsdp conversion (no launch)."""
    out = tmp_path_factory.mktemp("hf") / "hf"
    return out, _convert([str(to_fsdp[0] / "canonical"), "--to", "hf", "--out", str(out)])


def _canonical_model(canonical_dir: Path):
    """The canonical model (parabench.model) holding the weights of a canonical directory, and its spec."""
    from parabench.jobs import model_spec
    from parabench.model import build_llama, load_canonical

    model = json.loads((canonical_dir / "manifest.json").read_text())["source"]["job"]["model"]
    spec = model_spec({**model, "name": "canonical", "weights": str(canonical_dir / "model.safetensors")})
    canon = build_llama(spec)
    load_canonical(canon, spec, seed=0)
    return canon, spec


def continued_by_hand(canonical_dir: Path, steps: int) -> list[float]:
    """The losses of ``steps`` optimizer steps after a canonical checkpoint, computed here without any
    backend: the canonical model with the checkpoint's weights, torch.optim.AdamW holding its moments
    and step (decay on 2-D weights; conf/optim/adamw.yaml's values), global-norm clipping at 1.0, and
    the global batches parabench's synthetic data gives for those steps (FAST + TINY geometry). The
    reference a backend resumed from a converted checkpoint must reproduce."""
    import torch

    from parabench import canonical
    from parabench.data import TokenSource
    from parabench.hydraconfig import compose, to_plain
    from parabench.jobs import from_config
    from parabench.model import causal_lm_loss

    model, spec = _canonical_model(canonical_dir)
    state, _ = canonical.load(canonical_dir)
    named = dict(model.named_parameters())
    decay = [p for p in named.values() if p.dim() == 2]
    rest = [p for p in named.values() if p.dim() != 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
    for name, param in named.items():
        opt.state[param] = {
            "step": torch.tensor(float(state.step)),
            **{key: state.moments[key][name].clone().float() for key in canonical.MOMENTS},
        }
    job = from_config(to_plain(compose([*FAST, *(a for a in TINY if a.startswith("model."))])))
    source = TokenSource(job.data, spec.vocab_size)
    losses = []
    for step in range(state.step, state.step + steps):
        batch = torch.from_numpy(source.global_batch(step))
        loss = causal_lm_loss(model(batch[:, :-1]), batch[:, 1:])
        losses.append(loss.item())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return losses


def _tokens(vocab_size: int):
    import torch

    return torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.full
@pytest.mark.deepspeed
def test_hf_export_reads_back_as_the_same_model(to_fsdp, hf_export):
    """--to hf: config.json + model.safetensors that parabench's Hugging Face reader (names, shapes,
    dtypes) takes as the same model, whose logits are the canonical ones."""
    import torch
    from safetensors import safe_open

    from parabench.hf import check_weights, spec_fields
    from parabench.jobs import model_spec
    from parabench.model import build_llama

    out, printed = hf_export
    assert "optimizer state: not included in the hf export" in printed, printed
    record = json.loads((out / "convert.json").read_text())  # weights only, read back from the export
    assert record["checksum_scope"] == "weights" and record["checksum_before"] == record["checksum_after"]
    assert "weights checksum: before" in printed and "(match)" in printed, printed
    spec = model_spec(spec_fields({"path": str(out)}))
    check_weights(spec)  # every canonical name with its shape, nothing else
    source = json.loads((to_fsdp[0] / "canonical" / "manifest.json").read_text())["source"]["job"]["model"]
    assert {k: getattr(spec, k) for k in source if k != "rope_scaling"} == {
        k: v for k, v in source.items() if k != "rope_scaling"
    }
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_slice(n).get_dtype() for n in f.keys()} == {"F32"}
        assert set(f.keys()) == set(spec.parameter_shapes())
    hf_model, (canon, _) = build_llama(spec, seed=0), _canonical_model(to_fsdp[0] / "canonical")
    tokens = _tokens(spec.vocab_size)
    with torch.no_grad():
        assert torch.equal(hf_model(tokens), canon(tokens))


@pytest.mark.full
@pytest.mark.deepspeed
def test_hf_export_loads_in_transformers_with_the_same_logits(to_fsdp, hf_export):
    """The issue's check: transformers' own LlamaForCausalLM.from_pretrained reads the --to hf export
    (config.json + model.safetensors) and gives the canonical model's logits within 1e-5."""
    transformers = pytest.importorskip("transformers")
    import torch

    out, _ = hf_export
    model = transformers.LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    canon, spec = _canonical_model(to_fsdp[0] / "canonical")
    tokens = _tokens(spec.vocab_size)
    with torch.no_grad():
        theirs, ours = model(tokens).logits, canon(tokens)
    diff = (theirs - ours).abs().max().item()
    print(f"transformers {transformers.__version__} LlamaForCausalLM vs canonical logits: max abs diff {diff:.3g}")
    assert theirs.shape == ours.shape and diff < 1e-5, diff


def _refused(argv: list[str], must_name: str, out: Path, capsys) -> None:
    from parabench.cli import main

    code = main(["convert", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("bench: error:") and must_name in err, err
    assert "Traceback" not in err and not out.exists()


@pytest.mark.full
@pytest.mark.deepspeed
def test_bad_input_is_refused_before_anything_is_written(ds_checkpoint, tmp_path, capsys):
    ckpt, out = ds_checkpoint[1], tmp_path / "out"
    _refused([str(ckpt), "--to", "fsdp", "--out", str(out), "model.hidden_size=128"], "model.hidden_size", out, capsys)
    _refused([str(ckpt), "--to", "megatron", "--out", str(out), "backend.tp=3"], "backend.tp", out, capsys)
    partial = tmp_path / "partial"
    shutil.copytree(ckpt, partial)
    (partial / "harness" / "rank1.pt").unlink()
    _refused([str(partial), "--to", "fsdp", "--out", str(out)], "rank1.pt is missing", out, capsys)
    future = tmp_path / "future"
    future.mkdir()
    (future / "manifest.json").write_text(json.dumps({"format": "parabench-canonical", "version": 99}))
    _refused([str(future), "--to", "fsdp", "--out", str(out)], "version 99", out, capsys)


def _tiny_hf(directory: Path) -> Path:
    """A Hugging Face directory (config.json + model.safetensors) holding the tiny model's canonical
    initial weights: what the uninterrupted ddp run starts from."""
    import torch
    from safetensors.torch import save_file

    from parabench.hf import hf_config
    from parabench.hydraconfig import compose, to_plain
    from parabench.jobs import prepare
    from parabench.model import initial_weights

    job = prepare(to_plain(compose(["backend=ddp", *FAST, *TINY])))
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(hf_config(job.model)))
    weights = initial_weights(job.model, job.run.seed)
    save_file({n: torch.from_numpy(w) for n, w in weights.items()}, str(directory / "model.safetensors"))
    return directory


def _assert_measured(record: dict, src: Path, out: Path, printed: str) -> None:
    """convert.json's throughput and memory figures are what they say: the bytes of the source's
    files and of those written to --out (its work folder aside; convert.json and the MLflow spool,
    as $MLFLOW_TRACKING_URI may ask, are written after it), over the seconds; the peak host memory holds at least bench and a worker that imported torch."""
    from parabench.convert.command import RECORD, WORK

    def size(root: Path, skip: set[Path]) -> int:
        return sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and not skip & {f, *f.parents})

    assert record["source_file_bytes"] == size(src, set()), record
    assert record["written_file_bytes"] == size(out, {out / WORK, out / RECORD, out / "tracking"}), record
    for key, total in (("read_bytes_per_s", "source_file_bytes"), ("written_bytes_per_s", "written_file_bytes")):
        assert record[key] == pytest.approx(record[total] / record["seconds"], rel=0.01), record
    assert record["peak_host_memory_bytes"] > 200 * 2**20, record
    assert f"peak host memory {record['peak_host_memory_bytes'] / 2**20:.0f} MiB" in printed, printed


@pytest.mark.e2e
def test_hf_source_to_ddp_resumes_as_a_fresh_run(ddp_losses, tmp_path, capsys):
    """A Hugging Face directory as SOURCE: weights only, so the target starts fresh AdamW moments at
    step 0; resumed for 20 steps on ddp x2 it is the uninterrupted ddp run, bit for bit (same weights,
    same arithmetic). Then its bad input: no weights, another architecture, a mismatched shape."""
    hf, out = _tiny_hf(tmp_path / "hf"), tmp_path / "ddp"
    printed = _convert([str(hf), "--to", "ddp", "--out", str(out), *TINY[-2:]])
    record = json.loads((out / "convert.json").read_text())
    assert "bench convert: hf (safetensors; LlamaForCausalLM; weights only) step 0" in printed, printed
    assert "(match)" in printed and record["checksum_before"] == record["checksum_after"], printed
    assert "optimizer state: fresh AdamW, zero moments at step 0 (the source is a Hugging Face" in printed, printed
    assert record["fresh_optimizer"] and record["source"]["format"] == "hf", record
    _assert_measured(record, hf, out, printed)
    _run(["backend=ddp", f"run.steps={STEPS}", f"run.resume={out}"], tmp_path / "r_ddp")
    resumed = _losses(tmp_path / "r_ddp", "ddp")
    print(f"ddp resumed from the converted hf directory vs ddp: {resumed == ddp_losses} bitwise")
    assert resumed == ddp_losses, (resumed, ddp_losses)
    by_hand = continued_by_hand(out / "canonical", 3)  # the backend-free reference the native sources use
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(resumed[:3], by_hand, strict=True)), (resumed[:3], by_hand)

    bad = tmp_path / "bad"
    (bad / "config.json").parent.mkdir()
    (bad / "config.json").write_text((hf / "config.json").read_text())
    _refused([str(bad), "--to", "ddp", "--out", str(tmp_path / "o1")], "no weights to convert", tmp_path / "o1", capsys)
    config = json.loads((hf / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    _refused([str(bad), "--to", "ddp", "--out", str(tmp_path / "o2")], "GPT2LMHeadModel", tmp_path / "o2", capsys)
    (bad / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    shutil.copyfile(hf / "model.safetensors", bad / "model.safetensors")
    _refused([str(bad), "--to", "ddp", "--out", str(tmp_path / "o3")], "has shape [128, 64]", tmp_path / "o3", capsys)


def _relative(resumed: list[float], reference: list[float]) -> float:
    assert len(resumed) == len(reference) == STEPS
    return max(abs(a - b) / abs(b) for a, b in zip(resumed[SAVED:], reference[SAVED:], strict=True))


@pytest.mark.full
@pytest.mark.deepspeed
@pytest.mark.megatron
def test_deepspeed_to_megatron_tp2_and_pp2_and_back_to_zero1(ds_checkpoint, ddp_losses, tmp_path):
    """ZeRO-3 -> megatron tp=2 (fused QKV and gate/up TP splits) resumed, ZeRO-3 -> megatron pp=2
    (stage assignment) resumed, and the tp=2 checkpoint -> ZeRO-1 resumed: each within 1e-5 of the
    uninterrupted ddp run. tp=2 x pp=2 (4 ranks) converts with matching checksums (read back
    through Megatron's own loader). The ZeRO-3 checkpoint is exported (a DeepSpeed launch) once, by
    the tp=2 conversion: the pp=2 and tp=2 x pp=2 conversions import that same canonical state."""
    pytest.importorskip("megatron.core")
    rel = {}
    exported = tmp_path / "tp2" / "canonical"  # the ZeRO-3 checkpoint's canonical state, written by the tp=2 conversion
    for name, layout, source in (("tp2", ["backend.tp=2"], ds_checkpoint[1]), ("pp2", ["backend.pp=2"], exported)):
        to_mg = tmp_path / name
        # --via launch: through DeepSpeed's and Megatron's own load and save, writing canonical/ on the
        # way (ZeRO-3 -> megatron tp=2 goes from files to files by default: the test below)
        via = ["--via", "launch"]
        printed = _convert([str(source), "--to", "megatron", *layout, *via, "--out", str(to_mg), *TINY[:-2]])
        assert "(match)" in printed and f"{layout[0].split('.')[1]} world_size=2" in printed, printed
        _run(["backend=megatron", *layout, f"run.steps={STEPS}", f"run.resume={to_mg}"], tmp_path / f"r_{name}")
        rel[f"megatron {name}"] = _relative(_losses(tmp_path / f"r_{name}", "megatron"), ddp_losses)

    back = tmp_path / "zero1"
    zero1 = ["backend.zero_stage=1", "launcher.nproc_per_node=2"]
    printed = _convert([str(tmp_path / "tp2"), "--to", "deepspeed", *zero1, "--out", str(back)])
    assert "(match)" in printed and "megatron" in printed and "zero_stage=1" in printed, printed
    _run(["backend=deepspeed", *zero1, f"run.steps={STEPS}", f"run.resume={back}"], tmp_path / "r_ds")
    rel["deepspeed ZeRO-1 from megatron tp2"] = _relative(_losses(tmp_path / "r_ds", "deepspeed"), ddp_losses)
    print("vs ddp, steps 11-20:", {k: f"{v:.3g}" for k, v in rel.items()})
    assert all(v < 1e-5 for v in rel.values()), rel

    printed = _convert([str(exported), "--to", "megatron", *MEGATRON, "--out", str(tmp_path / "tp2pp2"), *TINY[:-2]])
    assert "(match)" in printed and "tp=2 pp=2 world_size=4" in printed, printed


def _same_megatron_checkpoint(a: Path, b: Path) -> None:
    """Two parabench megatron checkpoints hold the same thing: DCP keys, global shapes and chunks,
    every tensor and extra state bit for bit, common.pt, metadata.json, the harness files byte for
    byte, and markers that differ only in their time and the names of the .distcp files."""
    import io
    import pickle

    import torch

    def items(step: Path) -> dict:
        with open(step / "native" / ".metadata", "rb") as f:
            meta = pickle.load(f)
        out = {}
        for index, info in meta.storage_data.items():
            with open(step / "native" / info.relative_path, "rb") as f:
                f.seek(info.offset)
                raw = f.read(info.length)
            value = raw if index.offset is None else torch.load(io.BytesIO(raw), weights_only=True)
            out[(index.fqn, None if index.offset is None else tuple(index.offset))] = value
        shapes = {
            k: (tuple(v.size), sorted(map(repr, v.chunks))) if hasattr(v, "chunks") else "bytes"
            for k, v in meta.state_dict_metadata.items()
        }
        return {"items": out, "shapes": shapes}

    x, y = items(a), items(b)
    assert x["shapes"] == y["shapes"]
    assert x["items"].keys() == y["items"].keys()
    for key, value in x["items"].items():
        other = y["items"][key]
        same = (
            value == other
            if isinstance(value, bytes)
            else torch.equal(value.view(torch.int32), other.view(torch.int32))
        )
        assert same, key
    common = [repr(torch.load(s / "native" / "common.pt", weights_only=True)) for s in (a, b)]
    assert common[0] == common[1]
    assert (a / "native" / "metadata.json").read_text() == (b / "native" / "metadata.json").read_text()
    for rank in sorted((a / "harness").iterdir()):
        assert rank.read_bytes() == (b / "harness" / rank.name).read_bytes(), rank.name
    markers = [json.loads((s / "COMPLETE").read_text()) for s in (a, b)]
    for m in markers:
        m.pop("time"), m.pop("files")
    assert markers[0] == markers[1]


@pytest.mark.full
@pytest.mark.deepspeed
@pytest.mark.megatron
def test_zero3_to_megatron_from_files_is_the_launched_conversion(ds_checkpoint, tmp_path):
    """ZeRO-3 x2 -> megatron tp=2 from files to files (the default; no framework launched) writes
    the checkpoint the launched conversion writes (same tensors bit for bit, same harness files and
    marker), and both resumed on megatron tp=2 give the same losses, bit for bit."""
    pytest.importorskip("megatron.core")
    out = {via: tmp_path / via for via in ("auto", "launch")}
    for via, to in out.items():
        args = [str(ds_checkpoint[1]), "--to", "megatron", "backend.tp=2", "--via", via, "--out", str(to)]
        printed = _convert([*args, *TINY[:-2]])
        assert "(match)" in printed, printed
    record = json.loads((out["auto"] / "convert.json").read_text())
    assert record["via"] == "files" and not (out["auto"] / "convert").exists(), record  # nothing launched
    assert json.loads((out["launch"] / "convert.json").read_text())["via"] == "launch"
    assert record["checksum_before"] == record["checksum_after"]
    step = f"step_{SAVED:06d}"
    _same_megatron_checkpoint(out["auto"] / step, out["launch"] / step)
    losses = {}
    for via, to in out.items():
        _run(["backend=megatron", "backend.tp=2", f"run.steps={SAVED + 4}", f"run.resume={to}"], tmp_path / f"r_{via}")
        losses[via] = _losses(tmp_path / f"r_{via}", "megatron")
    print(f"resumed from files / from the launched conversion: {losses}")
    assert losses["auto"] == losses["launch"] and len(losses["auto"]) == SAVED + 4


@pytest.mark.full
@pytest.mark.megatron
def test_megatron_bf16_carries_the_fp32_main_params(tmp_path):
    """Under bf16 Megatron steps fp32 main copies of the bf16 weights: the conversion carries those,
    not the bf16 values rounded from them, so megatron bf16 -> canonical -> megatron bf16 resumes bit
    for bit (carrying the bf16 weights, step 4's loss differed in the 5th digit)."""
    pytest.importorskip("megatron.core")
    import torch
    from safetensors.torch import load_file

    one = ["backend=megatron", "run.precision=bf16", "launcher.nproc_per_node=1", "run.steps=4"]
    _run([*one, "run.checkpoint.every=2"], tmp_path / "a")
    (saved,) = (tmp_path / "a").glob("runs/*/*/megatron/checkpoints/step_000002")
    out = tmp_path / "conv"
    printed = _convert([str(saved), "--to", "megatron", "--out", str(out)])
    assert "(match)" in printed and "bf16" in printed, printed
    weights = load_file(str(out / "canonical" / "model.safetensors"))
    assert any(not torch.equal(w, w.bfloat16().float()) for w in weights.values())  # fp32 bits, not bf16's
    _run([*one, f"run.resume={out}"], tmp_path / "b")
    assert _losses(tmp_path / "b", "megatron") == _losses(tmp_path / "a", "megatron")


@pytest.mark.full
@pytest.mark.deepspeed
@pytest.mark.mindspore
def test_to_mindspore_and_back_to_ddp(to_fsdp, ddp_losses, tmp_path):
    """The canonical state of the ZeRO-3 checkpoint -> mindspore (msrun, 2 ranks) resumed, and that
    mindspore checkpoint -> ddp resumed: both within 1e-5 of the uninterrupted ddp run."""
    pytest.importorskip("mindspore")
    to_ms, back = tmp_path / "mindspore", tmp_path / "ddp"
    printed = _convert([str(to_fsdp[0] / "canonical"), "--to", "mindspore", "--out", str(to_ms)])
    assert "(match)" in printed and "mindspore (mindspore-ckpt; world_size=2" in printed, printed
    _run(["backend=mindspore", f"run.steps={STEPS}", f"run.resume={to_ms}"], tmp_path / "r_ms")
    rel_ms = _relative(_losses(tmp_path / "r_ms", "mindspore"), ddp_losses)
    printed = _convert([str(to_ms), "--to", "ddp", "--out", str(back)])
    assert "(match)" in printed and "native mindspore" in printed, printed
    _run(["backend=ddp", f"run.steps={STEPS}", f"run.resume={back}"], tmp_path / "r_ddp")
    rel_ddp = _relative(_losses(tmp_path / "r_ddp", "ddp"), ddp_losses)
    print(f"vs ddp, steps 11-20: mindspore resumed {rel_ms:.3g}, ddp resumed from mindspore {rel_ddp:.3g}")
    assert rel_ms < 1e-5 and rel_ddp < 1e-5, (rel_ms, rel_ddp)


@pytest.mark.full
def test_conversion_is_recorded_as_an_mlflow_run(tmp_path, capsys):
    """With $MLFLOW_TRACKING_URI (or --tracking-uri) the conversion is also an MLflow run: formats,
    layouts and step as params, tensors/bytes/seconds as metrics, both checksums as tags, convert.json
    as its artifact. A store MLflow has no scheme for is refused before anything is written."""
    from mlflow.tracking import MlflowClient

    hf, out, uri = _tiny_hf(tmp_path / "hf"), tmp_path / "canon", f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = bench(
        ["convert", str(hf), "--to", "canonical", "--out", str(out)], tmp_path, env={"MLFLOW_TRACKING_URI": uri}
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((out / "convert.json").read_text())
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("convert").experiment_id])
    assert f"mlflow: run {run.info.run_id} in experiment convert" in proc.stdout, proc.stdout
    assert run.info.status == "FINISHED"
    assert run.data.params["source.format"] == "hf" and run.data.params["target.format"] == "canonical"
    assert run.data.params["source.step"] == "0" and "fresh AdamW" in run.data.params["optimizer"]
    assert run.data.metrics["tensors"] == record["tensors"] and run.data.metrics["bytes"] == record["bytes"]
    for key in ("read_bytes_per_s", "written_bytes_per_s", "peak_host_memory_bytes", "source_file_bytes"):
        assert run.data.metrics[key] == record[key] > 0, (key, run.data.metrics, record)
    tags = run.data.tags
    assert tags["parabench.checksum_before"] == tags["parabench.checksum_after"] == record["checksum_before"]
    assert "convert.json" in [a.path for a in client.list_artifacts(run.info.run_id)]
    assert list(tmp_path.glob("mlartifacts/convert/*/artifacts/convert.json"))  # beside the store, not in --out
    # a server that does not answer: spooled in --out, and `bench sync` uploads it
    spooled = tmp_path / "spooled"
    proc = bench(
        ["convert", str(hf), "--to", "canonical", "--out", str(spooled), "--tracking-uri", "http://127.0.0.1:1"],
        tmp_path,
    )
    assert proc.returncode == 0 and f"bench sync {spooled}" in proc.stderr, proc.stderr[-3000:]
    sync = bench(["sync", str(spooled), "--tracking-uri", uri], tmp_path)
    assert sync.returncode == 0, sync.stderr[-3000:]
    runs = client.search_runs([client.get_experiment_by_name("convert").experiment_id])
    assert len(runs) == 2 and {r.info.status for r in runs} == {"FINISHED"}
    bad = tmp_path / "never"
    _refused(
        [str(hf), "--to", "canonical", "--out", str(bad), "--tracking-uri", "ftp://x"], "--tracking-uri", bad, capsys
    )


def test_checksum_after_is_read_back_from_what_was_written(tmp_path):
    """The after-checksum of --to canonical / --to hf comes from the files the conversion wrote, read
    back, not from the source's manifest: an export whose tensor differs does not match."""
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file

    from parabench import canonical
    from parabench.convert.command import _hf_checksums, write_hf
    from parabench.hf import SINGLE
    from parabench.hydraconfig import compose, to_plain
    from parabench.jobs import from_config
    from parabench.model import initial_weights

    spec = from_config(to_plain(compose(["+model=llama", *(a for a in TINY if a.startswith("model."))]))).model
    weights = initial_weights(spec, seed=0)
    moments = {k: {n: np.zeros_like(w) for n, w in weights.items()} for k in canonical.MOMENTS}
    canon, out = tmp_path / "canonical", tmp_path / "hf"
    canonical.write(canon, canonical.CanonicalState(weights, moments, 3), [], {})
    out.mkdir()
    write_hf(out, canon, spec)
    same = _hf_checksums(out, canon, 3)
    assert same["checksum_before"] == same["checksum_after"]
    tensors = load_file(str(out / SINGLE))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + torch.finfo(torch.float32).eps
    save_file(tensors, str(out / SINGLE))
    changed = _hf_checksums(out, canon, 3)
    assert changed["checksum_before"] == same["checksum_before"] != changed["checksum_after"]
