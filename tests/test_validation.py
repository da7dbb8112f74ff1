"""Bad configurations are refused before launch: one line, exit 2, nothing written anywhere."""

import pytest

from conftest import assert_refused_before_launch

INVALID = {
    "no model": ([], "+model=NAME"),
    "model without plus": (["model=llama"], "+model=NAME"),
    "unknown model": (["+model=gpt5"], "gpt5"),
    "unknown backend": (["+model=llama", "backend=nope"], "nope"),
    "unknown key": (["+model=llama", "run.stepz=3"], "stepz"),
    "unknown appended key": (["+model=llama", "+run.bogus=1"], "run.bogus"),
    "key of another backend": (["+model=llama", "+backend.zero_stage=2"], "backend.zero_stage"),
    "batch not divisible by micro": (
        ["+model=llama", "data.global_batch_size=6", "data.micro_batch_size=4"],
        "data.global_batch_size",
    ),
    "batch not divisible by world": (
        ["+model=llama", "data.global_batch_size=4", "data.micro_batch_size=4", "launcher.nproc_per_node=2"],
        "data.global_batch_size",
    ),
    "heads do not divide hidden": (["+model=llama", "model.num_attention_heads=7"], "model.num_attention_heads"),
    "kv heads do not divide heads": (["+model=llama", "model.num_key_value_heads=3"], "model.num_key_value_heads"),
    "cuda not present": (["+model=llama", "device=cuda"], "device"),
    "npu not present": (["+model=llama", "device=npu"], "device"),
    "unknown precision": (["+model=llama", "run.precision=fp64"], "run.precision"),
    "fp16 unsupported by ddp": (["+model=llama", "run.precision=fp16"], "run.precision"),
    "zero steps": (["+model=llama", "run.steps=0"], "run.steps"),
    "negative lr": (["+model=llama", "optim.lr=-1"], "optim.lr"),
    "steps not an int": (["+model=llama", "run.steps=abc"], "run.steps"),
    "text without path": (["+model=llama", "data=text"], "data.path"),
    "text file missing": (["+model=llama", "data=text", "data.path=/nonexistent/file.txt"], "data.path"),
    "fsdp offload on cpu": (["+model=llama", "backend=fsdp", "backend.cpu_offload=true"], "backend.cpu_offload"),
    "node rank outside nnodes": (["+model=llama", "launcher.node_rank=1"], "launcher.node_rank"),
    "beta out of range": (["+model=llama", "optim.betas=[0.9,1.5]"], "optim.betas"),
    "sequence longer than positions": (["+model=llama", "data.seq_len=100000"], "data.seq_len"),
    "multi-node without port": (["+model=llama", "launcher.nnodes=2"], "launcher.master_port"),
    # job 1 (one rank) is valid; job 2 (three ranks) is not: the whole sweep is refused before job 1 starts
    "bad value in a later sweep job": (
        ["-m", "+model=llama", "launcher.nproc_per_node=1,3", "data.global_batch_size=4", "data.micro_batch_size=2"],
        "data-parallel size = 2 x 3",
    ),
}


@pytest.mark.parametrize("name", sorted(INVALID))
def test_invalid_config_is_refused_before_launch(name, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args, must_name = INVALID[name]
    assert_refused_before_launch(args, must_name, tmp_path, capsys)


def test_errors_name_the_choices():
    from parabench.adapters.registry import get_adapter
    from parabench.errors import SpecError

    with pytest.raises(SpecError) as exc:
        get_adapter("nope")
    assert "ddp" in str(exc.value) and "fsdp" in str(exc.value)


@pytest.mark.parametrize("backend", ["ddp", "megatron"])
def test_fp8_is_refused_with_its_real_reason(backend, tmp_path, capsys, monkeypatch):
    """fp8 names what it needs (Transformer Engine on a device with fp8 tensor cores), not the list of
    precisions; bench plan says the same (tests/test_plan.py), not that no layout accepts the batch."""
    monkeypatch.chdir(tmp_path)
    err = assert_refused_before_launch(
        ["+model=llama", f"backend={backend}", "run.precision=fp8"], "run.precision", tmp_path, capsys
    )
    assert "Transformer Engine" in err and "compute capability 8.9" in err and "no parabench backend" in err, err
    assert "is not one of" not in err, err
