"""A source tree the user did not write cannot make `bench migrate` write outside its place
(issue 33, item 2): links planted under the migrator's temporary or backup names, and in-tree
links whose text points back into the source tree."""

from __future__ import annotations

import os
from pathlib import Path

from parabench.migrate.cli import main

TRAIN = "import torch\n\ntorch.cuda.set_device(0)\nx = torch.zeros(2).cuda()\n"
PRECIOUS = "precious: must stay as it is\n"


def _tree(tmp_path: Path) -> tuple[Path, Path]:
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text(TRAIN)
    victim = tmp_path / "victim.txt"  # outside the tree
    victim.write_text(PRECIOUS)
    return src, victim


def test_in_place_never_writes_through_a_link_named_like_its_temporary_file(tmp_path):
    src, victim = _tree(tmp_path)
    (src / "train.py.bench-migrate.tmp").symlink_to(victim)
    assert main([str(src), "--in-place", "--backup", "-q"]) == 0
    assert victim.read_text() == PRECIOUS
    migrated = src / "train.py"
    assert not migrated.is_symlink() and "torch.npu.set_device" in migrated.read_text()


def test_the_output_never_writes_into_the_source_through_a_copied_link(tmp_path):
    src, _ = _tree(tmp_path)
    (src / "model.py").write_text(PRECIOUS)
    # an in-tree link with an absolute text, under the temporary name of train.py's output
    (src / "train.py.bench-migrate.tmp").symlink_to(src / "model.py")
    out = tmp_path / "out"
    assert main([str(src), "--out", str(out), "-q"]) == 0
    assert (src / "model.py").read_text() == PRECIOUS and (src / "train.py").read_text() == TRAIN
    assert "torch.npu.set_device" in (out / "train.py").read_text()


def test_a_copied_in_tree_link_points_into_the_output_not_back_into_the_source(tmp_path):
    src, _ = _tree(tmp_path)
    (src / "pkg").mkdir()
    (src / "pkg" / "model.py").write_text("import torch\n")
    (src / "alias.py").symlink_to(src / "pkg" / "model.py")  # absolute text, target inside the tree
    out = tmp_path / "out"
    assert main([str(src), "--out", str(out), "-q"]) == 0
    link = out / "alias.py"
    assert link.is_symlink() and not os.path.isabs(os.readlink(link))
    assert Path(os.path.realpath(link)) == (out / "pkg" / "model.py").resolve()


def test_a_backup_that_exists_or_is_a_link_is_refused_before_anything_is_written(tmp_path, capsys):
    src, victim = _tree(tmp_path)
    (src / "train.py.orig").symlink_to(victim)
    assert main([str(src), "--in-place", "--backup", "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "train.py.orig already exists" in err, err
    assert victim.read_text() == PRECIOUS and (src / "train.py").read_text() == TRAIN


def test_a_link_planted_where_an_output_file_goes_is_replaced_never_written_through(tmp_path):
    """Output files are created exclusively where nothing is yet (O_EXCL | O_NOFOLLOW); a link
    already at a destination - of a changed file or of a copied one - is replaced, not followed."""
    from parabench.migrate.core import Options
    from parabench.migrate.engine import run

    src, victim = _tree(tmp_path)
    (src / "notes.txt").write_text("copied as it is\n")
    out = tmp_path / "out"
    out.mkdir()
    for name in ("train.py", "notes.txt"):
        (out / name).symlink_to(victim)
    result = run([src], Options(), out, jobs=1, progress=False)
    assert {r.path: r.status for r in result.files} == {"notes.txt": "copied", "train.py": "changed"}
    assert victim.read_text() == PRECIOUS
    assert not (out / "train.py").is_symlink() and "torch.npu.set_device" in (out / "train.py").read_text()
    assert not (out / "notes.txt").is_symlink() and (out / "notes.txt").read_text() == "copied as it is\n"
    assert not list(out.glob(".*.bench-migrate.tmp"))
