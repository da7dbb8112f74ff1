"""`bench convert` publishes only what it verified, and never writes into its own source (issue 33,
items 6 and 7): a conversion that fails or mismatches after the import leaves no checkpoint that
``run.resume`` accepts; an --out inside (or equal to, or holding) the source is refused before
anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import TINY
from parabench.errors import RunFailed, SpecError


def _canonical(directory: Path) -> Path:
    """A canonical directory of the tiny model's initial weights (what `--to canonical` writes)."""
    import numpy as np

    from parabench import canonical
    from parabench.hydraconfig import compose, to_plain
    from parabench.jobs import from_config
    from parabench.model import initial_weights

    spec = from_config(to_plain(compose(["+model=llama", *(a for a in TINY if a.startswith("model."))]))).model
    weights = initial_weights(spec, seed=0)
    moments = {k: {n: np.zeros_like(w) for n, w in weights.items()} for k in canonical.MOMENTS}
    canonical.write(directory, canonical.CanonicalState(weights, moments, 3), [], {"source": _source_info()})
    return directory


def _source_info() -> dict:
    from parabench.hydraconfig import compose, to_plain
    from parabench.jobs import from_config
    from parabench.resilience.checkpoint import job_identity

    job = from_config(to_plain(compose(["+model=llama", "backend=ddp", *TINY])))
    return {"path": "x", "format": "ddp", "job": job_identity(job), "world_size": None, "layout": None}


@pytest.mark.parametrize("where", ["inside", "same", "holding"])
def test_an_out_inside_equal_to_or_holding_the_source_is_refused_before_anything_is_written(tmp_path, capsys, where):
    from parabench.cli import main

    src = _canonical(tmp_path / "shared" / "canon")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    out = {"inside": src / "converted", "same": src, "holding": src.parent}[where]
    code = main(["convert", str(src), "--to", "canonical", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("bench: error: --out:"), err
    assert "choose a directory apart from it" in err, err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def _convert_then(tmp_path, monkeypatch, after) -> int:
    """Convert the canonical source to ddp (1 rank); ``after`` sees the import launch's result."""
    from parabench.convert import command as convert

    real = convert.launch

    def launch(job, run_dir, request):
        result = real(job, run_dir, request)
        return after(result) if request["mode"] == "import" else result

    monkeypatch.setattr(convert, "launch", launch)
    src = _canonical(tmp_path / "canon")
    return convert.main([str(src), "--to", "ddp", "--out", str(tmp_path / "out"), *TINY[-2:]])


def _assert_nothing_resumable(out: Path) -> None:
    from parabench.resilience.checkpoint import MARKER, _resolve_path

    assert not list(out.rglob(MARKER)), list(out.rglob(MARKER))
    with pytest.raises(SpecError, match="no complete checkpoint"):
        _resolve_path(str(out))


@pytest.mark.full
@pytest.mark.parametrize("fault", ["fails", "mismatches"])
def test_a_conversion_that_fails_after_the_import_leaves_nothing_to_resume(tmp_path, monkeypatch, capsys, fault):
    """The import workers have written the target checkpoint; then the conversion fails (a rank that
    dies at exit, bench stopped) or the checksum read back differs: nothing under --out is a complete
    checkpoint, and run.resume=<out> finds none."""

    def after(result):
        if fault == "fails":
            raise RunFailed("import on ddp failed (a rank died after rank 0 wrote its result)")
        return {**result, "checksum": "0" * len(result["checksum"])}

    assert _convert_then(tmp_path, monkeypatch, after) == 1
    assert "convert failed" in capsys.readouterr().err
    _assert_nothing_resumable(tmp_path / "out")


@pytest.mark.full
def test_a_verified_conversion_is_published_complete(tmp_path, monkeypatch, capsys):
    from parabench.resilience.checkpoint import _resolve_path

    assert _convert_then(tmp_path, monkeypatch, lambda result: result) == 0
    path, marker = _resolve_path(str(tmp_path / "out"))
    assert path == tmp_path / "out" / "step_000003" and marker["converted"] and marker["step"] == 3
    record = json.loads((tmp_path / "out" / "convert.json").read_text())
    assert record["target"]["checkpoint"] == str(path) and not list((tmp_path / "out").glob("*.tmp"))
