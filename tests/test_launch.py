"""Every launch mode runs a short fit on CPU (gloo) and all ranks end with the same parameters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _dist import free_port

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "tests" / "launch_script.py")
pytestmark = pytest.mark.slow


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_", "PL_")) and k not in
           ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
            "LOCAL_WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **extra)
    return env


def run(cmd: list[str], env: dict[str, str], timeout: float = 240) -> None:
    result = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


def records(outdir: Path, world: int) -> list[dict]:
    found = sorted(outdir.glob("rank*.json"))
    assert len(found) == world, [p.name for p in found]
    recs = [json.loads(p.read_text()) for p in found]
    assert sorted(r["global_rank"] for r in recs) == list(range(world))
    for r in recs:
        assert r["world_size"] == world and r["strategy"] == "LayerwiseStrategy" and r["global_step"] == 4
        # Bitwise-equal parameters give the same checksum, computed by the same code on every rank.
        assert r["checksum"] == recs[0]["checksum"], "every rank holds the same parameters"
    return recs


@pytest.mark.parametrize("strategy, devices", [("layerwise", 1), ("layerwise", 2), ("layerwise_spawn", 2)])
def test_devices_on_one_machine(tmp_path, strategy, devices):
    run([sys.executable, SCRIPT, str(tmp_path), "--strategy", strategy, "--devices", str(devices)],
        clean_env(MASTER_PORT=str(free_port())))
    records(tmp_path, devices)


def test_torchrun(tmp_path):
    run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         SCRIPT, str(tmp_path), "--strategy", "layerwise", "--devices", "2"], clean_env())
    recs = records(tmp_path, 2)
    assert {r["environment"] for r in recs} == {"TorchElasticEnvironment"}


def run_together(args: list[str], envs: list[dict[str, str]], timeout: float = 240) -> None:
    """Starts one process per environment (as srun or one launcher per node would) and waits for all."""
    procs = [subprocess.Popen([sys.executable, SCRIPT, *args], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for env in envs]
    for p in procs:
        _, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err[-5000:]


def test_slurm_environment_variables(tmp_path):
    port = str(free_port())
    envs = [clean_env(SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank),
                      SLURM_NODEID="0", SLURM_JOB_ID="4242", SLURM_JOB_NAME="layerwise", SLURM_NODELIST="127.0.0.1",
                      MASTER_PORT=port)
            for rank in range(2)]
    run_together([str(tmp_path), "--strategy", "layerwise", "--devices", "2"], envs)
    recs = records(tmp_path, 2)
    assert {r["environment"] for r in recs} == {"SLURMEnvironment"}


def test_two_nodes_on_loopback(tmp_path):
    port = str(free_port())
    envs = [clean_env(NODE_RANK=str(node), MASTER_ADDR="127.0.0.1", MASTER_PORT=port) for node in range(2)]
    run_together([str(tmp_path), "--strategy", "layerwise", "--devices", "1", "--num_nodes", "2"], envs)
    recs = records(tmp_path, 2)
    assert sorted(r["node_rank"] for r in recs) == [0, 1]


def test_a_dead_rank_ends_the_job_with_an_error(tmp_path):
    """Rank 1 exits hard mid-training: rank 0 must fail with an error instead of hanging."""
    result = subprocess.run([sys.executable, SCRIPT, str(tmp_path), "--strategy", "layerwise", "--devices", "2",
                             "--die_at_step", "2"], env=clean_env(MASTER_PORT=str(free_port())), cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "Connection" in result.stderr or "Error" in result.stderr
    assert not list(tmp_path.glob("rank*.json")), "the fit must not complete"
