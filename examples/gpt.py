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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import lightning_layerwise as llw

__all__ = ["GPT", "GPTConfig", "example_gpt"]


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


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        # One matrix for q, k and v: a single GEMM, and nanoGPT's parameter names.
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        if config.split_qkv != "none":
            llw.mark_matrices(self.c_attn, "weight", split=3 if config.split_qkv == "qkv" else 3 * config.n_head)
        self.record_logits = config.qk_clip
        if config.qk_clip:  # queries are rows [0, C) of c_attn, keys rows [C, 2C): n_head heads of C / n_head
            llw.mark_attention(self, n_heads=config.n_head, head_dim=config.n_embd // config.n_head,
                               q="c_attn.weight", k="c_attn.weight", k_offset=config.n_embd)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim), the layout SDPA expects.
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.record_logits:
            llw.record_attention_logits(self, q, k, is_causal=True)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
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


def example_gpt() -> GPT:
    """The example run's model (vocabulary of the standard-library corpus: 96 characters)."""
    torch.manual_seed(0)
    return GPT(GPTConfig())
