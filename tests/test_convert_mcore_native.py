"""bench convert from a checkpoint in Megatron-LM's own layout (issue 19): a megatron-core GPTModel trained
3 steps at tp=2 (and at pp=2) with Megatron's optimizer and saved as Megatron-LM's save_checkpoint
saves with --ckpt-format torch_dist (tests/mcore_native_train.py). Every canonical weight and AdamW
moment must be bit for bit the training ranks' own parameters and optimizer state (put together with
the layout's mapping), the canonical model must give the trained model's logits, the step is
carried, and ddp must resume from the converted checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_convert import _canonical_model, _convert, _losses, _refused, _run, continued_by_hand  # tiny model

from conftest import torchrun_script

pytest.importorskip("megatron.core")

pytestmark = [pytest.mark.full, pytest.mark.megatron]

SAVED = 3
ITER = f"iter_{SAVED:07d}"


def _trained(tmp_path_factory, tp: int, pp: int) -> Path:
    out = tmp_path_factory.mktemp(f"mc_native_tp{tp}pp{pp}")
    torchrun_script("mcore_native_train.py", [str(out), str(SAVED), str(tp), str(pp)], {})
    return out


@pytest.fixture(scope="module")
def mc_native(tmp_path_factory) -> Path:
    return _trained(tmp_path_factory, 2, 1)


def _assert_bit_equal_to_the_ranks(canonical_dir: Path, reference: dict, tp: int, pp: int) -> None:
    """The canonical weights and moments against every training rank's own parameters and AdamW
    state (module names, layer indices within the stage) put together by the layout's mapping."""
    import torch
    from safetensors.torch import load_file

    from parabench.adapters.megatron_mapping import Layout, unshard_all

    spec = _canonical_model(canonical_dir)[1]
    ours = {
        **load_file(str(canonical_dir / "model.safetensors")),
        **load_file(str(canonical_dir / "optimizer.safetensors")),
    }
    for index, prefix in ((2, ""), (3, "exp_avg/"), (4, "exp_avg_sq/")):
        shards = {(s[0], 0, s[1]): {n: t.numpy() for n, t in s[index].items()} for s in reference["shards"]}
        full = unshard_all(shards, spec, Layout(tp=tp, pp=pp))
        assert len(full) == len(spec.parameter_shapes())
        differ = [n for n, v in full.items() if not torch.equal(torch.from_numpy(v), ours[prefix + n])]
        assert not differ, (prefix, differ)


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
    _assert_bit_equal_to_the_ranks(canon / "canonical", reference, 2, 1)
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
    by_hand = continued_by_hand(out / "canonical", 2)  # steps 4 and 5 from the same state, without a backend
    print(f"ddp resumed from Megatron-LM's checkpoint vs by hand: {resumed} vs {by_hand}")
    assert len(resumed) == 2
    assert abs(resumed[0] - by_hand[0]) <= 1e-6 * by_hand[0]  # the converted weights: the same forward
    assert abs(resumed[1] - by_hand[1]) <= 1e-5 * by_hand[1]  # + one AdamW step with the carried moments


def test_megatron_lm_checkpoint_saved_with_pipeline_stages(tmp_path_factory, tmp_path):
    """Saved at pp=2, the stages' layers come back in order (the layers are stacked on a global axis)."""
    import torch

    trained = _trained(tmp_path_factory, 1, 2)
    canon = tmp_path / "canon"
    printed = _convert([str(trained / "ckpt"), "--to", "canonical", "--out", str(canon)])
    assert "(match)" in printed and "saved at tp=1 pp=2" in printed, printed
    _assert_bit_equal_to_the_ranks(canon / "canonical", torch.load(trained / "reference.pt", weights_only=True), 1, 2)


