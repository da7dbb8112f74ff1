"""bench convert with megatron's distributed optimizer (issue 30, docs/convert.md): each data-parallel
rank holds slices of the fp32 main params and AdamW moments (adapters/megatron_distopt.py).

As a source: a parabench ``backend=megatron backend.distributed_optimizer=true`` checkpoint (dp=2)
exported to the canonical form holds every weight and moment bit-equal to what megatron-core's own
``fully_reshardable`` save put together in the checkpoint files (read with torch's DCP reader), and
the step; converted to ddp it resumes like the uninterrupted ddp run. As a target: a ddp checkpoint
converted to the distributed optimizer resumes like the uninterrupted ddp run, and the distributed
optimizer's own checkpoint carried through the canonical form into a new one resumes bit for bit
as its uninterrupted run continued. From Megatron-LM's own layout (tests/mcore_native_train.py with
``distopt``: megatron-core's GPTModel and DistributedOptimizer saved with
``--dist-ckpt-optim-fully-reshardable``) at dp=2 and tp=2 x dp=2: the canonical state bit-equal to the
training ranks' weights and megatron-core's own gathered optimizer state; ``dp_reshardable`` refused.

The tiny model of tests/test_convert.py (2 layers, hidden 64, vocab 512) keeps every launch short."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import FAST, TINY, bench, torchrun_script

pytest.importorskip("megatron.core")

pytestmark = pytest.mark.megatron

DISTOPT = ["backend=megatron", "backend.distributed_optimizer=true"]
STEPS = 20
SAVED = 10
BOUND = 1e-6  # issue 30's acceptance: losses within 1e-6 relative of the uninterrupted run


def _losses(results: Path, backend: str) -> list[float]:
    (path,) = results.glob(f"runs/*/*/{backend}/ranks/rank0.json")
    return json.loads(path.read_text())["losses"]


def _run(args: list[str], results: Path, ranks: int = 2) -> None:
    tiny = [a for a in TINY if not a.startswith("launcher.nproc_per_node=")]
    proc = bench(["run", *FAST, *tiny, f"launcher.nproc_per_node={ranks}", *args], results)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _convert(args: list[str]) -> str:
    proc = bench(["convert", *args], Path("."))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _saved(results: Path, backend: str) -> Path:
    (ckpt,) = results.glob(f"runs/*/*/{backend}/checkpoints/step_{SAVED:06d}")
    return ckpt


def _relative(resumed: list[float], reference: list[float]) -> float:
    assert len(resumed) == len(reference) == STEPS
    return max(abs(a - b) / abs(b) for a, b in zip(resumed[SAVED:], reference[SAVED:], strict=True))


@pytest.fixture(scope="module")
def distopt_run(tmp_path_factory) -> Path:
    """The distributed optimizer on 2 data-parallel ranks, 20 steps, checkpointed at steps 10 and 20."""
    results = tmp_path_factory.mktemp("distopt")
    _run([*DISTOPT, f"run.steps={STEPS}", f"run.checkpoint.every={SAVED}"], results)
    return results


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> Path:
    """The uninterrupted reference: ddp on 2 ranks for 20 steps, checkpointed at steps 10 and 20."""
    results = tmp_path_factory.mktemp("ddp")
    _run(["backend=ddp", f"run.steps={STEPS}", f"run.checkpoint.every={SAVED}"], results)
    return results


def _files_canonical(native: Path, tmp: Path):
    """The canonical state of a fully_reshardable checkpoint as megatron-core itself put it together
    at save: its optimizer.state.{param,exp_avg,exp_avg_sq}.<key> tensors at the parameters' global
    shapes, read with torch's DCP reader and unstacked/mapped as a Megatron-LM checkpoint is."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from parabench.convert.megatron_checkpoint import STATE, _canonical
    from parabench.jobs import model_spec
    from parabench.resilience.checkpoint import read_marker

    dcp_to_torch_save(str(native), str(tmp / "flat.pt"))
    saved = torch.load(tmp / "flat.pt", weights_only=False)
    spec = model_spec({"name": "tiny", **read_marker(native.parent)["job"]["model"]})
    state = {k: v for k, v in saved.items() if isinstance(v, torch.Tensor)}
    te_names = "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in state  # the norms' keys
    return {key: _canonical(state, f"{STATE}{key}.", spec, te_names) for key in ("param", "exp_avg", "exp_avg_sq")}


