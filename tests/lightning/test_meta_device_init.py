"""``trainer.init_module(empty_init=True)`` with ``LayerwiseStrategy(shard_parameters=True)``: the run starts from
the values an eager build with the same seed gives, bitwise, or is refused before its first step.

Each rank seeds its own generator (rank + 7) and builds the model on the meta device; the strategy records the
build and replays it (Note [meta-device models] in ``engine/materialize.py``). At ``on_train_start`` every
rank gathers the model (``llw.full_parameters``) and its state dict and buffers must equal, bitwise, the model built eagerly
in one process after ``torch.manual_seed(7)`` (rank 0's seed: every replica holds rank 0's values). Models: the
example GPT's LightningModule (``examples/module.py``, with its metrics), a nanoGPT-style model
(``apply(self._init_weights)`` plus the residual projections re-initialized by name, tied embedding) at 2 and 3
ranks, and Hugging Face's ``LlamaForCausalLM`` (``post_init``). A model whose init cannot be reproduced fails
``fit`` on every rank with the strategy's error naming it, before any step: not with Lightning's teardown error.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_layerwise as llw
from _dist import run_distributed
from _init_styles import SEQ, VOCAB, NanoGPT, llama
from helpers import RMSNorm

SEED = 7


class LanguageModel(L.LightningModule):
    """A LightningModule around a model from ``_init_styles.py`` (built in its ``__init__``)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.net = {"nanogpt": NanoGPT, "llama": llama, "unsupported": Unsupported}[name]()

    def forward(self, x):
        out = self.net(x)
        return getattr(out, "logits", out)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Unsupported(nn.Module):
    """An embedding whose values come from ``torch.poisson`` (draws that depend on the rates)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.norm = RMSNorm(16)
        self.head = nn.Linear(16, VOCAB)
        with torch.no_grad():
            self.emb.weight.copy_(torch.poisson(torch.full((VOCAB, 16), 2.0)) / 10)

    def forward(self, x):
        return self.head(self.norm(self.emb(x)))


def build(name: str) -> L.LightningModule:
    if name == "example_gpt":
        from examples.module import GPTLightningModule

        return GPTLightningModule(vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=32, block_size=SEQ,
                                  optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
    return LanguageModel(name)


class StartProbe(L.Callback):
    """The model as training starts, gathered; whether a training batch ever started."""

    def __init__(self) -> None:
        self.values, self.stepped = None, False

    def on_train_start(self, trainer, pl_module):
        with llw.full_parameters(pl_module):
            self.values = values(pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.stepped = True


def _start_worker(rank, world, name):
    torch.manual_seed(SEED + rank)  # each rank's own: the values must still be rank 0's
    probe = StartProbe()
    trainer = L.Trainer(accelerator="cpu", devices=world, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[probe],
                        strategy=llw.LayerwiseStrategy(shard_parameters=True, bucket_size=4096))
    with trainer.init_module(empty_init=True):
        model = build(name)
    on_meta = all(p.is_meta for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (4 * world, SEQ), generator=g)
    loader = DataLoader(TensorDataset(x, (x + 1) % VOCAB), batch_size=4)
    try:
        trainer.fit(model, loader)
    except Exception as err:  # noqa: BLE001 - what fit raised on this rank is the result
        return on_meta, None, probe.stepped, f"{type(err).__name__}: {err}"
    return on_meta, probe.values, probe.stepped, None


def values(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict and the buffers it leaves out (``persistent=False``: rotary frequencies)."""
    return {k: v.detach().clone() for k, v in {**model.state_dict(), **dict(model.named_buffers())}.items()}


def eager_start(name: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(SEED)
    return values(build(name))


@pytest.mark.parametrize("name, world", [("example_gpt", 2), ("nanogpt", 2), ("nanogpt", 3), ("llama", 2)])
def test_a_meta_device_build_starts_from_the_eager_values(name, world):
    if name == "llama":
        pytest.importorskip("transformers")
    want = eager_start(name)
    for rank, (on_meta, values, stepped, error) in enumerate(run_distributed(_start_worker, world, name)):
        assert on_meta and error is None and stepped, (rank, error)
        assert values.keys() == want.keys()
        differ = [k for k in want if not torch.equal(values[k], want[k])]
        assert not differ, f"rank {rank}: {differ[:5]} differ from the eager build"


def test_an_init_that_cannot_be_reproduced_ends_fit_with_the_strategys_error_on_every_rank():
    """Refused when the strategy wraps the model, before any step, on every rank alike; Lightning's teardown
    leaves the unmaterialized model where it is instead of raising over the refusal."""
    for rank, (on_meta, values, stepped, error) in enumerate(run_distributed(_start_worker, 2, "unsupported")):
        assert on_meta and values is None and not stepped, rank
        assert error.startswith("ValueError: LanguageModel on the meta device cannot start"), (rank, error)
        assert "aten.poisson" in error and "reset_parameters()" in error, error
