"""bench convert from a checkpoint in Megatron-LM's own layout (issue 19): a megatron-core GPTModel trained
3 steps at tp=2 with Megatron's optimizer and saved as Megatron-LM's save_checkpoint saves with
--ckpt-format torch_dist (tests/mcore_native_train.py). The canonical model must give the trained
model's logits, the AdamW moments must be bit for bit Megatron's, the step carried, and ddp must
resume from the converted checkpoint."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from tests.conftest import torchrun_script
from tests.test_convert import _canonical_model, _convert, _losses, _refused, _run  # the tiny model's helpers

pytest.importorskip("megatron.core")

pytestmark = [pytest.mark.slow, pytest.mark.megatron]

SAVED = 3
ITER = f"iter_{SAVED:07d}"


@pytest.fixture(scope="module")
def mc_native(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mc_native")
    torchrun_script("mcore_native_train.py", [str(out), str(SAVED)], {})
    return out


def test_megatron_lm_checkpoint_to_canonical_and_ddp(mc_native, tmp_path):
    import torch
    from safetensors.torch import load_file

    canon = tmp_path / "canon"
    printed = _convert([str(mc_native / "ckpt"), "--to", "canonical", "--out", str(canon)])
    assert "(match)" in printed and f"Megatron-LM {ITER}; torch_dist; saved at tp=2 pp=1" in printed, printed
    assert f"optimizer state: included (AdamW exp_avg, exp_avg_sq, step {SAVED})" in printed, printed
    reference = torch.load(mc_native / "reference.pt", weights_only=True)
    model, _ = _canonical_model(canon / "canonical")
    with torch.no_grad():
        logits = model.eval()(reference["tokens"])
    diff = (logits - reference["logits"]).abs().max().item()
    print(f"canonical vs Megatron GPTModel (tp=2) logits: max abs diff {diff:.3g}")
    assert logits.shape == reference["logits"].shape and diff < 1e-5, diff
    moments = load_file(str(canon / "canonical" / "optimizer.safetensors"))
    differ = [k for k in reference if "/" in k and not torch.equal(moments[k], reference[k])]
    assert not differ, differ  # bit for bit the moments in Megatron's optimizer
    assert json.loads((canon / "canonical" / "manifest.json").read_text())["step"] == SAVED

    out = tmp_path / "ddp"  # an iteration directory is a source too
    printed = _convert([str(mc_native / "ckpt" / ITER), "--to", "ddp", "--out", str(out), "launcher.nproc_per_node=2"])
    assert "(match)" in printed, printed
    results = tmp_path / "r_ddp"  # the tiny model of tests/test_convert.py has the script's shape
    _run(["backend=ddp", f"run.steps={SAVED + 2}", f"run.resume={out}"], results)
    resumed = _losses(results, "ddp")
    assert len(resumed) == 2 and all(math.isfinite(x) for x in resumed), resumed  # steps 4 and 5


def _edit_args(src: Path, **changes) -> None:
    import torch

    common = src / ITER / "common.pt"
    state = torch.load(common, weights_only=False)
    for key, value in changes.items():
        if key == "checkpoint_version":
            state[key] = value
        else:
            setattr(state["args"], key, value)
    torch.save(state, common)


def test_megatron_lm_checkpoint_bad_input(mc_native, tmp_path, capsys):
    src, out = tmp_path / "ckpt", tmp_path / "out"

    def fresh() -> Path:
        shutil.rmtree(src, ignore_errors=True)
        shutil.copytree(mc_native / "ckpt", src)
        return src

    (fresh() / ITER / "__1_0.distcp").unlink()
    _refused([str(src), "--to", "ddp", "--out", str(out)], "__1_0.distcp is missing", out, capsys)
    (fresh() / "latest_checkpointed_iteration.txt").write_text("7")
    _refused([str(src), "--to", "ddp", "--out", str(out)], "names '7'", out, capsys)
    _edit_args(fresh(), add_qkv_bias=True)
    _refused([str(src), "--to", "ddp", "--out", str(out)], "args.add_qkv_bias=True", out, capsys)
    _edit_args(fresh(), use_distributed_optimizer=True)
    _refused([str(src), "--to", "ddp", "--out", str(out)], "args.use_distributed_optimizer", out, capsys)
    _edit_args(fresh(), ffn_hidden_size=96)
    _refused([str(src), "--to", "ddp", "--out", str(out)], "its args give [2, 192, 64]", out, capsys)
    _edit_args(fresh(), checkpoint_version=2.0)
    _refused([str(src), "--to", "ddp", "--out", str(out)], "checkpoint_version 2.0", out, capsys)
    legacy = tmp_path / "legacy"
    (legacy / ITER / "mp_rank_00").mkdir(parents=True)
    (legacy / ITER / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"")
    (legacy / "latest_checkpointed_iteration.txt").write_text(str(SAVED))
    _refused([str(legacy), "--to", "ddp", "--out", str(out)], "legacy format", out, capsys)
