"""Models that initialize themselves in the ways users' models do, for the meta-device tests.

``NanoGPT``: nanoGPT's ``model.py`` style: ``self.apply(self._init_weights)`` at the end of ``__init__``, then
the residual projections re-initialized by parameter name, the token embedding tied to the output layer.
``InitZoo``: every ``torch.nn.init`` function, including those that skip meta tensors (``trunc_normal_``,
``orthogonal_``, ``dirac_``, ``sparse_``), buffers from ``torch.tensor`` and from arithmetic (rotary
frequencies), a parameter made by ``torch.randn * 0.1``, re-seeding with the same seed twice, a discarded
module, BatchNorm, MultiheadAttention and an embedding with a padding index. ``llama()``: Hugging Face's
``LlamaForCausalLM`` at a tiny size (``post_init`` initializes it; the ``transformers`` package is needed).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 48
SEQ = 8


class NanoBlock(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.attn_proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        q, k, v = self.c_attn(self.ln_1(x)).split(x.size(-1), dim=-1)
        x = x + self.attn_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    def __init__(self, n_layer: int = 2, n_embd: int = 32) -> None:
        super().__init__()
        self.n_layer = n_layer
        self.wte = nn.Embedding(VOCAB, n_embd)
        self.wpe = nn.Embedding(SEQ, n_embd)
        self.h = nn.ModuleList(NanoBlock(n_embd) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight  # nanoGPT ties this way round
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight") or name.endswith("attn_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class InitZoo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunc = nn.Linear(8, 8)
        nn.init.trunc_normal_(self.trunc.weight, std=0.02)
        self.ortho = nn.Linear(8, 6)
        nn.init.orthogonal_(self.ortho.weight)
        self.conv = nn.Conv1d(4, 4, 3)
        nn.init.dirac_(self.conv.weight)
        self.sparse = nn.Linear(10, 12)
        nn.init.sparse_(self.sparse.weight, 0.3)
        self.xavier = nn.Linear(6, 5)
        nn.init.xavier_normal_(self.xavier.weight)
        nn.init.kaiming_normal_(self.xavier.weight[:3], mode="fan_out")  # a part, over a full value
        self.register_buffer("scale", torch.tensor([1.5, 2.5]))
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)), persistent=False)
        self.emb = nn.Embedding(10, 4, padding_idx=0)
        self.p = nn.Parameter(torch.randn(3, 3) * 0.1)
        self.discarded = nn.Linear(16, 16)
        self.discarded = nn.Linear(2, 2)  # the first one's draws happened in an eager build too
        torch.manual_seed(5)
        self.first = nn.Linear(4, 4)
        torch.manual_seed(5)  # the same seed again: the same values again
        self.second = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.mha = nn.MultiheadAttention(8, 2)


def llama(tie: bool = False) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         tie_word_embeddings=tie)
    return LlamaForCausalLM(config)
