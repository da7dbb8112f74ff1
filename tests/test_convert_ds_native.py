"""bench convert from a checkpoint DeepSpeed's own tools wrote (issue 19): a transformers LlamaForCausalLM
trained 3 steps through ``deepspeed.initialize`` (ZeRO-3, 2 CPU ranks, gloo) and saved with
``engine.save_checkpoint`` (tests/ds_native_train.py), read through DeepSpeed's ``ds_to_universal``.
The canonical state must be bit for bit what DeepSpeed's own API returns for the full fp32 weights and
AdamW moments, the step carried, and ddp must resume from the converted checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_convert import _convert, _losses, _refused, _run, continued_by_hand  # the tiny model's helpers

from conftest import torchrun_script

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

pytestmark = [pytest.mark.full, pytest.mark.deepspeed]

SAVED = 3


@pytest.fixture(scope="module")
def ds_native(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ds_native")
    torchrun_script("ds_native_train.py", [str(out), "3", str(SAVED)], {"DS_ACCELERATOR": "cpu"})
    return out


def test_deepspeed_own_zero3_checkpoint_to_ddp(ds_native, tmp_path):
    import torch
    from safetensors.torch import load_file

    out = tmp_path / "ddp"
    printed = _convert([str(ds_native / "ckpt"), "--to", "ddp", "--out", str(out), "launcher.nproc_per_node=2"])
    assert "(match)" in printed and "engine.save_checkpoint global_step3; ZeRO-3; world_size=2" in printed, printed
    assert "optimizer state: included (AdamW exp_avg, exp_avg_sq, step 3)" in printed, printed
    reference = load_file(str(ds_native / "reference.safetensors"))
    ours = {
        **load_file(str(out / "canonical" / "model.safetensors")),
        **load_file(str(out / "canonical" / "optimizer.safetensors")),
    }
    assert ours.keys() == reference.keys()
    differ = [n for n in reference if not torch.equal(ours[n], reference[n])]
    assert not differ, differ  # bit for bit DeepSpeed's safe_get_full_fp32_param / _optimizer_state
    assert json.loads((out / "canonical" / "manifest.json").read_text())["step"] == SAVED

    results = tmp_path / "r_ddp"  # the tiny model of tests/test_convert.py is the script's
    _run(["backend=ddp", f"run.steps={SAVED + 2}", f"run.resume={out}"], results)
    resumed = _losses(results, "ddp")
    by_hand = continued_by_hand(out / "canonical", 2)  # steps 4 and 5 from the same state, without a backend
    print(f"ddp resumed from DeepSpeed's checkpoint vs by hand: {resumed} vs {by_hand}")
    assert len(resumed) == 2
    assert abs(resumed[0] - by_hand[0]) <= 1e-6 * by_hand[0]  # the converted weights: the same forward
    assert abs(resumed[1] - by_hand[1]) <= 1e-5 * by_hand[1]  # + one AdamW step with the carried moments


@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeed_own_zero1_and_zero2_checkpoints_are_read_bit_for_bit(stage, tmp_path):
    """ZeRO 1/2 keep one model-states file and flat fp32 partitions per rank: the canonical state is
    still bit for bit DeepSpeed's own full fp32 weights and AdamW moments."""
    import torch
    from safetensors.torch import load_file

    trained, out = tmp_path / "trained", tmp_path / "canon"
    torchrun_script("ds_native_train.py", [str(trained), str(stage), str(SAVED)], {"DS_ACCELERATOR": "cpu"})
    printed = _convert([str(trained / "ckpt"), "--to", "canonical", "--out", str(out)])
    assert "(match)" in printed and "ZeRO-1/2; world_size=2" in printed, printed
    reference = load_file(str(trained / "reference.safetensors"))
    canon = out / "canonical"
    ours = {**load_file(str(canon / "model.safetensors")), **load_file(str(canon / "optimizer.safetensors"))}
    assert ours.keys() == reference.keys()
    assert not [n for n in reference if not torch.equal(ours[n], reference[n])]


def test_deepspeed_own_checkpoint_bad_input(ds_native, tmp_path, capsys):
    src, out = tmp_path / "ckpt", tmp_path / "out"
    shutil.copytree(ds_native / "ckpt", src)
    (src / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    _refused([str(src), "--to", "ddp", "--out", str(out)], "rank 1 are missing", out, capsys)
    shutil.copytree(ds_native / "ckpt", src, dirs_exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    _refused([str(src), "--to", "ddp", "--out", str(out)], "config.json gives [96, 64]", out, capsys)
    (src / "config.json").unlink()
    _refused([str(src), "--to", "ddp", "--out", str(out)], "no config.json", out, capsys)
