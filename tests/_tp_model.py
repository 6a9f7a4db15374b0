"""A small transformer language model with a tensor-parallel plan, as users write one for ``ModelParallelStrategy``.

Attention (q, k, v column-wise, o row-wise with a replicated bias), an MLP (up column-wise, down row-wise),
LayerNorms (replicated), an embedding and an output head (tied or untied, not parallelized, or the untied head
column-wise with a replicated output). The attention reshapes by the local width (``view(B, S, -1, head_dim)``),
so the same code runs whole and with its heads split over the tensor-parallel ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_layerwise import record_attention_logits
from lightning_layerwise.optim.qk_clip import ATTENTION_ATTRIBUTE

VOCAB, WIDTH, HEADS, BLOCKS, SEQ = 64, 32, 4, 2, 12


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.head_dim = d // heads
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d, bias=False)
        self.o = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q, k, v = (m(x).view(B, S, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        if hasattr(self, ATTENTION_ATTRIBUTE):  # declared for QK-clip: under tensor parallelism, this rank's heads
            record_attention_logits(self, q, k, is_causal=True)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, S, -1))


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(d), Attention(d, heads)
        self.norm2, self.mlp = nn.LayerNorm(d), MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, tied: bool = False, vocab: int = VOCAB, d: int = WIDTH, heads: int = HEADS,
                 blocks: int = BLOCKS) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(blocks))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def tp_plan(model: TinyLM, parallel_head: bool = False) -> dict:
    """The ``parallelize_module`` plan: attention and MLP projections column- then row-wise; with
    ``parallel_head`` (untied only) the head column-wise, its output gathered."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(len(model.blocks)):
        for name in ("q", "k", "v"):
            plan[f"blocks.{i}.attn.{name}"] = ColwiseParallel()
        plan[f"blocks.{i}.attn.o"] = RowwiseParallel()
        plan[f"blocks.{i}.mlp.up"] = ColwiseParallel()
        plan[f"blocks.{i}.mlp.down"] = RowwiseParallel()
    if parallel_head:
        plan["head"] = ColwiseParallel(output_layouts=Replicate())
    return plan


def parallelize(model: TinyLM, tp_mesh, parallel_head: bool = False) -> TinyLM:
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(model, tp_mesh, tp_plan(model, parallel_head))


def batches(steps: int, batch: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g) for _ in range(steps)]


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter by name as a full tensor (collective over the tensor-parallel group where a module's
    attribute reads as a DTensor)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, _ in model.named_parameters():
        owner, _, attr = name.rpartition(".")
        value = getattr(model.get_submodule(owner), attr)
        out[name] = (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
    return out
