"""The scaling experiment end to end: sweep -> parent run with efficiencies -> bench compare -> HTML."""

import json
import shutil
import subprocess

import pytest

from conftest import bench, mlflow_runs

pytestmark = pytest.mark.full


@pytest.fixture(scope="module")
def scaling(tmp_path_factory):
    results = tmp_path_factory.mktemp("scaling")
    proc = bench(
        [
            "run",
            "-m",
            "+experiment=scaling_cpu",
            "backend=ddp,fsdp",
            "run.steps=2",
            "run.warmup_steps=0",
            "data.seq_len=32",
        ],
        results,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return results


def test_parent_run_logs_efficiencies(scaling):
    runs = mlflow_runs(scaling, "scaling_cpu")
    parent = runs[runs["tags.parabench.kind"] == "sweep"].iloc[0]
    children = runs[runs["tags.parabench.kind"] == "job"]
    assert len(children) == 8  # 2 backends x 2 world sizes x 2 repeats
    assert set(children["tags.mlflow.parentRunId"]) == {parent["run_id"]}
    for backend in ("ddp", "fsdp"):
        mine = children[children["tags.backend"] == backend]
        tps = {n: mine[mine["tags.world_size"] == n]["metrics.tokens_per_s"] for n in ("1", "2")}
        eff = parent[f"metrics.efficiency/{backend}/N2"]
        assert eff == pytest.approx(tps["2"].median() / (2 * tps["1"].median()))  # E(N) = T(N) / (N T(1))
        assert parent[f"metrics.efficiency/{backend}/N2_min"] == pytest.approx(tps["2"].min() / (2 * tps["1"].max()))
        assert parent[f"metrics.efficiency/{backend}/N2_max"] == pytest.approx(tps["2"].max() / (2 * tps["1"].min()))
    # weak scaling: the global batch follows the world size
    assert set(zip(children["tags.world_size"], children["params.data.global_batch_size"], strict=True)) == {
        ("1", "2"),
        ("2", "4"),
    }


def test_compare_report_matches_mlflow_and_renders(scaling, tmp_path):
    out = tmp_path / "report"
    proc = bench(
        [
            "compare",
            "--experiment",
            "scaling_cpu",
            "--baseline",
            "backend=ddp",
            "--format",
            "table",
            "--tracking-uri",
            f"sqlite:///{scaling / 'mlflow.db'}",
            "--out",
            str(out),
        ],
        scaling,
    )
    assert proc.returncode == 0, proc.stderr
    assert "ddp" in proc.stdout and "fsdp" in proc.stdout and "weak" in proc.stdout
    page = (out / "report.html").read_text()
    data = json.loads(page.split("id='report-data'>")[1].split("</script>")[0])
    runs = mlflow_runs(scaling, "scaling_cpu")
    jobs = runs[runs["tags.parabench.kind"] == "job"]
    for row in data["sections"][0]["rows"]:
        mine = jobs[(jobs["tags.backend"] == row["backend"]) & (jobs["tags.world_size"] == str(row["world_size"]))]
        assert row["repeats"] == len(mine) == 2
        assert row["tokens_per_s"] == pytest.approx(mine["metrics.tokens_per_s"].median())
        assert row["tokens_per_s_min"] == pytest.approx(mine["metrics.tokens_per_s"].min())
        assert row["mfu"] == pytest.approx(mine["metrics.mfu"].median())
    assert not (runs["tags.parabench.kind"] == "compare").any()  # comparisons have their own experiment
    compare_runs = mlflow_runs(scaling, "scaling_cpu-comparisons")
    assert len(compare_runs) == 1  # the report is logged as an artifact of a comparison run
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium not installed (.ci/run installs it)")
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'chrome'}",
    ]
    shot = tmp_path / "report.png"
    subprocess.run(
        [chromium, *flags, f"--screenshot={shot}", "--window-size=1400,2000", (out / "report.html").as_uri()],
        capture_output=True,
        timeout=120,
    )
    assert shot.exists() and shot.stat().st_size > 10_000
    dom = subprocess.run(
        [chromium, *flags, "--dump-dom", (out / "report.html").as_uri()], capture_output=True, text=True, timeout=120
    ).stdout
    for plot in ("throughput-0", "efficiency-0", "memory-0", "loss-0"):
        assert f'id="{plot}"' in dom
    assert "Scaling efficiency vs devices" in dom and "polyline" in dom
