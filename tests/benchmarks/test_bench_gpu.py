"""CPU smoke test of ``benchmarks/bench_gpu.py``: the quick sizes run end to end (with ``--profile``) and the report
has every section.

About 15 s on 2 CPU cores (the NCCL variants run over gloo there). The real numbers
come from ``bash scripts/gpu_check.sh`` on a GPU machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_gpu.py"


def test_bench_gpu_quick_on_cpu_writes_every_section(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "examples")] + [env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)
    command = [sys.executable, str(SCRIPT), "--quick", "--device", "cpu", "--out", str(tmp_path), "--profile"]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert (tmp_path / "gpu.md").read_text().startswith("# GPU benchmark")

    assert {"meta", "notes", "peak", "newton_schulz", "muon_step", "gpt", "optimizer_dp8"} <= result.keys()
    assert result["meta"]["quick"] is True and result["meta"]["device"] == "cpu"
    assert result["notes"], "a CPU run must say that its numbers are not measurements"
    assert result["peak"]["tflops_median"] > 0

    ns = result["newton_schulz"]
    assert {"rows", "overall_tflops", "overall_fraction_of_peak", "target_met"} <= ns.keys()
    assert all({"shape", "batch", "flops", "median_ms", "tflops", "fraction_of_peak"} <= r.keys() for r in ns["rows"])
    # 5 iterations of X X^T (2 m^2 n), A A (2 m^3), B X (2 m^2 n); tall matrices are transposed first.
    row = next(r for r in ns["rows"] if r["shape"] == [224, 64])
    assert row["flops"] == row["batch"] * 5 * (4 * 64 * 64 * 224 + 2 * 64 ** 3)

    assert result["muon_step"]["layerwise_muon"]["median_ms"] > 0
    assert "torch_muon" in result["muon_step"]

    gpt = result["gpt"]
    assert set(gpt["variants"]) == {"plain", "layerwise_single", "layerwise_pg1", "ddp_pg1"}
    for name, v in gpt["variants"].items():
        assert {"median_ms", "ratio_vs_plain", "peak_memory_bytes", "first_loss"} <= v.keys(), name
    first = {v["first_loss"] for v in gpt["variants"].values()}
    assert max(first) - min(first) < 1e-4, first  # the same model, seed and batch in every variant
    assert {"worst_layerwise_ratio", "target_met", "backend"} <= gpt.keys()
    # --profile: aten operations per step; the one-process wrapper copies no gradient (Note [in-place gradients])
    assert set(gpt["profile"]) == set(gpt["variants"])
    single = gpt["profile"]["layerwise_single"]
    assert single["ops"] > 0 and single["copy_"] + single["clone"] == 0 and single["buffer_copies"] == 0
    assert "aten operations per step" in (tmp_path / "gpu.md").read_text()

    opt = result["optimizer_dp8"]
    assert opt["dp"] == 8 and opt["replicated"]["median_ms"] > 0
    for plan in opt["plans"].values():
        assert len(plan["ranks"]) == 8
        assert {"busiest_ms", "ratio_vs_replicated", "measured_busiest_rank", "planned_busiest_rank"} <= plan.keys()
