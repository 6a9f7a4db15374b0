"""LightningModule that trains the example GPT (``examples/gpt.py``) as a character-level language model.

The training job ``examples/train.py`` builds it from the command line (its
docstring has the run commands). From Python::

    import lightning as L
    import torch
    from examples.data import CharDataModule
    from examples.module import GPTLightningModule

    dm = CharDataModule()
    model = GPTLightningModule(vocab_size=dm.vocab_size)        # default optimizer: llw.Muon
    model = GPTLightningModule(vocab_size=dm.vocab_size,        # or any torch optimizer
                               optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
    L.Trainer(strategy="layerwise", devices=2, max_steps=500).fit(model, dm)

Note [optimizer injection]
    ``optimizer`` and ``lr_scheduler`` follow LightningCLI's dependency-injection
    pattern (``OptimizerCallable`` / ``LRSchedulerCallable``): the module receives a
    factory and calls it with what to optimise, so the CLI can pick the class and its
    arguments (``--model.optimizer torch.optim.AdamW --model.optimizer.lr 1e-3``).
    The factory is called with *parameter groups*, not ``self.parameters()``: Muon
    needs groups that say which parameters get Muon (``use_muon=True``: the hidden
    matrices) and which get AdamW (embeddings, the tied head, biases, LayerNorm
    gains), and ``lightning_layerwise.muon_param_groups`` makes them. Plain torch
    optimizers take the same groups: they keep unknown keys such as ``use_muon`` in
    ``param_groups`` and ignore them (checked for AdamW and SGD in torch 2.13).

Note [vocab_size]
    The model's vocabulary comes from the data. ``vocab_size > 0`` builds the model
    in ``__init__``; ``vocab_size=0`` (the default) defers it to ``configure_model``,
    which reads ``trainer.datamodule.vocab_size``. LightningCLI instead links
    ``data.vocab_size`` to ``model.vocab_size`` so the model is built in ``__init__``.
    Either way the model exists before the strategy wraps it, and the value is
    written back to ``hparams`` so checkpoints record it.

Note [tensor-parallel module]
    ``tensor_parallel=True`` builds the GPT with its attention rows in head order
    (``GPTConfig(qkv_order="head")``, Note [tensor-parallel attention] in ``gpt.py``)
    and, in ``configure_model``, applies ``parallelize_gpt`` over
    ``self.device_mesh["tensor_parallel"]``: the mesh that
    ``LayerwiseStrategy(tensor_parallel_size=T)`` (or Lightning's
    ``ModelParallelStrategy``) gives the module before ``configure_model``. Without
    such a mesh it raises. The model is parallelized once, however many times
    ``configure_model`` runs. ``split_qkv="heads"`` and ``qk_clip_tau`` work with it
    (per-head blocks and the heads' rows are declared in head order); ``split_qkv="qkv"``,
    three blocks of the ``[q; k; v]`` order, is refused.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor
from torch.optim import Optimizer
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.text import Perplexity

try:  # imported as part of the `examples` package (python -m examples.train, pytest)
    from .gpt import GPT, GPTConfig, parallelize_gpt
except ImportError:  # run as a script, with examples/ itself on sys.path
    from gpt import GPT, GPTConfig, parallelize_gpt

__all__ = ["GPTLightningModule", "default_optimizer"]


def default_optimizer(params: Any) -> Optimizer:
    """``lightning_layerwise.Muon(params, lr=0.02, adamw_lr=3e-3)``: the example's default optimizer.

    Imported here, not at module import, so this module (and models that use another
    optimizer) load even where Muon is unavailable.
    """
    try:
        from lightning_layerwise import Muon
    except ImportError as err:
        raise ImportError(
            "GPTLightningModule: the default optimizer lightning_layerwise.Muon could not be imported"
            f" ({err}); pass another one, e.g. optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), or on"
            " the command line --model.optimizer torch.optim.AdamW."
        ) from err
    return Muon(params, lr=0.02, adamw_lr=3e-3)


class GPTLightningModule(L.LightningModule):
    """Character-level GPT: next-token cross-entropy, with perplexity and accuracy on validation.

    Args:
        vocab_size: Number of token ids. 0 takes it from ``trainer.datamodule.vocab_size`` in
            ``configure_model``; see Note [vocab_size].
        n_layer: Transformer blocks.
        n_head: Attention heads; must divide ``n_embd``.
        n_embd: Width of the residual stream.
        block_size: Longest sequence the model accepts; the data's ``block_size`` must not exceed it.
        dropout: Dropout probability in ``[0, 1)``.
        bias: Biases in Linear and LayerNorm layers.
        split_qkv: How Muon sees each fused QKV weight: ``"none"`` (one matrix), ``"qkv"``
            (three) or ``"heads"`` (per head); see docs/muon.md.
        qk_clip_tau: QK-clip's logit bound (``lightning_layerwise.QKClip``, Kimi K2 used 100);
            ``None``: off. The attention then records its largest logit per head.
        tensor_parallel: Split the attention and MLP over the strategy's tensor-parallel ranks
            (``LayerwiseStrategy(tensor_parallel_size=...)``); see Note [tensor-parallel module].
        optimizer: Factory called with the parameter groups; see Note [optimizer injection].
        lr_scheduler: Optional factory called with the optimizer; it is stepped every
            optimizer step (``interval="step"``).
    """

    def __init__(
        self,
        vocab_size: int = 0,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        block_size: int = 128,
        dropout: float = 0.0,
        bias: bool = True,
        split_qkv: str = "none",
        qk_clip_tau: float | None = None,
        tensor_parallel: bool = False,
        optimizer: OptimizerCallable = default_optimizer,
        lr_scheduler: LRSchedulerCallable | None = None,
    ) -> None:
        super().__init__()
        if vocab_size < 0:
            raise ValueError(
                f"GPTLightningModule: `vocab_size` must be >= 0, got {vocab_size}; pass the data's"
                f" vocabulary size, or 0 to read it from the datamodule."
            )
        if tensor_parallel and split_qkv == "qkv":
            raise ValueError(
                "GPTLightningModule: tensor_parallel=True stacks each c_attn head by head, so split_qkv='qkv'"
                " (three blocks of the [q; k; v] order) does not fit it; pass split_qkv='heads' (per-head"
                " blocks) or 'none'."
            )
        # The factories are code, not hyperparameters: a CLI-built callable need not
        # pickle, and the CLI saves its own config next to the checkpoints anyway.
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler"])
        self.optimizer_factory = optimizer
        self.lr_scheduler_factory = lr_scheduler
        self.model: GPT | None = None
        self._parallelized = False
        if vocab_size > 0:
            self._build(vocab_size)
        else:
            # Fail now on a bad shape rather than at configure_model time.
            GPTConfig(vocab_size=1, **self._shape())

    def _shape(self) -> dict[str, Any]:
        h = self.hparams
        return dict(
            block_size=h.block_size, n_layer=h.n_layer, n_head=h.n_head, n_embd=h.n_embd,
            dropout=h.dropout, bias=h.bias, split_qkv=h.get("split_qkv", "none"),
            qk_clip=h.get("qk_clip_tau") is not None,
            qkv_order="head" if h.get("tensor_parallel", False) else "qkv",
        )

    def _build(self, vocab_size: int) -> None:
        self.hparams.vocab_size = vocab_size
        self.model = GPT(GPTConfig(vocab_size=vocab_size, **self._shape()))
        # Token-level metrics: micro accuracy = fraction of characters predicted right
        # (macro would weight rare characters like common ones). Separate objects per
        # stage because torchmetrics accumulate state until compute/reset.
        self.train_acc = MulticlassAccuracy(num_classes=vocab_size, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=vocab_size, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=vocab_size, average="micro")
        self.val_ppl = Perplexity()
        self.test_ppl = Perplexity()

    def configure_model(self) -> None:
        if self.model is None:  # else built in __init__, or by an earlier fit/validate call
            self._build_from_datamodule()
        if self.hparams.get("tensor_parallel", False) and not self._parallelized:
            self._parallelize()

    def _build_from_datamodule(self) -> None:
        datamodule = self.trainer.datamodule if self._trainer is not None else None
        vocab_size = getattr(datamodule, "vocab_size", 0)
        if not vocab_size:
            raise ValueError(
                "GPTLightningModule: `vocab_size` is 0 and the trainer has no datamodule with a"
                " `vocab_size`; pass vocab_size=<the data's vocabulary size>, or a datamodule such as"
                " examples.data.CharDataModule to trainer.fit(model, datamodule=...)."
            )
        self._build(int(vocab_size))

    def _parallelize(self) -> None:
        """Note [tensor-parallel module]."""
        mesh = self._device_mesh_or_none()
        if mesh is None and self._trainer is None:
            # No strategy (load_from_checkpoint, plain use): the same model, whole on this process. Its fused rows
            # stay in head order (qkv_order="head"), as the checkpoint's are.
            return
        if mesh is None or "tensor_parallel" not in (mesh.mesh_dim_names or ()):
            raise ValueError(
                "GPTLightningModule(tensor_parallel=True): the strategy gave the module no device mesh with a"
                " 'tensor_parallel' dimension; train it with strategy=LayerwiseStrategy(tensor_parallel_size=T)"
                " (T dividing n_head and the processes per node), or set tensor_parallel=False."
            )
        parallelize_gpt(self.model, mesh["tensor_parallel"])
        self._parallelized = True

    def _device_mesh_or_none(self) -> Any:
        try:  # LightningModule.device_mesh; older Lightning versions have no such attribute
            return self.device_mesh
        except AttributeError:
            return None

    def on_fit_start(self) -> None:
        # A `trainer.validate()` before `fit` resets the metrics inside inference mode,
        # which makes their states inference tensors; fit validates under no_grad, where
        # updating those in place raises. Resetting here, outside inference mode, gives
        # them ordinary tensors again.
        for metric in (self.train_acc, self.val_acc, self.test_acc, self.val_ppl, self.test_ppl):
            metric.reset()

    def param_groups_for_optimizer(self) -> list[dict[str, Any]]:
        """Parameter groups for the optimizer factory; see Note [optimizer injection]."""
        try:
            from lightning_layerwise import muon_param_groups
        except ImportError:
            # Without Muon, only plain torch optimizers can be in use: one group will do.
            return [{"params": list(self.model.parameters())}]
        return muon_param_groups(self.model)

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(self.param_groups_for_optimizer())
        if self.hparams.get("qk_clip_tau") is not None:
            from lightning_layerwise import QKClip

            # After every optimizer step, on the ranks that step the query and key rows (docs/muon.md).
            self.qk_clip = QKClip(self.model, tau=self.hparams.qk_clip_tau).attach(optimizer)
        if self.lr_scheduler_factory is None:
            return optimizer
        scheduler = self.lr_scheduler_factory(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        return self.model(idx, targets)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits, loss = self.model(x, y)
        # sync_dist: the logged curve is the loss of the global batch, comparable with
        # a one-process run of the same global batch (one scalar all-reduce per step).
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        # Logits (B, T, V) -> (B, V, T): torchmetrics wants the class dimension second.
        self.train_acc(logits.detach().transpose(1, 2), y)
        self.log("train_acc", self.train_acc)
        return loss

    def _evaluate(self, batch: tuple[Tensor, Tensor], stage: str) -> Tensor:
        x, y = batch
        logits, loss = self.model(x, y)
        acc, ppl = getattr(self, f"{stage}_acc"), getattr(self, f"{stage}_ppl")
        acc.update(logits.transpose(1, 2), y)
        ppl.update(logits, y)
        self.log(f"{stage}_loss", loss, prog_bar=stage == "val", sync_dist=True)
        # Metric objects sync their own state across processes at compute().
        self.log(f"{stage}_acc", acc)
        self.log(f"{stage}_ppl", ppl)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self._evaluate(batch, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self._evaluate(batch, "test")

    def predict_step(self, batch: tuple[Tensor, Tensor] | Tensor, batch_idx: int) -> Tensor:
        """The most likely next token at every position, ``(B, T)``."""
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        logits, _ = self.model(x)
        return logits.argmax(dim=-1)
