"""A small GPT (decoder-only transformer) in the style of nanoGPT, for the examples.

Not a library model: it exists so the examples and tests have a realistic
network to train with ``Trainer(strategy="layerwise")``. It has the pieces that
stress a layer-wise distributed optimizer: a weight tied between the first and
the last module (``lm_head.weight is transformer.wte.weight``), matrices for Muon,
and vectors (biases, LayerNorm gains) that Muon hands to AdamW.

The training job that uses it is ``examples/train.py`` (its docstring has the
run commands). Use the model directly::

    import torch
    from examples.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=96, block_size=128, n_layer=4, n_head=4, n_embd=128))
    logits, loss = model(idx, targets)                   # idx, targets: (B, T) int64
    out = model.generate(idx[:, :8], max_new_tokens=32)  # (B, 8 + 32)

Module names follow nanoGPT's ``model.py`` (``transformer.h.0.attn.c_attn``...), so
its checkpoints' key names and its parameter-group recipes carry over.

Note [tensor-parallel attention]
    Tensor parallelism splits each attention projection over the ``T`` ranks of a tensor-parallel group,
    column-wise (``ColwiseParallel``: a contiguous block of output rows per rank). nanoGPT's fused ``c_attn``
    stacks its rows as ``[q; k; v]``, so a contiguous split would give rank 0 all of q and part of k: not
    whole heads. With ``qkv_order="head"`` the same fused matrix stacks its rows head by head,
    ``[q_0; k_0; v_0; q_1; k_1; v_1; ...]`` (``head_dim`` rows each), so any ``T`` dividing ``n_head`` gives
    every rank the q, k and v of ``n_head / T`` whole heads, and the attention, which reshapes by its local
    width, computes with those. It stays one matrix and one GEMM under nanoGPT's name. The head order is a
    permutation of the rows of the ``[q; k; v]`` order (:func:`head_grouped_rows`), applied at init, so a
    model built from the same seed in either order is the same function, and Muon's step is the same too
    (Newton-Schulz commutes with a permutation of rows; AdamW is element-wise). :func:`parallelize_gpt`
    applies the plan; the output projection ``c_proj`` is row-wise, and the MLP column- then row-wise.
    Dropout on the replicated activations (embeddings, residual branches) must draw the same mask on every rank
    of a group, which it does where the ranks share a seed and draw in the same order (``seed_everything``, as
    Lightning's ranks do); the example configs train with ``dropout=0``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import lightning_layerwise as llw

__all__ = ["GPT", "GPTConfig", "example_gpt", "head_grouped_rows", "parallelize_gpt", "tensor_parallel_plan"]


@dataclass
class GPTConfig:
    """Shape of a :class:`GPT`. Defaults are the example run's model (about 0.8 M parameters)."""

    vocab_size: int = 96
    """Number of token ids; ids must lie in ``[0, vocab_size)``."""
    block_size: int = 128
    """Longest sequence the model accepts (the number of learned positions)."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int = 128
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout probability in ``[0, 1)`` on embeddings, attention and residual branches."""
    bias: bool = True
    """Whether Linear and LayerNorm layers have biases (nanoGPT's GPT-2 setting is True)."""
    split_qkv: str = "none"
    """How Muon sees each fused ``c_attn`` weight: ``"none"`` one matrix, ``"qkv"`` three (q, k, v), ``"heads"``
    ``3 * n_head`` per-head blocks (``lightning_layerwise.mark_matrices``; Note [matrix views])."""
    qk_clip: bool = False
    """Declare the attention heads and record each forward's largest logit per head, for ``QKClip``."""
    qkv_order: str = "qkv"
    """Order of the rows of each fused ``c_attn``: ``"qkv"`` (nanoGPT's ``[q; k; v]``) or ``"head"`` (head by head,
    ``[q_0; k_0; v_0; q_1; ...]``: what tensor parallelism splits into whole heads; Note [tensor-parallel
    attention])."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig: `{name}` must be a positive int, got {value!r}.")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig: `n_embd` ({self.n_embd}) must be divisible by `n_head` ({self.n_head});"
                f" pick n_head from the divisors of n_embd, e.g. n_head=4 for n_embd=128."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: `dropout` must be in [0, 1), got {self.dropout!r}.")
        if self.split_qkv not in ("none", "qkv", "heads"):
            raise ValueError(f"GPTConfig: `split_qkv` must be 'none', 'qkv' or 'heads', got {self.split_qkv!r}.")
        if self.qkv_order not in ("qkv", "head"):
            raise ValueError(f"GPTConfig: `qkv_order` must be 'qkv' or 'head', got {self.qkv_order!r}.")
        if self.qkv_order == "head" and self.split_qkv == "qkv":
            raise ValueError(
                "GPTConfig: split_qkv='qkv' cuts the rows of c_attn as [q; k; v]; with qkv_order='head' they are"
                " stacked head by head. Use split_qkv='heads' (per-head blocks, right in either order) or"
                " qkv_order='qkv'."
            )


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.qkv_order = config.qkv_order
        self.dropout = config.dropout
        # One matrix for q, k and v: a single GEMM, and nanoGPT's parameter names.
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        if config.split_qkv != "none":
            llw.mark_matrices(self.c_attn, "weight", split=3 if config.split_qkv == "qkv" else 3 * config.n_head)
        self.record_logits = config.qk_clip
        if config.qk_clip and config.qkv_order == "head":  # head h: q rows from 3 h d, k rows from 3 h d + d
            llw.mark_attention(self, n_heads=config.n_head, head_dim=self.head_dim, q="c_attn.weight",
                               k="c_attn.weight", k_offset=self.head_dim, head_stride=3 * self.head_dim)
        elif config.qk_clip:  # queries are rows [0, C) of c_attn, keys rows [C, 2C): n_head heads of C / n_head
            llw.mark_attention(self, n_heads=config.n_head, head_dim=self.head_dim,
                               q="c_attn.weight", k="c_attn.weight", k_offset=config.n_embd)

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        # Heads by the local width: n_head, or n_head / T on each of T tensor-parallel ranks
        # (Note [tensor-parallel attention]).
        qkv = self.c_attn(x)
        if self.qkv_order == "head":
            q, k, v = qkv.view(B, T, -1, 3, self.head_dim).unbind(3)
        else:
            q, k, v = (t.view(B, T, -1, self.head_dim) for t in qkv.split(qkv.size(-1) // 3, dim=2))
        # (B, T, heads, head_dim) -> (B, heads, T, head_dim), the layout SDPA expects.
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.record_logits:
            llw.record_attention_logits(self, q, k, is_causal=True)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer with learned positions and an output layer tied to the input embedding."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        # No bias on the head: its weight is the embedding's, and a bias would be
        # the only parameter of lm_head, an extra tiny tensor for the optimizer.
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying (Press & Wolf 2017), as in GPT-2: one Parameter used by the
        # first and the last module. A distributed optimizer must reduce its two
        # gradient contributions into one owner, which is why the examples keep it.
        self.lm_head.weight = self.transformer.wte.weight

        self.apply(self._init_weights)
        # GPT-2's scaled init: each block adds two residual branches, so their output
        # projections start at std 0.02/sqrt(2 * n_layer) to keep the residual stream's
        # variance independent of depth.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        if config.qkv_order == "head":  # the same draws, rows reordered: the [q; k; v] model's function
            rows = head_grouped_rows(config.n_embd, config.n_head)
            with torch.no_grad():
                for block in self.transformer.h:
                    for p in block.attn.c_attn.parameters():
                        p.copy_(p[rows])

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self, non_embedding: bool = True) -> int:
        """Parameter count, each shared tensor once; ``non_embedding`` leaves out the position
        embedding (the token embedding stays in: it is also the output layer)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Return ``(logits, loss)``: logits ``(B, T, vocab_size)`` for every position, and the mean
        cross-entropy against ``targets`` ``(B, T)`` (entries ``-1`` are ignored), or None."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(
                f"GPT.forward: sequence length {T} exceeds block_size {self.config.block_size};"
                f" crop the input to its last {self.config.block_size} tokens or build the model"
                f" with a larger `block_size`."
            )
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(
        self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None
    ) -> Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` ``(B, T)`` and return ``(B, T + max_new_tokens)``.

        ``temperature`` scales the logits (lower is greedier); ``top_k`` samples only among the
        k most likely tokens. Call ``model.eval()`` first if the model has dropout.
        """
        if max_new_tokens < 0:
            raise ValueError(f"GPT.generate: `max_new_tokens` must be >= 0, got {max_new_tokens}.")
        if temperature <= 0:
            raise ValueError(
                f"GPT.generate: `temperature` must be > 0, got {temperature}; use a small value"
                f" such as 1e-3 or top_k=1 for greedy decoding."
            )
        if top_k is not None and top_k < 1:
            raise ValueError(f"GPT.generate: `top_k` must be None or >= 1, got {top_k}.")
        for _ in range(max_new_tokens):
            # The model has only block_size positions: condition on the most recent ones.
            logits, _ = self(idx[:, -self.config.block_size :])
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits = logits.masked_fill(logits < v[:, [-1]], float("-inf"))
            next_id = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, next_id), dim=1)
        return idx


def head_grouped_rows(n_embd: int, n_head: int) -> Tensor:
    """Row ``r`` of a head-ordered ``c_attn`` is row ``head_grouped_rows(...)[r]`` of the ``[q; k; v]`` one (Note
    [tensor-parallel attention]); ``weight[rows]`` reorders a nanoGPT weight, ``weight[rows.argsort()]`` back."""
    return torch.arange(3 * n_embd).view(3, n_head, n_embd // n_head).transpose(0, 1).reshape(-1)


def tensor_parallel_plan(model: GPT) -> dict[str, Any]:
    """The ``parallelize_module`` plan of Note [tensor-parallel attention]: in every block ``attn.c_attn`` and
    ``mlp.c_fc`` column-wise, ``attn.c_proj`` and ``mlp.c_proj`` row-wise. The embeddings (the tied head),
    LayerNorms and biases of the row-wise layers stay whole on every rank."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for i in range(len(model.transformer.h)):
        plan[f"transformer.h.{i}.attn.c_attn"] = ColwiseParallel()
        plan[f"transformer.h.{i}.attn.c_proj"] = RowwiseParallel()
        plan[f"transformer.h.{i}.mlp.c_fc"] = ColwiseParallel()
        plan[f"transformer.h.{i}.mlp.c_proj"] = RowwiseParallel()
    return plan


def parallelize_gpt(model: GPT, tp_mesh: Any) -> GPT:
    """Applies :func:`tensor_parallel_plan` over the 1-D tensor-parallel ``DeviceMesh`` ``tp_mesh`` (in place)."""
    from torch.distributed.tensor.parallel import parallelize_module

    config, size = model.config, tp_mesh.size()
    if config.qkv_order != "head":
        raise ValueError(
            "parallelize_gpt: the model's c_attn rows are in [q; k; v] order, which a column-wise split"
            " cuts across heads; build it with GPTConfig(qkv_order='head') (Note [tensor-parallel attention])."
        )
    if config.n_head % size:
        raise ValueError(
            f"parallelize_gpt: {size} tensor-parallel ranks must divide n_head ({config.n_head}) so that each"
            f" rank computes whole heads; pick tensor_parallel_size from the divisors of {config.n_head}."
        )
    return parallelize_module(model, tp_mesh, tensor_parallel_plan(model))


def example_gpt() -> GPT:
    """The example run's model (vocabulary of the standard-library corpus: 96 characters)."""
    torch.manual_seed(0)
    return GPT(GPTConfig())