def test_megatron_lm_bf16_checkpoint_gives_the_fp32_main_params(tmp_path_factory, tmp_path):
    """Saved with --bf16: the weights are the optimizer's fp32 main params (optimizer.state.fp32_param.*),
    not the bf16 model weights rounded from them; moments and step as in fp32."""
    import torch
    from safetensors.torch import load_file

    trained = tmp_path_factory.mktemp("mc_native_bf16")
    torchrun_script("mcore_native_train.py", [str(trained), str(SAVED), "2", "1", "bf16"], {})
    canon = tmp_path / "canon"
    printed = _convert([str(trained / "ckpt"), "--to", "canonical", "--out", str(canon)])
    assert "(match)" in printed and "saved at tp=2 pp=1; bf16" in printed, printed
    _assert_bit_equal_to_the_ranks(canon / "canonical", torch.load(trained / "reference.pt", weights_only=True), 2, 1)
    weights = load_file(str(canon / "canonical" / "model.safetensors"))
    assert any(not torch.equal(w, w.bfloat16().float()) for w in weights.values())


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


def _copier(saved: Path, src: Path):
    """A function giving a fresh copy of ``saved`` at ``src`` each call (one bad input per copy)."""

    def fresh() -> Path:
        shutil.rmtree(src, ignore_errors=True)
        shutil.copytree(saved, src)
        return src

    return fresh


def test_megatron_lm_checkpoint_bad_input(mc_native, tmp_path, capsys):
    src, out = tmp_path / "ckpt", tmp_path / "out"
    fresh = _copier(mc_native / "ckpt", src)

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
    _edit_args(fresh(), fp16=True)
    _refused([str(src), "--to", "ddp", "--out", str(out)], "args.fp16=True", out, capsys)
    _edit_args(fresh(), checkpoint_version=2.0)
    _refused([str(src), "--to", "ddp", "--out", str(out)], "checkpoint_version 2.0", out, capsys)
    legacy = tmp_path / "legacy"
    (legacy / ITER / "mp_rank_00").mkdir(parents=True)
    (legacy / ITER / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"")
    (legacy / "latest_checkpointed_iteration.txt").write_text(str(SAVED))
    _refused([str(legacy), "--to", "ddp", "--out", str(out)], "not a torch.save zip archive", out, capsys)


@pytest.fixture(scope="module")
def mc_legacy(tmp_path_factory) -> Path:
    """Megatron-LM's legacy --ckpt-format torch at tp=2 (mp_rank_00/, mp_rank_01/)."""
    out = tmp_path_factory.mktemp("mc_legacy_tp2")
    torchrun_script("mcore_native_train.py", [str(out), str(SAVED), "2", "1", "legacy"], {})
    return out


def test_megatron_lm_legacy_checkpoint_to_canonical_and_ddp(mc_legacy, tmp_path):
    """Issue 30: the legacy format (MindSpeed-LLM's training and converter write it) at tp=2 - every
    canonical weight and moment bit-equal to the ranks' own, the trained model's logits, and ddp resumed
    from it continues as the same state continued by hand (1e-6)."""
    import torch

    assert sorted(p.name for p in (mc_legacy / "ckpt" / ITER).iterdir()) == ["mp_rank_00", "mp_rank_01"]
    canon = tmp_path / "canon"
    printed = _convert([str(mc_legacy / "ckpt"), "--to", "canonical", "--out", str(canon)])
    assert "(match)" in printed and f"Megatron-LM {ITER}; torch; saved at tp=2 pp=1; fp32" in printed, printed
    assert f"optimizer state: included (AdamW exp_avg, exp_avg_sq, step {SAVED})" in printed, printed
    reference = torch.load(mc_legacy / "reference.pt", weights_only=True)
    _assert_bit_equal_to_the_ranks(canon / "canonical", reference, 2, 1)
    model, _ = _canonical_model(canon / "canonical")
    with torch.no_grad():
        diff = (model.eval()(reference["tokens"]) - reference["logits"]).abs().max().item()
    assert diff < 1e-5, diff

    out = tmp_path / "ddp"
    printed = _convert([str(mc_legacy / "ckpt"), "--to", "ddp", "--out", str(out), "launcher.nproc_per_node=2"])
    assert "(match)" in printed, printed
    results = tmp_path / "r_ddp"
    _run(["backend=ddp", f"run.steps={SAVED + 2}", f"run.resume={out}"], results)
    resumed, by_hand = _losses(results, "ddp"), continued_by_hand(out / "canonical", 2)
    print(f"ddp resumed from the legacy checkpoint vs by hand: {resumed} vs {by_hand}")
    assert len(resumed) == 2
    assert abs(resumed[0] - by_hand[0]) <= 1e-6 * by_hand[0] and abs(resumed[1] - by_hand[1]) <= 1e-6 * by_hand[1]


