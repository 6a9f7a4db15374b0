"""LightningCLI: the example configs parse into LayerwiseStrategy + Muon, a config runs a short fit, and a bad
strategy value in a config is refused.

A value ``LayerwiseStrategy.__init__`` rejects ends in a traceback (exit code 1; docs/reliability.md lists
it under "messages to improve"); a value outside a ``Literal`` choice is a usage error (exit code 2).
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


TRAIN = str(ROOT / "examples" / "train.py")
# sharded_cpu.yaml is cpu.yaml with shard_parameters on: test_short_fit_from_config parses and runs it
CONFIGS = sorted(c for c in (ROOT / "examples" / "configs").glob("*.yaml") if c.stem != "sharded_cpu")


TRAIN_MOE = str(ROOT / "examples" / "train_moe.py")


# Each script's runs of ``--print_config`` (its configs, and the command lines below) are made by one interpreter,
# one LightningCLI run after another (the imports are most of a run's time), each run's output and exit code kept
# apart.
_PRINT_ALL = """
import contextlib, io, json, runpy, sys
script, runs, results = sys.argv[1], json.loads(sys.argv[2]), {}
for key, args in runs.items():
    out, err, code = io.StringIO(), io.StringIO(), 0
    sys.argv = [script, "fit", *args, "--print_config"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exit:
            code = exit.code or 0
    results[key] = [code, out.getvalue(), err.getvalue()]
print(json.dumps(results))
"""

# Command lines printed beside the configs: the Muon family's knobs (per-head split, QK-clip's bound, NorMuon and
# a schedule for the GPT; grouped experts for the MoE).
KNOBS = {
    TRAIN: ["--config", str(ROOT / "examples/configs/cpu.yaml"), "--model.split_qkv", "heads",
            "--model.qk_clip_tau", "100", "--model.optimizer.normuon", "true", "--model.optimizer.lr", "0.01",
            "--model.optimizer.ns_coefficients", "polar_express"],
    TRAIN_MOE: ["--config", str(ROOT / "examples/configs/moe_cpu.yaml"), "--model.grouped_experts", "true"],
}


def _script(config: Path) -> str:
    return TRAIN_MOE if config.stem.startswith("moe") else TRAIN


@pytest.fixture(scope="module")
def printed_configs(tmp_path_factory):
    """``printed(key)``: (exit code, stdout, stderr) of ``--print_config`` for a config path or a script's
    :data:`KNOBS` (key: the script); each script runs once, for all of its runs, when the first is asked for."""
    cwd, results = tmp_path_factory.mktemp("print_config"), {}

    def printed(key: Path | str) -> list:
        if str(key) not in results:
            script = key if isinstance(key, str) else _script(key)
            runs = {str(c): ["--config", str(c)] for c in CONFIGS if _script(c) == script}
            runs[script] = KNOBS[script]
            result = subprocess.run([sys.executable, "-c", _PRINT_ALL, script, json.dumps(runs)], cwd=cwd,
                                    capture_output=True, text=True, timeout=240)
            assert result.returncode == 0, result.stderr[-3000:]
            results.update(json.loads(result.stdout.splitlines()[-1]))
        return results[str(key)]

    return printed


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_print_config(config, printed_configs):
    moe = config.stem.startswith("moe")
    code, stdout, stderr = printed_configs(config)
    assert code == 0, stderr[-3000:]
    printed = yaml.safe_load(stdout)
    strategy = printed["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_layerwise.LayerwiseStrategy"
    assert strategy["init_args"]["bucket_size"] > 0
    assert strategy["init_args"]["shard_parameters"] is False
    if moe:  # the MoE example: experts over 2 expert-parallel ranks, Muon built inside the module
        assert strategy["init_args"]["expert_parallel_size"] == 2
        assert printed["model"]["num_experts"] % 2 == 0 and printed["model"]["lr"] == 0.02
        return
    assert printed["model"]["optimizer"]["class_path"] == "lightning_layerwise.Muon"
    assert printed["model"]["optimizer"]["init_args"]["lr"] == 0.02


@pytest.mark.slow
@pytest.mark.parametrize("config", ["cpu.yaml", "sharded_cpu.yaml"])
def test_short_fit_from_config(tmp_path, config):
    """A fit from each config learns and its processes exit 0. A fit that ended normally and then aborted at
    interpreter exit ("terminate called without an active exception", exit 134: process groups and gloo's
    threads still alive) fails here, as it fails every launched run of the suite."""
    text = tmp_path / "corpus.txt"
    text.write_text("def add(a, b):\n    return a + b\n\n" * 400)
    out = tmp_path / "runs"
    cmd = [sys.executable, TRAIN, "fit", "--config", str(ROOT / "examples/configs" / config),
           "--data.text_path", str(text), "--data.batch_size", "4", "--data.block_size", "32",
           "--model.block_size", "32", "--model.n_layer", "2", "--model.n_embd", "32", "--model.n_head", "2",
           "--trainer.max_steps", "6", "--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "2",
           "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(out),
           "--trainer.logger.init_args.save_dir", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-5000:]
    assert "terminate called" not in result.stderr
    assert "Exception ignored" not in result.stderr, result.stderr[-5000:]  # e.g. a failed release at exit
    metrics = next(out.glob("gpt/version_*/metrics.csv"))
    rows = list(csv.DictReader(metrics.open()))
    val = [float(r["val_loss"]) for r in rows if r.get("val_loss")]
    assert len(val) == 2 and all(v == v for v in val)
    assert val[-1] < val[0], "validation loss falls within six steps on a repetitive corpus"


# --- a bad strategy value in a config: a traceback or a usage error ----------------------------------------


@pytest.fixture(scope="module")
def cli_errors(tmp_path_factory):
    """``examples/train.py fit`` with one bad strategy value each; both processes run side by side."""
    cwd = tmp_path_factory.mktemp("cli")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    bad = {"rejected_by_the_strategy": ["--trainer.strategy.init_args.bucket_size", "-4"],
           "outside_a_literal": ["--trainer.strategy.init_args.grad_reduce_dtype", "float64"]}
    procs = {name: subprocess.Popen([sys.executable, str(ROOT / "examples" / "train.py"), "fit", "--config",
                                     str(ROOT / "examples" / "configs" / "cpu.yaml"), *args, "--trainer.max_steps", "1"],
                                    cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, args in bad.items()}
    results = {}
    for name, proc in procs.items():
        output, _ = proc.communicate(timeout=180)
        results[name] = (proc.returncode, output)
    return results


def test_a_cli_value_the_strategy_rejects_ends_in_a_traceback(cli_errors):
    code, output = cli_errors["rejected_by_the_strategy"]
    assert code == 1, output[-2000:]
    assert "Traceback (most recent call last)" in output  # LightningCLI instantiates the strategy: no usage line
    assert "ValueError: Does not validate against any of the Union subtypes" in output
    assert ("  - LayerwiseStrategy(bucket_size=-4): pass a positive number of elements, e.g. bucket_size=40000000, "
            "or 'auto' (40000000, and 4194304 with shard_parameters=True).\n") in output


def test_a_cli_value_outside_a_literal_choice_is_a_usage_error(cli_errors):
    code, output = cli_errors["outside_a_literal"]
    assert code == 2, output[-2000:]
    assert output.startswith("usage: train.py") and "Traceback" not in output
    assert re.search(r'error: Parser key "trainer\.strategy":.*Parser key "grad_reduce_dtype":.*'
                     r"Expected a typing\.Literal\['float32', 'bfloat16', 'float16'\].*Given value: float64",
                     output, re.S), output[-2000:]


def test_the_muon_family_knobs_parse_from_the_command_line(printed_configs):
    """Per-head split, QK-clip's bound, NorMuon and a schedule for the GPT; grouped experts for the MoE."""
    code, stdout, stderr = printed_configs(TRAIN)
    assert code == 0, stderr[-3000:]
    printed = yaml.safe_load(stdout)
    assert printed["model"]["split_qkv"] == "heads" and printed["model"]["qk_clip_tau"] == 100.0
    args = printed["model"]["optimizer"]["init_args"]
    assert args["normuon"] is True and args["ns_coefficients"] == "polar_express" and args["lr"] == 0.01
    code, stdout, stderr = printed_configs(TRAIN_MOE)
    assert code == 0, stderr[-3000:]
    assert yaml.safe_load(stdout)["model"]["grouped_experts"] is True
