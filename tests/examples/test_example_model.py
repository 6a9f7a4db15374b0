"""Tests of the example GPT, its character data module and its LightningModule (single process only).

Run: python -m pytest tests/examples/test_example_model.py -q
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch

from examples.data import CharDataModule, CharWindowDataset, load_stdlib_text
from examples.gpt import GPT, GPTConfig
from examples.module import GPTLightningModule

TINY = dict(n_layer=2, n_head=2, n_embd=16, block_size=16)
TEXT = "".join(f"def f{i % 7}(x):\n    return x * {i % 5} + {i % 3}\n" for i in range(200))


def adamw(lr: float = 1e-2):
    return lambda params: torch.optim.AdamW(params, lr=lr)


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT, encoding="utf-8")
    return str(path)


# --------------------------------------------------------------------- model


def test_gpt_shapes_and_initial_loss():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, **TINY))
    idx, targets = torch.randint(0, 11, (2, 3, 16))
    logits, loss = model(idx, targets)
    assert logits.shape == (3, 16, 11)
    # Small init: near-uniform predictions, so the loss starts near ln(vocab).
    assert abs(loss.item() - math.log(11)) < 0.1
    logits, loss = model(idx[:, :5])
    assert logits.shape == (3, 5, 11) and loss is None


def test_gpt_names_tied_weight_and_init():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, n_layer=3, n_head=2, n_embd=64, block_size=16))
    assert model.lm_head.weight is model.transformer.wte.weight
    names = dict(model.named_parameters())
    assert "lm_head.weight" not in names  # deduplicated: the tied tensor is listed once, as wte
    for suffix in ("ln_1.weight", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                   "ln_2.bias", "mlp.c_fc.weight", "mlp.c_proj.bias"):
        assert f"transformer.h.2.{suffix}" in names
    assert {"transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight"} <= names.keys()
    assert model.num_parameters(non_embedding=False) == sum(p.numel() for p in names.values())
    # GPT-2 init: 0.02 everywhere, residual output projections scaled by 1/sqrt(2 n_layer).
    assert names["transformer.h.0.mlp.c_fc.weight"].std().item() == pytest.approx(0.02, rel=0.1)
    assert names["transformer.h.0.mlp.c_proj.weight"].std().item() == pytest.approx(0.02 / math.sqrt(6), rel=0.1)
    assert torch.all(names["transformer.h.0.attn.c_attn.bias"] == 0)


def test_gpt_deterministic_and_causal():
    torch.manual_seed(3)
    a = GPT(GPTConfig(vocab_size=11, **TINY))
    torch.manual_seed(3)
    b = GPT(GPTConfig(vocab_size=11, **TINY))
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb)
    idx = torch.randint(0, 11, (2, 10))
    changed = idx.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % 11
    # Causality: changing tokens 6.. leaves the logits of positions 0..5 unchanged.
    torch.testing.assert_close(a(idx)[0][:, :6], a(changed)[0][:, :6])
    assert not torch.allclose(a(idx)[0][:, 6:], a(changed)[0][:, 6:])


def test_gpt_loss_decreases_with_adamw():
    dm = CharDataModule(text_path=None, max_chars=20_000, block_size=16, batch_size=16)
    dm.setup("fit")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=dm.vocab_size, **TINY))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in _take(dm.train_dataloader(), 30):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.75 * sum(losses[:5]) / 5, losses


def test_gpt_generate():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, **TINY)).eval()
    prompt = torch.randint(0, 11, (2, 12))
    out = model.generate(prompt, max_new_tokens=10, temperature=0.8, top_k=3)  # crosses block_size=16
    assert out.shape == (2, 22) and torch.equal(out[:, :12], prompt)
    assert int(out.min()) >= 0 and int(out.max()) < 11
    greedy = model.generate(prompt, max_new_tokens=3, top_k=1)
    assert torch.equal(greedy, model.generate(prompt, max_new_tokens=3, top_k=1))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n_embd=30, n_head=4), "divisible by `n_head`"),
        (dict(n_layer=0), "`n_layer` must be a positive int"),
        (dict(vocab_size=0), "`vocab_size` must be a positive int"),
        (dict(dropout=1.0), "`dropout` must be in"),
    ],
)
def test_gpt_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)


def test_gpt_input_errors():
    model = GPT(GPTConfig(vocab_size=11, **TINY))
    with pytest.raises(ValueError, match="exceeds block_size 16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        model.generate(torch.zeros(1, 1, dtype=torch.long), 2, temperature=0.0)


# ---------------------------------------------------------------------- data


def _take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def test_datamodule_vocab_splits_and_windows(text_file):
    dm = CharDataModule(text_path=text_file, block_size=8, batch_size=4, val_fraction=0.1, val_windows=20)
    assert dm.chars == "".join(sorted(set(TEXT)))
    assert dm.vocab_size == len(set(TEXT))
    assert dm.decode(dm.encode("def f1(x):")) == "def f1(x):"
    dm.setup("fit")
    n_val = int(len(TEXT) * 0.1)
    assert dm.train_tokens.dtype == torch.uint8
    assert dm.decode(dm.train_tokens) == TEXT[: len(TEXT) - n_val]
    assert dm.decode(dm.val_tokens) == TEXT[len(TEXT) - n_val :]
    assert len(dm.train_set) == len(TEXT) - n_val - 8
    x, y = dm.train_set[5]
    assert x.dtype == torch.long and x.shape == y.shape == (8,)
    assert dm.decode(x) == TEXT[5:13] and dm.decode(y) == TEXT[6:14]
    # Validation: val_windows fixed windows, evenly spaced from the start to the end of the tail.
    starts = dm.val_set.starts
    assert len(dm.val_set) == 20 and starts[0] == 0 and starts[-1] == n_val - 9
    assert (starts.diff() - (n_val - 9) / 19).abs().max() <= 1
    x, y = dm.val_set[19]
    assert dm.decode(torch.cat([x, y[-1:]])) == TEXT[-9:]
    xb, yb = next(iter(dm.train_dataloader()))
    assert xb.shape == yb.shape == (4, 8) and torch.equal(xb[:, 1:], yb[:, :-1])


@pytest.mark.parametrize("shuffle", [True, False])
def test_datamodule_deterministic_order(text_file, shuffle):
    def batches(seed):
        dm = CharDataModule(text_path=text_file, block_size=8, batch_size=4, shuffle=shuffle, seed=seed)
        dm.setup("fit")
        return torch.cat([x for x, _ in _take(dm.train_dataloader(), 3)])

    assert torch.equal(batches(1), batches(1))
    assert not torch.equal(batches(1), batches(2))
    first = batches(1)
    assert not torch.equal(first[:4], first[4:8])  # random windows, not consecutive starts


def test_unshuffled_order_is_the_same_for_any_world_size(text_file):
    # Note [windows and samplers]: with shuffle=False, global step k of 2 ranks with batch 4
    # (Lightning's DistributedSampler(shuffle=False)) holds the windows of step k of one
    # process with batch 8.
    from torch.utils.data import DataLoader, DistributedSampler

    dm = CharDataModule(text_path=text_file, block_size=8, batch_size=8, shuffle=False)
    dm.setup("fit")
    single = _take(dm.train_dataloader(), 3)
    ranks = [
        _take(DataLoader(dm.train_set, batch_size=4, drop_last=True,
                         sampler=DistributedSampler(dm.train_set, num_replicas=2, rank=r, shuffle=False)), 3)
        for r in range(2)
    ]
    for k in range(3):
        split = torch.cat([ranks[0][k][0], ranks[1][k][0]])
        assert sorted(map(tuple, split.tolist())) == sorted(map(tuple, single[k][0].tolist()))


def test_stdlib_corpus_is_deterministic():
    a = load_stdlib_text(max_chars=5_000)
    assert len(a) == 5_000 and a == load_stdlib_text(max_chars=5_000)
    dm = CharDataModule(max_chars=5_000, block_size=16)
    assert dm.vocab_size == len(set(a))


def test_datamodule_errors(tmp_path, text_file):
    with pytest.raises(ValueError, match="`text_path` .*missing.txt.* is not a file"):
        CharDataModule(text_path=str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match="`block_size` must be >= 1, got 0"):
        CharDataModule(text_path=text_file, block_size=0)
    with pytest.raises(ValueError, match="`val_fraction` must be in"):
        CharDataModule(text_path=text_file, val_fraction=0.0)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="is empty"):
        CharDataModule(text_path=str(empty)).vocab_size
    with pytest.raises(ValueError, match="each split needs at least"):
        CharDataModule(text_path=text_file, max_chars=300, block_size=64).setup("fit")
    with pytest.raises(ValueError, match="not in the corpus vocabulary"):
        CharDataModule(text_path=text_file).encode("Z")
    with pytest.raises(ValueError, match="at least block_size"):
        CharWindowDataset(torch.zeros(4, dtype=torch.uint8), block_size=4)


# -------------------------------------------------------------------- module


def _trainer(**kwargs):
    defaults = dict(
        accelerator="cpu", devices=1, max_steps=5, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=2, num_sanity_val_steps=0,
    )
    return L.Trainer(**{**defaults, **kwargs})


def test_module_fit_validate_predict(text_file):
    L.seed_everything(0)
    dm = CharDataModule(text_path=text_file, block_size=16, batch_size=8, val_windows=16)
    model = GPTLightningModule(vocab_size=dm.vocab_size, optimizer=adamw(), **TINY)
    trainer = _trainer(num_sanity_val_steps=1)
    # validate before fit (a baseline loss): the metrics must survive the switch from
    # inference mode to fit's no_grad validation.
    (before,) = trainer.validate(model, datamodule=dm, verbose=False)
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 5
    assert {"train_loss", "train_acc"} <= trainer.callback_metrics.keys()
    (metrics,) = trainer.validate(model, datamodule=dm, verbose=False)
    assert {"val_loss", "val_acc", "val_ppl"} <= metrics.keys()
    # Perplexity is exp(mean token cross-entropy); val_loss averages the same tokens per batch.
    assert metrics["val_ppl"] == pytest.approx(math.exp(metrics["val_loss"]), rel=1e-3)
    assert 0.0 <= metrics["val_acc"] <= 1.0
    assert metrics["val_loss"] < before["val_loss"]
    (test_metrics,) = trainer.test(model, datamodule=dm, verbose=False)
    assert test_metrics["test_loss"] == pytest.approx(metrics["val_loss"], rel=1e-5)
    predictions = trainer.predict(model, datamodule=dm)
    assert predictions[0].shape == (8, 16) and predictions[0].dtype == torch.long


def test_module_vocab_from_datamodule_and_scheduler(text_file, tmp_path):
    dm = CharDataModule(text_path=text_file, block_size=16, batch_size=8, val_windows=8)
    model = GPTLightningModule(
        optimizer=adamw(1e-3),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1)),
        **TINY,
    )
    assert model.model is None  # vocab_size=0: built in configure_model from the datamodule
    trainer = _trainer(max_steps=3)
    trainer.fit(model, datamodule=dm)
    assert model.model.config.vocab_size == dm.vocab_size == model.hparams.vocab_size
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-3 / 4)  # stepped per step
    # The vocabulary size found at fit time is in the checkpoint's hyperparameters.
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    loaded = GPTLightningModule.load_from_checkpoint(tmp_path / "last.ckpt", optimizer=adamw())
    assert loaded.model.config.vocab_size == dm.vocab_size
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name


def test_module_param_groups_cover_every_parameter_once():
    model = GPTLightningModule(vocab_size=11, optimizer=adamw(), **TINY)
    groups = model.param_groups_for_optimizer()
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.model.parameters()))
    # Plain torch optimizers accept the groups, extra keys such as use_muon included.
    opt = model.configure_optimizers()
    assert isinstance(opt, torch.optim.AdamW) and len(opt.param_groups) == len(groups)


def test_module_default_optimizer_is_muon():
    import lightning_layerwise as llw

    model = GPTLightningModule(vocab_size=11, **TINY)
    opt = model.configure_optimizers()
    assert isinstance(opt, llw.Muon)
    by_muon = {g["use_muon"]: g for g in opt.param_groups}
    # Embeddings and the tied head go to AdamW; hidden matrices to Muon.
    assert any(p is model.model.transformer.wte.weight for p in by_muon[False]["params"])
    assert any(p is model.model.transformer.h[0].attn.c_attn.weight for p in by_muon[True]["params"])


def test_module_errors():
    with pytest.raises(ValueError, match="`vocab_size` must be >= 0"):
        GPTLightningModule(vocab_size=-1)
    with pytest.raises(ValueError, match="divisible by `n_head`"):
        GPTLightningModule(n_embd=30, n_head=4)
    model = GPTLightningModule(optimizer=adamw(), **TINY)
    with pytest.raises(ValueError, match="no datamodule with a `vocab_size`"):
        model.configure_model()


def test_muon_family_settings_come_back_from_a_checkpoint(text_file, tmp_path):
    """``split_qkv`` and ``qk_clip_tau`` are hyperparameters: a checkpoint brings them back, and with them the
    per-head groups and the QK-clip bound (whatever the world size: they are not per rank)."""
    import lightning_layerwise as llw

    dm = CharDataModule(text_path=text_file, block_size=16, batch_size=8, val_windows=8)
    model = GPTLightningModule(vocab_size=dm.vocab_size, split_qkv="heads", qk_clip_tau=50.0,
                               optimizer=lambda groups: llw.Muon(groups, normuon=True, lr=0.01), **TINY)
    trainer = _trainer(max_steps=2)
    trainer.fit(model, datamodule=dm)
    assert model.qk_clip.tau == 50.0 and model.qk_clip.last_max_logits is not None
    trainer.save_checkpoint(tmp_path / "family.ckpt")
    loaded = GPTLightningModule.load_from_checkpoint(tmp_path / "family.ckpt",
                                                     optimizer=lambda groups: llw.Muon(groups, normuon=True))
    assert loaded.hparams.qk_clip_tau == 50.0 and loaded.hparams.split_qkv == "heads"
    optimizer = loaded.configure_optimizers()
    assert loaded.qk_clip.tau == 50.0
    heads = TINY["n_head"]
    assert any(g.get("split") == 3 * heads for g in optimizer.param_groups if g["use_muon"])
