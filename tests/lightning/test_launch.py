"""Every launch mode runs a short fit on CPU (gloo) and all ranks end with the same parameters; launch settings
that do not match the cluster are reported when ``fit`` starts.

* Launch modes: ``devices`` on one machine (popen and spawn launchers), ``torchrun``, SLURM's
  environment variables, two nodes on loopback. Each runs ``tests/launch_script.py`` and is marked slow.
* ``devices × num_nodes`` other than ``torchrun``'s world size, and ``devices`` or ``num_nodes`` other
  than SLURM's tasks and nodes: Lightning's own message when ``fit`` starts, before any process group.

A rank that dies during a launched fit: ``test_faults.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _dist import free_port
from helpers import (LAUNCH_SCRIPT as SCRIPT, ROOT, Tiny, clean_env, tiny_batches as batches,
                     tiny_trainer as trainer)


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


@pytest.mark.slow
@pytest.mark.parametrize("strategy, devices", [("layerwise", 1), ("layerwise", 2), ("layerwise_spawn", 2)])
def test_devices_on_one_machine(tmp_path, strategy, devices):
    run([sys.executable, SCRIPT, str(tmp_path), "--strategy", strategy, "--devices", str(devices)],
        clean_env(MASTER_PORT=str(free_port())))
    records(tmp_path, devices)


@pytest.mark.slow
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


@pytest.mark.slow
def test_slurm_environment_variables(tmp_path):
    port = str(free_port())
    envs = [clean_env(SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank),
                      SLURM_NODEID="0", SLURM_JOB_ID="4242", SLURM_JOB_NAME="layerwise", SLURM_NODELIST="127.0.0.1",
                      MASTER_PORT=port)
            for rank in range(2)]
    run_together([str(tmp_path), "--strategy", "layerwise", "--devices", "2"], envs)
    recs = records(tmp_path, 2)
    assert {r["environment"] for r in recs} == {"SLURMEnvironment"}


@pytest.mark.slow
def test_two_nodes_on_loopback(tmp_path):
    port = str(free_port())
    envs = [clean_env(NODE_RANK=str(node), MASTER_ADDR="127.0.0.1", MASTER_PORT=port) for node in range(2)]
    run_together([str(tmp_path), "--strategy", "layerwise", "--devices", "1", "--num_nodes", "2"], envs)
    recs = records(tmp_path, 2)
    assert sorted(r["node_rank"] for r in recs) == [0, 1]


# --- launch: devices and num_nodes against the cluster's world size --------------------------------------------


@pytest.fixture
def no_cluster_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith(("SLURM_", "TORCHELASTIC_", "PL_")) or key in (
                "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
                "MASTER_PORT"):
            monkeypatch.delenv(key)
    return monkeypatch


def test_devices_times_nodes_other_than_torchrun_world_size_is_reported_when_fit_starts(no_cluster_env):
    no_cluster_env.setenv("TORCHELASTIC_RUN_ID", "reliability")
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="4", LOCAL_WORLD_SIZE="4", GROUP_RANK="0",
                           MASTER_ADDR="127.0.0.1", MASTER_PORT="29400").items():
        no_cluster_env.setenv(key, value)
    t = trainer(devices=2, strategy="layerwise")
    assert type(t.strategy.cluster_environment).__name__ == "TorchElasticEnvironment"
    with pytest.raises(ValueError, match=r"You set `devices=2` and `num_nodes=1` in Lightning, but the product "
                                         r"\(2 \* 1\) does not match the world size \(4\)\."):
        t.fit(Tiny(), batches())
    assert not torch.distributed.is_initialized()


def test_devices_or_num_nodes_other_than_slurm_tasks_are_reported_when_fit_starts(no_cluster_env):
    for key, value in dict(SLURM_NTASKS="4", SLURM_NTASKS_PER_NODE="4", SLURM_NNODES="1", SLURM_PROCID="0",
                           SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_JOB_ID="4242", SLURM_JOB_NAME="layerwise",
                           SLURM_NODELIST="127.0.0.1").items():
        no_cluster_env.setenv(key, value)
    with pytest.raises(ValueError, match=r"You set `devices=2` in Lightning, but the number of tasks per node "
                                         r"configured in SLURM `--ntasks-per-node=4` does not match\. HINT: Set "
                                         r"`devices=4`\."):
        trainer(devices=2, strategy="layerwise").fit(Tiny(), batches())
    with pytest.raises(ValueError, match=r"You set `num_nodes=2` in Lightning, but the number of nodes configured "
                                         r"in SLURM `--nodes=1` does not match\. HINT: Set `num_nodes=1`\."):
        trainer(devices=4, num_nodes=2, strategy="layerwise").fit(Tiny(), batches())
    assert not torch.distributed.is_initialized()
