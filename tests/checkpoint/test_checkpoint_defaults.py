"""The default checkpoint opens where Lightning users open one (Note [auto format] in formats.py).

With ``strategy="layerwise"`` and no checkpoint setting (``checkpoint_format="auto"``), the
file ``ModelCheckpoint`` writes for the example model at 2 ranks:

* loads with ``GPTLightningModule.load_from_checkpoint(path)`` in a fresh process with no strategy,
  equal to the trained parameters, through the README's own line;
* resumes under ``ddp``, equal to the uninterrupted ``layerwise`` run (AdamW, relative error <= 1e-5);
* opens with ``torch.load``, whose ``state_dict`` is the trained parameters.

Above the size limit ``"auto"`` writes a sharded directory: it resumes at another world size; given to
``ddp`` it fails with ``IsADirectoryError`` naming the directory, whose ``README.txt`` names
``python -m lightning_layerwise consolidate``, and that command's file resumes under ``ddp``. Fabric
follows the same rule: ``Fabric(strategy="ddp").load`` reads what the default writes, and the default
reads what ``ddp`` writes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from _dist import run_distributed
from helpers import gpt_reference, rel_err

ROOT = Path(__file__).resolve().parents[2]
VOCAB, SEQ, WORLD, GLOBAL_BATCH = 31, 16, 2, 8
STEPS_PER_EPOCH = 2
TOL = 1e-5


def adamw(groups):
    return torch.optim.AdamW(groups, lr=3e-3, weight_decay=0.1)


def example_model():
    from examples.module import GPTLightningModule

    torch.manual_seed(0)
    # No biases: the attention key bias has a zero gradient, whose rounding noise AdamW would scale up.
    return GPTLightningModule(vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=32, block_size=SEQ, bias=False,
                              optimizer=adamw)


class GlobalBatches(torch.utils.data.Dataset):
    """Item i is this rank's rows of global batch i: any world size computes the same averaged gradient."""

    def __init__(self):
        g = torch.Generator().manual_seed(3)
        self.tokens = torch.randint(0, VOCAB, (STEPS_PER_EPOCH, GLOBAL_BATCH, SEQ + 1), generator=g)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        mine = self.tokens[i][rank::world]
        return mine[:, :-1], mine[:, 1:]


def _fit_worker(rank, world, root, strategy, max_steps, ckpt_path=None):
    model = example_model()
    save = ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=STEPS_PER_EPOCH, save_top_k=-1)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=max_steps, logger=False,
                        callbacks=[save], enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    trainer.fit(model, torch.utils.data.DataLoader(GlobalBatches(), batch_size=None), ckpt_path=ckpt_path)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_params_equal(got: dict, want: dict, what: str, tol: float = TOL) -> None:
    assert sorted(got) == sorted(want), what
    for name in want:
        assert rel_err(got[name], want[name]) <= tol, f"{what}: {name} differs by {rel_err(got[name], want[name])}"


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """``strategy="layerwise"`` with its defaults, 2 epochs at 2 ranks; checkpoints after each."""
    root = tmp_path_factory.mktemp("default_checkpoints")
    trained = run_distributed(_fit_worker, WORLD, str(root), "layerwise", 2 * STEPS_PER_EPOCH)
    return root, trained[0]


