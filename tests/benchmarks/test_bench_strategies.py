"""The strategy benchmark: its pure aggregation/report code, and one tiny end-to-end run.

The end-to-end test runs the real harness (fresh worker processes, Lightning, the
communication counters) at 1 rank for 2 timed steps of the tiny size; it takes
about 20 s on 2 CPU cores.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_strategies.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_strategies", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is created
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def _fake_run(step_ms: float, opt_ms: float, ns_ms: float, state: list[int], comm: float, losses: list[float]) -> dict:
    """What run_one returns: per-rank lists of per-step times and counters."""
    steps = 4
    ranks = []
    for rank, state_bytes in enumerate(state):
        ranks.append({
            "rank": rank,
            "losses": losses,
            "step_ms": [step_ms + rank] * steps,
            "step_cpu_ms": [step_ms] * steps,
            "fwd_bwd_ms": [step_ms - opt_ms - 1] * steps,
            "clip_ms": [1.0] * steps,
            "opt_ms": [opt_ms] * steps,
            "counters": {"ns_ms": [ns_ms] * steps, "comm_bytes": [comm] * steps, "ring_bytes": [comm / 2] * steps,
                         "comm_blocked_ms": [0.5] * steps, "wrapper_wait_ms": [0.25] * steps,
                         "bytes_all_reduce": [comm] * steps},
            "optimizer_state_bytes_peak": state_bytes,
            "param_bytes": 1000,
            "peak_rss_bytes": 2**20,
            "cuda_max_allocated_bytes": None,
        })
    return {"ranks": ranks, "process_wall_s": 1.0, "exit_code": 0}


def test_aggregate_targets_and_report(bench, tmp_path):
    losses = [4.0, 3.5, 3.0]
    runs = {
        "ddp_adamw": [bench.summarize_run(_fake_run(100, 2, 0, [800, 800], 4000, losses)) for _ in range(3)],
        "ddp_muon": [bench.summarize_run(_fake_run(300, 200, 150, [400, 400], 4000, losses))],
        "layerwise_adamw": [bench.summarize_run(_fake_run(104, 1, 0, [408, 392], 8000, losses))],
        "layerwise_muon": [bench.summarize_run(_fake_run(200, 100, 75, [210, 190], 8000, [4.0, 3.5, 3.1]))],
    }
    table = bench.aggregate(runs, tokens_per_step=1000)
    # The slower rank per step (rank 1 adds 1 ms), the median over runs.
    assert table["ddp_adamw"]["step_ms_median"] == 101
    assert table["ddp_adamw"]["tokens_per_s_median"] == pytest.approx(1000 / 0.101)
    assert table["layerwise_adamw"]["step_ratio_replicated"] == pytest.approx(105 / 101)
    assert table["layerwise_muon"]["step_ratio_replicated"] == pytest.approx(201 / 301)
    assert table["layerwise_muon"]["state_ratio_replicated"] == pytest.approx(210 / 400)
    assert table["layerwise_muon"]["max_abs_loss_diff_replicated"] == pytest.approx(0.1)
    assert table["ddp_muon"]["ns_share"] == pytest.approx(150 / 301)
    assert table["layerwise_muon"]["exposed_comm_ms_median"] == 0.25  # the wrapper's own waits
    assert table["ddp_muon"]["exposed_comm_ms_median"] == 0.5
    assert "step_ratio_replicated" not in table["ddp_muon"]

    cell = {"size": "tiny", "devices": 2, "results": table,
            "model": dict(n_layer=1, n_embd=8, n_params=1000, batch_size=2, block_size=4, steps=4, warmup=1)}
    targets = {t["target"].split(",")[0]: t for t in bench.check_targets(cell)}
    assert targets["layerwise_adamw step / ddp_adamw step"]["met"]  # 1.04 <= 1.05
    assert targets["layerwise_muon step / ddp_muon step"]["met"]  # 0.67 <= 0.75
    assert not targets["layerwise_muon optimizer state per rank (bytes)"]["met"]  # 210 > 400 / 2 * 1.02
    assert bench.check_targets(dict(cell, devices=1)) == []

    cell["targets"] = bench.check_targets(cell)
    meta = {"accelerator": "cpu", "command": "python benchmarks/bench_strategies.py", "json": "x.json",
            "device_name": "cpu", "cpu_count": 2, "torch": "2", "backend": "gloo", "threads_per_rank": 1,
            "load_avg_start": [1.0, 1.0, 1.0], "load_avg_end": [2.0, 2.0, 2.0], "total_wall_s": 1.0, "repeats": 3}
    data = json.loads(json.dumps({"meta": meta, "cells": [cell]}))  # what --from-json reads back
    md = bench.write_report(data, tmp_path, plots=False)
    text = md.read_text()
    assert "| `layerwise_muon` | 201.0 |" in text
    assert "**no**" in text  # the missed state target is shown as missed


def test_rejects_bad_arguments(bench):
    with pytest.raises(ValueError, match="--configs"):
        bench.main(["--configs", "ddp_sgd"])
    with pytest.raises(ValueError, match="--devices"):
        bench.main(["--devices", "0"])


def test_tiny_end_to_end_one_rank(tmp_path):
    out = tmp_path / "strategies.json"
    cmd = [sys.executable, str(SCRIPT), "--sizes", "tiny", "--devices", "1", "--configs", "ddp_adamw,layerwise_muon",
           "--steps", "2", "--warmup", "1", "--repeats", "1", "--max-chars", "200000", "--out", str(out),
           "--docs-dir", str(tmp_path), "--no-plots", "--timeout", "120"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    (cell,) = data["cells"]
    ddp, layerwise = cell["results"]["ddp_adamw"], cell["results"]["layerwise_muon"]
    for row in (ddp, layerwise):
        assert len(row["losses_run0"]) == 3 and row["step_ms_median"] > 0
    # AdamW state is two fp32 copies of every parameter (+ step counters); Muon's is smaller.
    n_bytes = cell["model"]["n_params"] * 4
    assert 2 * n_bytes <= ddp["state_bytes_max_per_rank"] < 2 * n_bytes + 4096
    assert 0 < layerwise["state_bytes_max_per_rank"] < ddp["state_bytes_max_per_rank"]
    # DDP all-reduces every gradient once per step, even at one rank; one layerwise rank talks to nobody.
    assert ddp["comm_bytes_by_kind"]["all_reduce_ddp_buckets"] == n_bytes
    assert layerwise["comm_bytes_by_kind"].get("reduce_scatter_single", 0) == 0
    assert layerwise["ns_ms_median"] > 0
    # The wrapper's own wait timers (wrapper.grad_sync.waiter.seconds) were switched on.
    assert {"reduce_scatter", "norm_all_reduce"} <= set(layerwise["wrapper_wait_ms_by_kind"])
    assert (tmp_path / "strategies.md").exists()  # named after the JSON


def test_a_size_by_depth_is_the_120m_row_with_that_many_layers(bench):
    seven = bench.size_of("120m-L7")
    assert seven.n_layer == 7 and seven == bench.replace(bench.SIZES["120m"], n_layer=7)
    assert bench.size_of("tiny") is bench.SIZES["tiny"]
    for name in ("120m-L0", "huge"):
        with pytest.raises(ValueError, match="120m-L<layers>"):
            bench.size_of(name)


def test_the_cap_search_measures_both_sides_of_the_cap(monkeypatch):
    """``benchmarks/largest_under_cap.py`` with runs faked as a line of peak memory against depth: it ends with a
    measured depth that fits and the next rung up measured over the cap, starting from a wrong guess."""
    spec = importlib.util.spec_from_file_location("largest_under_cap", ROOT / "benchmarks" / "largest_under_cap.py")
    search = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(search)
    for intercept, slope in ((700.0, 16.0), (700.0, 40.0)):
        def fake(config, layers, args, scratch, intercept=intercept, slope=slope):
            peak = intercept + slope * layers + (50.0 if layers > 30 else 0.0)  # not a line: the guess misses
            return {"config": config, "layers": layers, "params": layers, "peak_rss_mib": peak + 100,
                    "train_peak_rss_mib": peak, "fits": peak <= args.cap_mib, "wall_s": 0.0}

        monkeypatch.setattr(search, "run_once", fake)
        args = search.parse_args(["--cap-mib", "2048", "--training-only", "--step", "4"])
        runs = search.search("c", args, None)
        best = search.summary("c", runs)
        fits, over = best["largest_fitting"], best["smallest_over"]
        assert fits["train_peak_rss_mib"] <= 2048 < over["train_peak_rss_mib"]
        assert over["layers"] == fits["layers"] + 4


def test_dtensor_functional_collectives_are_counted_with_the_c10d_conventions(bench):
    """A fake functional-collective call: all-gather counts its output (input x group), reduce-scatter and
    all-reduce their input, the group given as (mesh, dim) has mesh.size(dim) ranks."""

    class FakeMesh:
        def size(self, dim=None):
            return {0: 2, 1: 4}[dim]

    x = torch.zeros(8, 16)  # 512 bytes
    assert bench.funcol_group_size((FakeMesh(), 1)) == 4
    assert bench.funcol_group_size([0, 1, 2]) == 3 and bench.funcol_group_size([[0, 1], [2, 3]]) == 2
    assert bench.funcol_group_size(object()) == 1
    assert bench.funcol_bytes("all_gather_single", x, (FakeMesh(), 1)) == ("dtensor_all_gather_single", 2048, 1536)
    assert bench.funcol_bytes("all_gather_tensor", x, (FakeMesh(), 0))[:2] == ("dtensor_all_gather_single", 1024)
    assert bench.funcol_bytes("reduce_scatter_single", x, (FakeMesh(), 0)) == (
        "dtensor_reduce_scatter_single", 512, 256)
    assert bench.funcol_bytes("all_reduce", x, (FakeMesh(), 1)) == ("dtensor_all_reduce", 512, 768)
    assert bench.funcol_bytes("all_reduce_coalesced", [x, x], (FakeMesh(), 0))[:2] == ("dtensor_all_reduce_coalesced",
                                                                                         1024)


def test_tensor_parallel_rows_run_only_at_a_multiple_of_twice_their_size(bench):
    args = bench.build_parser().parse_args(["--sizes", "tp10m", "--devices", "2,4,6",
                                            "--configs", "layerwise_tp_muon,fsdp2_tp_adamw,layerwise_muon"])
    configs = {c["devices"]: c["configs"] for c in bench.plan_cells(args)}
    assert configs == {2: ["layerwise_muon"], 4: ["layerwise_tp_muon", "fsdp2_tp_adamw", "layerwise_muon"],
                       6: ["layerwise_muon"]}
    grads = [torch.full((3,), 2.0), torch.full((4,), 2.0)]  # total norm sqrt(7 * 4)
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g
    assert bench.clip_over_meshes(params, 1.0) == pytest.approx(28 ** 0.5)
    assert sum(float(p.grad.square().sum()) for p in params) == pytest.approx(1.0, rel=1e-5)
