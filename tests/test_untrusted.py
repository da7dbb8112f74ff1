"""Checkpoints parabench did not write stay inert (issue 33 item 1; parabench.untrusted, docs/security.md).

Every crafted file holds a payload that, once unpickled, only writes a marker file in the test's
temporary directory. Each test asserts the payload never ran, the refusal is one line naming the
file's global (exit 2), and nothing was written to ``--out``. On the code before parabench.untrusted
the DeepSpeed and Megatron readers and torch.distributed.checkpoint unpickled these files with code
allowed: the markers appeared.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from test_convert import TINY, _refused

from conftest import FAST, bench


class Payload:
    """Unpickling it runs ``exec``: it writes ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def _deepspeed_dir(root: Path, states: object, optim: object) -> Path:
    """The files DeepSpeed's engine.save_checkpoint writes at one rank, with what the test puts in them."""
    import torch

    tag = root / "global_step3"
    tag.mkdir(parents=True)
    (root / "latest").write_text("global_step3")
    (root / "config.json").write_text("{}")
    torch.save(states, tag / "mp_rank_00_model_states.pt")
    torch.save(optim, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    return root


def test_a_deepspeed_checkpoint_with_a_payload_is_refused_unread(tmp_path, capsys):
    marker, out = tmp_path / "ran", tmp_path / "out"
    legit = {"param_shapes": [], "dp_world_size": 1, "mp_world_size": 1}
    src = _deepspeed_dir(tmp_path / "states", {**legit, "ds_config": Payload(marker)}, {"x": 1})
    _refused([str(src), "--to", "canonical", "--out", str(out)], "builtins.exec", out, capsys)
    # the optimizer states are read by DeepSpeed's ds_to_universal, which unpickles with code allowed
    src = _deepspeed_dir(tmp_path / "optim", legit, {"optimizer_state_dict": Payload(marker)})
    _refused(
        [str(src), "--to", "canonical", "--out", str(out)], "zero_pp_rank_0_mp_rank_00_optim_states.pt", out, capsys
    )
    assert not marker.exists()


def _megatron_dir(root: Path, common: object) -> Path:
    import torch

    iteration = root / "iter_0000003"
    iteration.mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("3")
    (iteration / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    torch.save(common, iteration / "common.pt")
    return iteration


def test_a_megatron_common_pt_with_a_payload_is_refused_unread(tmp_path, capsys):
    marker, out = tmp_path / "ran", tmp_path / "out"
    src = _megatron_dir(tmp_path / "ckpt", {"args": Payload(marker), "checkpoint_version": 3.0}).parent
    _refused([str(src), "--to", "ddp", "--out", str(out)], "builtins.exec", out, capsys)
    assert not marker.exists()


@pytest.mark.megatron
def test_a_dcp_metadata_file_with_a_payload_is_refused_unread(tmp_path, capsys):
    """Megatron-LM args that pass every check, and a ``.metadata`` that torch's FileSystemReader
    would ``pickle.load``."""
    pytest.importorskip("megatron.core")
    import megatron.core.distributed  # noqa: F401 (its import-time log lines land here, not in the refusal's stderr)
    from mcore_native_train import megatron_lm_args

    marker, out = tmp_path / "ran", tmp_path / "out"
    common = {"args": megatron_lm_args(3, 1, 1, False, None), "checkpoint_version": 3.0, "iteration": 3}
    iteration = _megatron_dir(tmp_path / "ckpt", common)
    (iteration / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    capsys.readouterr()
    _refused([str(iteration.parent), "--to", "ddp", "--out", str(out)], "builtins.exec", out, capsys)
    assert not marker.exists()


def test_a_non_tensor_dcp_item_with_a_payload_is_refused_unread(tmp_path):
    """torch.distributed.checkpoint saves non-tensor items as torch.save bytes in its .distcp files and
    its DefaultLoadPlanner loads them with weights_only=False: the check reads them unpickled."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from parabench import untrusted

    marker = tmp_path / "ran"
    dcp.save({"w": torch.ones(3), "extra": {"note": Payload(marker)}}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    with pytest.raises(untrusted.Untrusted, match="builtins.exec"):
        untrusted.check_dcp(tmp_path / "c")
    state = {"w": torch.zeros(3), "extra": {"note": None}}
    reader, planner = untrusted.dcp_reader(tmp_path / "c"), untrusted.dcp_planner(tmp_path / "c")
    with pytest.raises(CheckpointException) as refused:
        dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
    assert "builtins.exec" in str(refused.value.failures), refused.value.failures
    assert not marker.exists()
    legit = tmp_path / "legit"
    dcp.save({"w": torch.ones(3), "extra": {"step": 7}}, checkpoint_id=str(legit), no_dist=True)
    untrusted.check_dcp(legit)
    state = {"w": torch.zeros(3), "extra": {"step": 0}}
    dcp.load(state, storage_reader=untrusted.dcp_reader(legit), planner=untrusted.dcp_planner(legit), no_dist=True)
    assert state["extra"]["step"] == 7 and torch.equal(state["w"], torch.ones(3))


def test_a_global_beyond_the_allowlist_loads_only_when_trusted(tmp_path):
    """A harmless global the formats never hold is still refused, naming it; a user who trusts the
    source loads it (``--trust-checkpoint``, ``run.trust_checkpoint=true``)."""
    import fractions

    import torch

    from parabench import untrusted

    path = tmp_path / "common.pt"
    torch.save({"args": fractions.Fraction(1, 3)}, path)
    with pytest.raises(untrusted.Untrusted, match="fractions.Fraction.*--trust-checkpoint"):
        untrusted.load(path)
    assert untrusted.load(path, trusted=True)["args"] == fractions.Fraction(1, 3)
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(1)}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(untrusted.Untrusted, match="legacy format"):
        untrusted.load(legacy)


@pytest.mark.full
def test_resuming_a_checkpoint_with_a_payload_is_refused_before_launch(tmp_path):
    """run.resume= of a copied ddp checkpoint whose DCP metadata holds a payload: exit 2 before any
    worker starts (the workers' torch.distributed.checkpoint would have unpickled it)."""
    import shutil

    results, marker = tmp_path / "results", tmp_path / "ran"
    args = ["run", *FAST, *TINY, "backend=ddp", "launcher.nproc_per_node=1", "tracking.enabled=false"]
    proc = bench([*args, "run.steps=2", "run.checkpoint.every=1"], results)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (saved,) = results.glob("runs/*/*/ddp/checkpoints/step_000001")
    crafted = tmp_path / "crafted"
    shutil.copytree(saved, crafted)
    (crafted / "native" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    marker_file = json.loads((crafted / "COMPLETE").read_text())  # the sizes it records, made to agree
    marker_file["files"]["native/.metadata"] = (crafted / "native" / ".metadata").stat().st_size
    (crafted / "COMPLETE").write_text(json.dumps(marker_file))
    proc = bench([*args, "run.steps=3", f"run.resume={crafted}"], tmp_path / "again")
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "run.resume" in err[-1] and "builtins.exec" in err[-1], proc.stderr[-3000:]
    assert not marker.exists() and not (tmp_path / "again" / "runs").exists()