def readme_load_block() -> str:
    """The README's code block that loads the main job's checkpoint for inference."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    found = [b for b in blocks if ".load_from_checkpoint(" in b]
    assert len(found) == 1, "the README shows one block loading the trained model"
    return found[0]


@pytest.mark.slow
def test_the_readme_line_loads_the_default_checkpoint_in_a_fresh_process(default_run, tmp_path):
    root, trained = default_run
    path = root / f"step={2 * STEPS_PER_EPOCH}.ckpt"
    assert path.is_file(), "a model under the size limit is written as one file"
    block = readme_load_block()
    readme_path = re.search(r"load_from_checkpoint\((\"[^\"]+\")\)", block).group(1)
    assert readme_path.startswith('"runs/cpu/gpt/version_0/checkpoints/'), readme_path
    out = tmp_path / "loaded.pt"
    # The README's block with this run's checkpoint, in a process that builds no Trainer and no strategy.
    script = "\n".join([
        "import sys, torch",
        "sys.path.insert(0, '.')",
        block.replace(readme_path, repr(str(path))),
        f"torch.save({{n: p.detach() for n, p in model.named_parameters()}}, {str(out)!r})",
    ])
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_params_equal(torch.load(out, weights_only=True), trained, "load_from_checkpoint", tol=0.0)


@pytest.mark.slow
def test_torch_load_of_the_default_checkpoint_gives_the_state_dict(default_run):
    root, trained = default_run
    checkpoint = torch.load(root / f"step={2 * STEPS_PER_EPOCH}.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 2 * STEPS_PER_EPOCH
    state = checkpoint["state_dict"]
    assert_params_equal({n: state[n] for n in trained}, trained, "torch.load", tol=0.0)
    named = checkpoint["optimizer_states"][0]["state"]
    assert set(named) == set(trained), "optimizer state for every parameter, keyed by name"


@pytest.mark.slow
def test_ddp_resumes_the_default_checkpoint_as_if_uninterrupted(default_run, tmp_path):
    root, trained = default_run
    resumed = run_distributed(_fit_worker, WORLD, str(tmp_path), "ddp", 2 * STEPS_PER_EPOCH,
                              str(root / f"step={STEPS_PER_EPOCH}.ckpt"))
    for rank, params in enumerate(resumed):
        assert_params_equal(params, trained, f"ddp resume, rank {rank}")


# --- above the limit: a directory -------------------------------------------------------------------------------


def _sharded_fit_worker(rank, world, root, strategy, max_steps, ckpt_path=None):
    from lightning_layerwise.checkpoint import formats

    formats.AUTO_FULL_LIMIT = 1024  # this model (~30 KiB) is "too large": the default shards it
    return _fit_worker(rank, world, root, strategy, max_steps, ckpt_path)


def _ddp_outcome_worker(rank, world, root, path):
    try:
        _fit_worker(rank, world, root, "ddp", 2 * STEPS_PER_EPOCH, path)
    except Exception as error:  # noqa: BLE001 - the outcome is the result
        return f"{type(error).__name__}: {error}"
    return "resumed"


@pytest.mark.slow
def test_above_the_limit_the_default_shards_and_every_way_out_is_named(tmp_path):
    root = tmp_path / "run"
    trained = run_distributed(_sharded_fit_worker, WORLD, str(root), "layerwise", 2 * STEPS_PER_EPOCH)[0]
    half = root / f"step={STEPS_PER_EPOCH}.ckpt"
    assert half.is_dir(), "above the limit the default writes a sharded directory"

    # Resumes at another world size (4 ranks), as if uninterrupted.
    resumed = run_distributed(_fit_worker, 4, str(tmp_path / "r4"), "layerwise", 2 * STEPS_PER_EPOCH, str(half))
    for rank, params in enumerate(resumed):
        assert_params_equal(params, trained, f"sharded, saved at 2, resumed at 4, rank {rank}")

    # Given to ddp: IsADirectoryError naming the directory ...
    outcome = run_distributed(_ddp_outcome_worker, WORLD, str(tmp_path / "ddp"), str(half))
    for text in outcome:
        assert text.startswith("IsADirectoryError: [Errno 21] Is a directory: ") and str(half) in text, text
    # ... whose README.txt names the conversion command, which works as written.
    readme = (half / "README.txt").read_text()
    command = next(line.strip() for line in readme.splitlines() if "python -m lightning_layerwise consolidate" in line)
    assert command == f"python -m lightning_layerwise consolidate {half.name} {half.stem}.full.ckpt", command
    result = subprocess.run([sys.executable, *command.split()[1:]], cwd=root, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith(f"wrote {half.stem}.full.ckpt"), result.stdout
    full = root / f"{half.stem}.full.ckpt"
    resumed = run_distributed(_fit_worker, WORLD, str(tmp_path / "ddp2"), "ddp", 2 * STEPS_PER_EPOCH, str(full))
    for rank, params in enumerate(resumed):
        assert_params_equal(params, trained, f"consolidated -> ddp, rank {rank}")


# --- Fabric ---------------------------------------------------------------------------------------------------------


def _fabric_worker(rank, world, strategy, path, save: bool):
    from lightning.fabric import Fabric

    from helpers import gpt, gpt_batches as batches, gpt_loss, gpt_optimizer as optimizer, snapshot

    import lightning_layerwise as llw

    fabric = Fabric(accelerator="cpu", devices=world, strategy=(
        llw.LayerwiseFabricStrategy(checkpoint_format="sharded") if strategy == "layerwise-sharded" else strategy))
    fabric.launch()
    model = gpt(seed=rank)
    model, opt = fabric.setup(model, optimizer("adamw", model))
    state = {"model": model, "optimizer": opt, "step": 0}
    if not save:
        fabric.load(path, state)
    for tokens in batches()[state["step"]:(5 if save else None)]:
        opt.zero_grad()
        fabric.backward(gpt_loss(model, tokens.chunk(world)[rank]))
        opt.step()
        state["step"] += 1
    if save:
        fabric.save(path, state)
    params = snapshot(getattr(model, "module", model))
    if strategy.startswith("layerwise"):
        fabric.strategy.teardown()
    return params


@pytest.mark.slow
@pytest.mark.parametrize("saver, loader", [("layerwise", "ddp"), ("ddp", "layerwise"), ("layerwise-sharded", "ddp")])
def test_fabric_default_checkpoints_move_to_and_from_ddp(tmp_path, saver, loader):
    """``layerwise-sharded``: a directory, consolidated into the file ``Fabric(strategy="ddp")`` loads."""
    path = str(tmp_path / "fabric.ckpt")
    run_distributed(_fabric_worker, WORLD, saver, path, True)
    if saver == "layerwise-sharded":
        subprocess.run([sys.executable, "-m", "lightning_layerwise", "consolidate", path, path + ".full"], check=True,
                       capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert set(torch.load(path + ".full", weights_only=True)) == {"model", "optimizer", "step"}
        path += ".full"
    assert os.path.isfile(path), "the default writes one file for a small model"
    want = gpt_reference("adamw")
    for rank, params in enumerate(run_distributed(_fabric_worker, WORLD, loader, path, False)):
        assert_params_equal(params, want, f"fabric {saver} -> {loader}, rank {rank}")


# --- the conversion command -------------------------------------------------------------------------------------


def test_consolidate_makes_the_file_the_full_format_writes(tmp_path):
    """One process, a plain loop's session: the consolidated directory equals the full file, key for key."""
    import lightning_layerwise as llw

    def run(fmt: str, path: Path) -> None:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        session = llw.LayerwiseSession(llw.LayerwiseConfig(checkpoint_format=fmt))
        wrapped = session.wrap(model, opt)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            opt.zero_grad()
            session.backward(wrapped(torch.randn(4, 6, generator=g)).square().mean())
            session.step(opt)
        session.save_checkpoint(path, step=3)
        session.release()

    run("sharded", tmp_path / "dir.ckpt")
    run("full", tmp_path / "file.ckpt")
    assert "consolidate dir.ckpt dir.full.ckpt" in (tmp_path / "dir.ckpt" / "README.txt").read_text()
    result = subprocess.run([sys.executable, "-m", "lightning_layerwise", "consolidate", "dir.ckpt", "dir.full.ckpt"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("wrote dir.full.ckpt"), result.stdout
    got = torch.load(tmp_path / "dir.full.ckpt", weights_only=True)
    want = torch.load(tmp_path / "file.ckpt", weights_only=True)
    assert sorted(got) == sorted(want) == ["optimizer_states", "state_dict", "step"]
    assert got["step"] == 3
    for name, value in want["state_dict"].items():
        assert torch.equal(got["state_dict"][name], value), name
    (g_state,), (w_state,) = got["optimizer_states"], want["optimizer_states"]
    assert g_state["param_groups"] == w_state["param_groups"]
    for name, entry in w_state["state"].items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(g_state["state"][name][key]), torch.as_tensor(value)), (name, key)


def test_consolidate_refuses_a_file_and_names_what_it_needs(tmp_path):
    (tmp_path / "x.ckpt").write_bytes(b"")
    result = subprocess.run([sys.executable, "-m", "lightning_layerwise", "consolidate", "x.ckpt", "y.ckpt"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 2
    assert result.stderr.rstrip().endswith("error: 'x.ckpt' is not a directory; a sharded checkpoint is one (a file "
                                           "needs no conversion)."), result.stderr
