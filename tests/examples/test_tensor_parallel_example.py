"""The example GPT under tensor parallelism (``GPTLightningModule(tensor_parallel=True)``, Note [tensor-parallel
attention] in ``examples/gpt.py``): a Trainer fit with ``LayerwiseStrategy(tensor_parallel_size=2)`` matches the
same GPT trained without tensor parallelism in one process, the module refuses to run without a mesh, and
``examples/configs/tp_cpu.yaml`` parses.

The reference is the plain GPT (``[q; k; v]`` rows) from the same seed: the head-ordered model is the same
function with the rows of each ``c_attn`` permuted, and the comparison un-permutes them. It trains on the global
batches of the run: Lightning gives each data-parallel rank a ``DistributedSampler`` shuffled with seed 0 (the
ranks of a tensor-parallel group read the same batch), and the global batch of a step is the data-parallel ranks'
batches together. Tolerance: float32, relative 1e-5 per parameter after 4 Muon steps, as in
``tests/engine/test_tensor_parallel.py`` (the runs differ only in the order of float32 sums). Except the key rows
of each ``c_attn.bias``: their gradient is zero in exact arithmetic (adding ``q . b_k`` to every logit of a query
leaves its softmax unchanged), so AdamW steps them on rounding noise (``g / sqrt(v)`` of noise is not small), to
a few 1e-6 in either run; they are held to 1e-4 absolute, against the 1e-2 of the query and value biases.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

import lightning_layerwise as llw
from examples.data import CharDataModule
from examples.gpt import GPT, GPTConfig, head_grouped_rows
from examples.module import GPTLightningModule
from tests._dist import reference_threads, run_distributed
from tests._tp_model import full_state

ROOT = Path(__file__).resolve().parents[2]
SHAPE = dict(n_layer=2, n_head=4, n_embd=32, block_size=16)
STEPS, BATCH, T, RTOL = 4, 4, 2, 1e-5
TEXT = "".join(f"def f{i % 7}(x):\n    return x * {i % 5} + {i % 3}\n" for i in range(200))


TAU = 0.05  # QK-clip's bound in the "views" run: below the first steps' largest logits, so heads are clipped
VARIANTS = {  # per run: the module's options besides the shape
    "plain": {},
    # per-head blocks of the head-ordered c_attn, NorMuon, QK-clip on rows declared head by head
    "views": {"split_qkv": "heads", "qk_clip_tau": TAU},
}


def muon(groups):
    return llw.Muon(groups, lr=0.02, adamw_lr=3e-3, ns_dtype=torch.float32)


def normuon(groups):
    return llw.Muon(groups, lr=0.01, adamw_lr=3e-3, ns_dtype=torch.float32, normuon=True)


def data(path: str) -> CharDataModule:
    return CharDataModule(text_path=path, block_size=SHAPE["block_size"], batch_size=BATCH, val_windows=8)


def _fit_tensor_parallel(rank: int, world: int, path: str, variant: str) -> dict[str, torch.Tensor]:
    os.environ["PL_GLOBAL_SEED"] = "0"  # Lightning's DistributedSampler seed (a test before may have set another)
    dm = data(path)
    torch.manual_seed(0)
    model = GPTLightningModule(vocab_size=dm.vocab_size, tensor_parallel=True,
                               optimizer=normuon if variant == "views" else muon, **VARIANTS[variant], **SHAPE)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=llw.LayerwiseStrategy(tensor_parallel_size=T),
                        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=dm)
    logits = {"qk_clip.last_max_logits": model.qk_clip.last_max_logits} if variant == "views" else {}
    return {**full_state(model.model), **logits}


def reference(path: str, world: int, variant: str) -> dict[str, torch.Tensor]:
    """The plain GPT in one process on the run's global batches, its ``c_attn`` rows put in head order."""
    from torch.utils.data import DistributedSampler

    dm = data(path)
    dm.setup("fit")
    D = world // T
    orders = [list(DistributedSampler(dm.train_set, num_replicas=D, rank=d, shuffle=True, seed=0)) for d in range(D)]
    with reference_threads():
        torch.manual_seed(0)
        views = variant == "views"
        model = GPT(GPTConfig(vocab_size=dm.vocab_size, split_qkv=VARIANTS[variant].get("split_qkv", "none"),
                              qk_clip=views, **SHAPE))
        opt = (normuon if views else muon)(llw.muon_param_groups(model))
        clip = llw.QKClip(model, tau=TAU).attach(opt) if views else None
        clipped = 0
        for step in range(STEPS):
            windows = [dm.train_set[i] for d in range(D) for i in orders[d][BATCH * step: BATCH * (step + 1)]]
            x, y = (torch.stack(t) for t in zip(*windows))
            model(x, y)[1].backward()
            opt.step()
            opt.zero_grad()
            clipped += int(clip.clipped_heads) if views else 0
    assert clipped or not views, "QK-clip rescaled no head: the test would not see it"
    rows = head_grouped_rows(SHAPE["n_embd"], SHAPE["n_head"])
    logits = {"qk_clip.last_max_logits": clip.last_max_logits} if views else {}
    return {**{n: (p[rows] if ".attn.c_attn." in n else p).detach().clone() for n, p in model.named_parameters()},
            **logits}