def test_megatron_lm_legacy_checkpoint_saved_with_pipeline_stages(tmp_path_factory, tmp_path):
    """The legacy format at pp=2 (mp_rank_00_000/, mp_rank_00_001/: layers numbered within each stage)."""
    import torch

    trained = tmp_path_factory.mktemp("mc_legacy_pp2")
    torchrun_script("mcore_native_train.py", [str(trained), str(SAVED), "1", "2", "legacy"], {})
    assert sorted(p.name for p in (trained / "ckpt" / ITER).iterdir()) == ["mp_rank_00_000", "mp_rank_00_001"]
    canon = tmp_path / "canon"
    printed = _convert([str(trained / "ckpt" / ITER), "--to", "canonical", "--out", str(canon)])
    assert "(match)" in printed and "torch; saved at tp=1 pp=2" in printed, printed
    _assert_bit_equal_to_the_ranks(canon / "canonical", torch.load(trained / "reference.pt", weights_only=True), 1, 2)
    out, results = tmp_path / "ddp", tmp_path / "r_ddp"
    assert "(match)" in _convert([str(canon / "canonical"), "--to", "ddp", "--out", str(out)])
    _run(["backend=ddp", f"run.steps={SAVED + 2}", f"run.resume={out}"], results)
    resumed, by_hand = _losses(results, "ddp"), continued_by_hand(out / "canonical", 2)
    assert len(resumed) == 2 and all(abs(a - b) <= 1e-6 * b for a, b in zip(resumed, by_hand, strict=True)), (
        resumed,
        by_hand,
    )


def _edit_rank(src: Path, rank: str, edit) -> None:
    import torch

    path = src / ITER / rank / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    edit(state)
    torch.save(state, path)


def test_megatron_lm_legacy_checkpoint_bad_input(mc_legacy, tmp_path, capsys):
    src, out = tmp_path / "ckpt", tmp_path / "out"
    fresh = _copier(mc_legacy / "ckpt", src)

    shutil.rmtree(fresh() / ITER / "mp_rank_01")
    _refused([str(src), "--to", "ddp", "--out", str(out)], "mp_rank_01/model_optim_rng.pt is missing", out, capsys)
    _edit_rank(fresh(), "mp_rank_01", lambda s: s["optimizer"]["param_groups"][1]["params"].pop())
    _refused([str(src), "--to", "ddp", "--out", str(out)], "param group 1 holds 4 ids", out, capsys)
    _edit_rank(fresh(), "mp_rank_00", lambda s: s["model"].pop("decoder.layers.1.mlp.linear_fc2.weight"))
    _refused([str(src), "--to", "ddp", "--out", str(out)], "param group 0 holds 10 ids", out, capsys)
    _edit_rank(
        fresh(), "mp_rank_01", lambda s: s["optimizer"]["state"][3].update(step=s["optimizer"]["state"][3]["step"] + 1)
    )
    _refused([str(src), "--to", "ddp", "--out", str(out)], "not one value", out, capsys)
    _edit_rank(fresh(), "mp_rank_00", lambda s: setattr(s["args"], "use_distributed_optimizer", True))
    _refused([str(src), "--to", "ddp", "--out", str(out)], "distrib_optim.pt", out, capsys)
    _edit_rank(fresh(), "mp_rank_00", lambda s: s.update(extra=shutil.rmtree))  # a global that would run
    _refused([str(src), "--to", "ddp", "--out", str(out)], "shutil.rmtree", out, capsys)