def _assert_equal_to_the_files(canonical_dir: Path, native: Path, tmp: Path) -> None:
    """Every canonical weight and moment bit-equal to megatron-core's own gathered copy in the files."""
    from safetensors.torch import load_file

    weights = load_file(str(canonical_dir / "model.safetensors"))
    moments = load_file(str(canonical_dir / "optimizer.safetensors"))
    files = _files_canonical(native, tmp)
    assert sorted(files["param"]) == sorted(weights)
    for name, value in files["param"].items():
        assert weights[name].numpy().tobytes() == value.tobytes(), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert moments[f"{key}/{name}"].numpy().tobytes() == files[key][name].tobytes(), (key, name)


@pytest.mark.full
def test_distopt_source_to_ddp_carries_megatrons_own_state_and_resumes(distopt_run, ddp_run, tmp_path):
    """distopt dp=2 -> ddp x2: the canonical weights and moments are bit-equal to megatron-core's own
    gathered copy in the source checkpoint, the step is 10, and the ddp run resumed from the
    converted checkpoint gives steps 11-20 within 1e-6 relative of the uninterrupted ddp run."""
    source = _saved(distopt_run, "megatron")
    out = tmp_path / "ddp"
    printed = _convert([str(source), "--to", "ddp", "--out", str(out)])
    assert "(match)" in printed and "optimizer state: included" in printed, printed
    assert "distributed_optimizer=True" in printed, printed

    canon = out / "canonical"
    assert json.loads((canon / "manifest.json").read_text())["step"] == SAVED
    _assert_equal_to_the_files(canon, source / "native", tmp_path)

    _run(["backend=ddp", f"run.steps={STEPS}", f"run.resume={out}"], tmp_path / "resumed")
    resumed = _losses(tmp_path / "resumed", "ddp")
    assert resumed[:SAVED] == _losses(distopt_run, "megatron")[:SAVED]  # the history travels
    rel = _relative(resumed, _losses(ddp_run, "ddp"))
    print(f"ddp resumed from the converted distopt checkpoint vs ddp, steps 11-20: max relative {rel:.3g}")
    assert rel < BOUND


@pytest.mark.full
def test_ddp_to_distopt_resumes_like_ddp(ddp_run, tmp_path):
    """ddp x2 -> megatron distributed optimizer dp=2: each rank takes its slices of the main params
    and moments; the megatron run resumed from it gives steps 11-20 within 1e-6 of uninterrupted ddp."""
    out = tmp_path / "distopt"
    to = ["--to", "megatron", "backend.distributed_optimizer=true"]
    printed = _convert([str(_saved(ddp_run, "ddp")), *to, "--out", str(out)])
    assert "(match)" in printed and "distributed_optimizer=True" in printed, printed
    _run([*DISTOPT, f"run.steps={STEPS}", f"run.resume={out}"], tmp_path / "resumed")
    rel = _relative(_losses(tmp_path / "resumed", "megatron"), _losses(ddp_run, "ddp"))
    print(f"megatron distopt resumed from the converted ddp checkpoint vs ddp, steps 11-20: max relative {rel:.3g}")
    assert rel < BOUND


@pytest.mark.full
def test_distopt_through_canonical_into_distopt_resumes_bitwise(distopt_run, tmp_path):
    """distopt -> canonical -> distopt with the same layout: the resumed run's 20 losses are bit for
    bit those of the uninterrupted distributed-optimizer run (a wrong slice offset, a moment left
    at zero or a shared step tensor would change step 11's loss)."""
    out = tmp_path / "distopt"
    printed = _convert([str(_saved(distopt_run, "megatron")), "--to", "megatron", "--out", str(out)])
    assert "(match)" in printed, printed
    _run([*DISTOPT, f"run.steps={STEPS}", f"run.resume={out}"], tmp_path / "resumed")
    assert _losses(tmp_path / "resumed", "megatron") == _losses(distopt_run, "megatron")


@pytest.mark.full
def test_distopt_tp2_dp2_source_carries_megatrons_own_state(tmp_path):
    """tp=2 x dp=2 (4 ranks): the slices put together over each tensor-parallel rank's data-parallel
    group, then the tensor-parallel shards mapped back; bit-equal to megatron-core's own gathered copy."""
    _run([*DISTOPT, "backend.tp=2", "run.steps=3", "run.checkpoint.every=2"], tmp_path / "run", ranks=4)
    (source,) = (tmp_path / "run").glob("runs/*/*/megatron/checkpoints/step_000002")
    out = tmp_path / "canon"
    printed = _convert([str(source), "--to", "canonical", "--out", str(out)])
    assert "(match)" in printed and "tp=2" in printed and "world_size=4" in printed, printed
    _assert_equal_to_the_files(out / "canonical", source / "native", tmp_path)