@pytest.mark.parametrize("world, variant", [(2, "plain"), (4, "views")], ids=["tp2", "dp2xtp2-normuon-heads-qkclip"])
def test_tensor_parallel_example_gpt_matches_one_process(tmp_path, world, variant):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT, encoding="utf-8")
    results = run_distributed(_fit_tensor_parallel, world, str(path), variant)
    want = reference(str(path), world, variant)
    start = GPT(GPTConfig(vocab_size=len(set(TEXT)), qkv_order="head", **SHAPE))
    keys = torch.zeros(SHAPE["n_head"], 3, SHAPE["n_embd"] // SHAPE["n_head"], dtype=torch.bool)
    keys[:, 1] = True  # the key rows of a head-ordered c_attn.bias
    keys = keys.view(-1)
    for rank, got in enumerate(results):
        assert set(got) == set(want)
        for name, value in want.items():
            mine = got[name]
            if name.endswith("attn.c_attn.bias"):
                assert (mine[keys] - value[keys]).abs().max() <= 1e-4, f"rank {rank}: {name}, key rows"
                mine, value = mine[~keys], value[~keys]
            err = ((mine - value).norm() / value.norm()).item()
            assert err <= RTOL, f"rank {rank}: {name} differs by {err:.2e} relative"
            torch.testing.assert_close(got[name], results[0][name], rtol=0, atol=0)
    moved = max(((want[n] - p).norm() / p.norm()).item() for n, p in start.named_parameters() if p.ndim == 2)
    if variant == "views":  # every head's largest logit of the last step, over the world
        assert want["qk_clip.last_max_logits"].numel() == SHAPE["n_head"] * SHAPE["n_layer"]
    assert moved > 1e-2, "training moved the parameters"


def test_head_order_is_the_plain_gpt_with_its_rows_permuted():
    torch.manual_seed(0)
    plain = GPT(GPTConfig(vocab_size=11, **SHAPE))
    torch.manual_seed(0)
    grouped = GPT(GPTConfig(vocab_size=11, qkv_order="head", **SHAPE))
    rows = head_grouped_rows(SHAPE["n_embd"], SHAPE["n_head"])
    torch.testing.assert_close(grouped.transformer.h[1].attn.c_attn.bias, plain.transformer.h[1].attn.c_attn.bias[rows])
    idx = torch.randint(0, 11, (2, SHAPE["block_size"]))
    torch.testing.assert_close(grouped(idx)[0], plain(idx)[0], rtol=0, atol=0)


def test_tensor_parallel_without_a_mesh_is_refused_under_a_trainer_and_whole_without_one():
    model = GPTLightningModule(vocab_size=11, tensor_parallel=True, **SHAPE)
    model.configure_model()  # no strategy (load_from_checkpoint, plain use): the same model, whole
    assert not model._parallelized and model.model.config.qkv_order == "head"
    model._trainer = types.SimpleNamespace()  # a Trainer whose strategy gave the module no mesh
    with pytest.raises(ValueError, match=r"LayerwiseStrategy\(tensor_parallel_size=T\)"):
        model.configure_model()
    with pytest.raises(ValueError, match="pass split_qkv='heads'"):
        GPTLightningModule(vocab_size=11, tensor_parallel=True, split_qkv="qkv", **SHAPE)
    with pytest.raises(ValueError, match="qkv_order='qkv'"):
        GPTConfig(qkv_order="head", split_qkv="qkv")


def test_tp_cpu_config_parses(capsys, monkeypatch):
    from examples.train import main

    monkeypatch.setattr(sys, "argv", ["train.py"])  # the CLI reads args=, not pytest's command line
    config = ROOT / "examples" / "configs" / "tp_cpu.yaml"
    with pytest.raises(SystemExit) as exit:
        main(["fit", "--config", str(config), "--print_config"])
    assert not exit.value.code
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["devices"] == 4 and printed["model"]["tensor_parallel"] is True
    strategy = printed["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_layerwise.LayerwiseStrategy"
    assert strategy["init_args"]["tensor_parallel_size"] == 2
    assert printed["model"]["optimizer"]["class_path"] == "lightning_layerwise.Muon"
