"""Multi-node command construction (no cluster here: the command lines are the contract)."""

import pytest

from conftest import assert_refused_before_launch
from parabench.hydraconfig import compose, to_plain
from parabench.jobs import from_config, prepare
from parabench.launchers import Torchrun, expand_nodelist, slurm_placement


def job(*overrides):
    return from_config(to_plain(compose(["+model=llama", *overrides])))


def test_static_rendezvous_two_nodes():
    j = job(
        "launcher.nnodes=2",
        "launcher.nproc_per_node=8",
        "launcher.node_rank=1",
        "launcher.master_addr=10.0.0.1",
        "launcher.master_port=29500",
        "data.global_batch_size=16",
        "data.micro_batch_size=1",
    )
    cmd = Torchrun.command(j, 29500, "/shared/run", python="python")
    assert cmd == [
        "python",
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=8",
        "--max-restarts=0",
        "--master-port=29500",
        "--node-rank=1",
        "--master-addr=10.0.0.1",
        "-m",
        "parabench.worker",
        "/shared/run",
    ]
    assert Torchrun.bundle_command(j, 29500) == (
        'torchrun --nnodes=2 --nproc-per-node=8 --max-restarts=0 --master-port=29500 --node-rank="${NODE_RANK:-1}" '
        '--master-addr="${MASTER_ADDR:-10.0.0.1}" -m parabench.worker "$RUN_DIR"'
    )


def test_c10d_rendezvous():
    j = job(
        "launcher.nnodes=4",
        "launcher.nproc_per_node=8",
        "launcher.rdzv_backend=c10d",
        "launcher.rdzv_id=job42",
        "launcher.master_addr=head",
        "launcher.master_port=29400",
        "data.global_batch_size=32",
        "data.micro_batch_size=1",
    )
    cmd = Torchrun.command(j, 29400, "/r", python="python")
    assert "--rdzv-backend=c10d" in cmd and "--rdzv-id=job42" in cmd and "--rdzv-endpoint=head:29400" in cmd
    assert not any(a.startswith("--node-rank") for a in cmd)


def test_a_local_start_with_no_port_lets_the_launcher_bind_one():
    """Concurrent runs once failed with EADDRINUSE: a port picked by bench (bind 0, close) was taken
    by another run or an outgoing connection before torchrun bound it. With no port named, torchrun's
    agent binds port 0 itself (c10d, as --standalone does); msrun, which cannot, gets a free port below
    the ephemeral range; a named port is used as it is."""
    from parabench import launchers

    local = job("launcher.nproc_per_node=2")
    cmd = Torchrun.command(local, 0, "/r", python="python")
    assert "--rdzv-backend=c10d" in cmd and "--rdzv-endpoint=127.0.0.1:0" in cmd
    assert not any(a.startswith(("--master-port", "--node-rank")) for a in cmd)
    named = Torchrun.command(local, 29511, "/r", python="python")
    assert "--master-port=29511" in named and not any(a.startswith("--rdzv") for a in named)
    assert "--master-port=29500" in Torchrun.bundle_command(local, 29500)  # the bundle names its port

    low = launchers._ephemeral_low()
    ports = {launchers.unclaimed_port() for _ in range(20)}
    assert all(10000 <= p < low for p in ports) and len(ports) > 1, (ports, low)
    ms = job("backend=mindspore", "launcher.nproc_per_node=2")
    port = int(next(a for a in launchers.Msrun.command(ms, 0, "/r") if a.startswith("--master_port=")).split("=")[1])
    assert 10000 <= port < low
    assert "--master_port=29511" in launchers.Msrun.command(ms, 29511, "/r")


def test_slurm_nodelist_expansion():
    assert expand_nodelist("gpu[01-03,07],cpu5") == ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]
    assert expand_nodelist("node7") == ["node7"]


def test_slurm_placement_fills_node_rank_and_master(monkeypatch):
    env = {"SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[10-11]"}
    assert slurm_placement(env) == {"nnodes": 2, "node_rank": 1, "master_addr": "gpu10"}
    with pytest.raises(RuntimeError, match="not a Slurm job step"):
        slurm_placement({})
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    j = prepare(
        to_plain(
            compose(
                [
                    "+model=llama",
                    "launcher.slurm=true",
                    "launcher.master_port=29500",
                    "launcher.nproc_per_node=1",
                    "data.global_batch_size=4",
                    "data.micro_batch_size=2",
                ]
            )
        )
    )
    assert (j.launch.nnodes, j.launch.node_rank, j.launch.master_addr) == (2, 1, "gpu10")
    assert j.parallel.world_size == 2


def test_submitit_slurm_preset_composes_one_task_per_node():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    cfg = compose(
        [
            "+model=llama",
            "hydra/launcher=slurm_torchrun",
            "launcher.nnodes=2",
            "launcher.nproc_per_node=8",
            "launcher.slurm=true",
            "launcher.master_port=29500",
        ],
        return_hydra_config=True,
    )
    from omegaconf import OmegaConf

    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert launcher["nodes"] == 2 and launcher["tasks_per_node"] == 1 and launcher["gpus_per_node"] == 8
    assert "SlurmLauncher" in launcher["_target_"]


@pytest.mark.parametrize(
    "override, must_name",
    [
        ("launcher.master_addr='$(touch {marker})'", "launcher.master_addr"),
        ("launcher.master_addr='host\"; touch {marker}; \"'", "launcher.master_addr"),
        ("launcher.rdzv_id='x$(touch {marker})'", "launcher.rdzv_id"),
    ],
)
def test_shell_words_in_the_launch_bundle_are_refused_before_anything_is_written(
    override, must_name, tmp_path, capsys, monkeypatch
):
    """launch.sh and the Kubernetes command line put master_addr and rdzv_id into a shell line: a value
    holding `$(...)` or a quote ran when the bundle ran (issue 33, item 7). Refused, one line, no bundle."""
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "MARKER"
    args = ["+model=llama", "launcher.dry_run=true", "launcher.nnodes=2", "launcher.master_port=29500"]
    args.append(override.format(marker=marker))
    if "rdzv_id" in override:
        args.append("launcher.rdzv_backend=c10d")
    assert_refused_before_launch(args, must_name, tmp_path, capsys)
    assert not marker.exists() and not list(tmp_path.rglob("launch.sh"))