MCORE_SAVED = 3


@pytest.fixture(scope="module")
def mcore_distopt(tmp_path_factory):
    """Megatron-LM-layout checkpoints written by megatron-core's own code with the distributed
    optimizer (tests/mcore_native_train.py, --dist-ckpt-optim-fully-reshardable), one per tp, trained
    on first use: tp=1 x dp=2 (2 ranks) and tp=2 x dp=2 (4 ranks)."""
    made: dict[int, Path] = {}

    def trained(tp: int) -> Path:
        if tp not in made:
            made[tp] = tmp_path_factory.mktemp(f"mcore_distopt_tp{tp}")
            args = [str(made[tp]), str(MCORE_SAVED), str(tp), "1", "distopt"]
            torchrun_script("mcore_native_train.py", args, {}, nproc=2 * tp)
        return made[tp]

    return trained


@pytest.mark.full
@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_lm_distopt_checkpoint_to_canonical(tp, mcore_distopt, tmp_path):
    """Megatron-LM's torch_dist checkpoint with the distributed optimizer (fully_reshardable), at
    dp=2 and at tp=2 x dp=2: every canonical weight and AdamW moment bit-equal to the training ranks'
    own weights and megatron-core's own gathered optimizer state, step 3."""
    import torch
    from test_convert_mcore_native import _assert_bit_equal_to_the_ranks

    trained = mcore_distopt(tp)
    canon = tmp_path / "canon"
    printed = _convert([str(trained / "ckpt"), "--to", "canonical", "--out", str(canon)])
    assert "(match)" in printed and f"saved at tp={tp} pp=1" in printed, printed
    assert "distributed optimizer fully_reshardable" in printed, printed
    assert f"optimizer state: included (AdamW exp_avg, exp_avg_sq, step {MCORE_SAVED})" in printed, printed
    reference = torch.load(trained / "reference.pt", weights_only=True)
    _assert_bit_equal_to_the_ranks(canon / "canonical", reference, tp, 1)


@pytest.mark.full
def test_megatron_lm_distopt_checkpoint_to_ddp_continues(mcore_distopt, tmp_path):
    """The dp=2 checkpoint -> ddp x2, resumed 2 steps: the losses those steps give computed without a
    backend from the same canonical state (tests/test_convert.py's continued_by_hand)."""
    from test_convert import continued_by_hand

    out = tmp_path / "ddp"
    printed = _convert([str(mcore_distopt(1) / "ckpt"), "--to", "ddp", "--out", str(out), "launcher.nproc_per_node=2"])
    assert "(match)" in printed, printed
    _run(["backend=ddp", f"run.steps={MCORE_SAVED + 2}", f"run.resume={out}"], tmp_path / "r")
    resumed, by_hand = _losses(tmp_path / "r", "ddp"), continued_by_hand(out / "canonical", 2)
    print(f"ddp resumed from Megatron-LM's distopt checkpoint vs by hand: {resumed} vs {by_hand}")
    assert len(resumed) == 2
    assert abs(resumed[0] - by_hand[0]) <= 1e-6 * by_hand[0]
    assert abs(resumed[1] - by_hand[1]) <= 1e-5 * by_hand[1]  # as tests/test_convert_mcore_native.py bounds it


@pytest.mark.full
def test_megatron_lm_dp_reshardable_is_refused_with_the_flag_that_resaves_it(tmp_path, capsys):
    """Megatron-LM's default distributed-optimizer format keeps each data-parallel rank's flat bucket
    buffers: refused before anything is written, naming the format and the flag to re-save it with."""
    trained = tmp_path / "dp"
    torchrun_script("mcore_native_train.py", [str(trained), str(MCORE_SAVED), "1", "1", "distopt_dp"], {}, nproc=2)
    out = tmp_path / "out"
    from parabench.cli import main

    code = main(["convert", str(trained / "ckpt"), "--to", "ddp", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and not out.exists(), err
    assert "'dp_reshardable'" in err and "--dist-ckpt-optim-fully-reshardable" in err, err
