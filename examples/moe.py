"""A mixture-of-experts layer with expert parallelism, and a small MoE GPT, for the examples and tests.

Each rank holds ``num_experts / E`` experts (``E`` = expert-parallel size). Tokens
are routed top-k by a linear router, sent to the rank holding their expert with
``all_to_all`` (differentiable, so the backward sends gradients back), processed,
sent back and combined with their router weights. A Switch-style load-balancing
loss keeps the router from collapsing onto few experts. Without an expert-parallel
group (one process, or ``E = 1``) the same layer holds every expert and exchanges
nothing, which is the reference the tests compare against.
"""

from __future__ import annotations

import warnings

import lightning as L
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import lightning_layerwise as llw

__all__ = ["ExpertMLP", "GroupedExperts", "MoE", "MoEGPT", "MoEGPTLightningModule"]


class ExpertMLP(nn.Module):
    """One expert: a two-layer MLP without biases (its matrices go to Muon)."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x)))


class GroupedExperts(nn.Module):
    """``count`` experts stacked in two 3-D parameters, as torchtitan's ``GroupedExperts`` keeps them: ``up``
    ``[count, hidden, d]`` and ``down`` ``[count, d, hidden]``, each expert's matrix ``(out, in)`` as an
    ``nn.Linear`` weight. Muon orthogonalizes each expert's matrix (a stack: Note [matrix views]).
    ``from_experts`` stacks :class:`ExpertMLP` weights, so both forms start from the same numbers."""

    def __init__(self, count: int, d: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.empty(count, hidden, d))
        self.down = nn.Parameter(torch.empty(count, d, hidden))

    @classmethod
    def from_experts(cls, experts: list[ExpertMLP]) -> "GroupedExperts":
        grouped = cls(len(experts), experts[0].up.in_features, experts[0].up.out_features)
        with torch.no_grad():
            grouped.up.copy_(torch.stack([e.up.weight for e in experts]))
            grouped.down.copy_(torch.stack([e.down.weight for e in experts]))
        return grouped

    def __len__(self) -> int:
        return self.up.shape[0]

    def expert(self, j: int, x: Tensor) -> Tensor:
        return F.linear(F.gelu(F.linear(x, self.up[j])), self.down[j])


def _exchange(x: Tensor, send: list[int], receive: list[int], group) -> Tensor:
    """``x`` split by ``send`` to the ranks of ``group``, received in ``receive`` parts (differentiable)."""
    from torch.distributed.nn.functional import all_to_all_single

    out = x.new_empty((sum(receive), *x.shape[1:]))
    with warnings.catch_warnings():  # torch 2.13 deprecates it for a private module; 2.11 has only this one
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*all_to_all_single is deprecated")
        return all_to_all_single(out, x.contiguous(), output_split_sizes=receive, input_split_sizes=send,
                                 group=group)


class MoE(nn.Module):
    """Top-``k`` routed experts, ``num_experts`` in all, of which this rank holds those of ``expert_rank``.

    ``expert_group``: the expert-parallel process group, set before the first forward
    (``LayerwiseStrategy.process_groups.expert_parallel``); ``None``: every expert is local.
    After each forward, :attr:`aux_loss` holds the load-balancing loss of this rank's tokens.
    """

    def __init__(self, d: int, hidden: int, num_experts: int, top_k: int = 2, expert_parallel_size: int = 1,
                 expert_rank: int = 0, grouped: bool = False) -> None:
        super().__init__()
        if num_experts % expert_parallel_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by expert_parallel_size="
                             f"{expert_parallel_size}.")
        self.num_experts, self.top_k = num_experts, top_k
        self.local = num_experts // expert_parallel_size
        self.first = expert_rank * self.local
        self.router = nn.Linear(d, num_experts, bias=False)
        # Every rank draws every expert's initial weights (same random stream) and keeps its own.
        experts = [ExpertMLP(d, hidden) for _ in range(num_experts)][self.first:self.first + self.local]
        # grouped: the local experts stacked in 3-D parameters (GroupedExperts), from the same initial weights.
        local = GroupedExperts.from_experts(experts) if grouped else nn.ModuleList(experts)
        self.experts = llw.mark_experts(local, num_experts)
        self.expert_group = None
        self.aux_loss = torch.zeros(())

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = self.router(tokens).softmax(-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        # Switch-style balance: experts' share of routed slots times their mean router probability.
        share = torch.zeros(self.num_experts, device=x.device).index_add_(
            0, ids.reshape(-1), torch.ones(ids.numel(), device=x.device)) / ids.numel()
        self.aux_loss = self.num_experts * (share * probs.mean(0)).sum()

        flat_ids = ids.reshape(-1)
        order = flat_ids.argsort(stable=True)
        token_of = order // self.top_k  # which token each sorted slot belongs to
        sorted_ids = flat_ids[order]
        send_x = tokens[token_of]
        group = self.expert_group
        if group is not None:
            ranks = dist.get_world_size(group)
            send = torch.bincount(sorted_ids // self.local, minlength=ranks)
            receive = torch.empty_like(send)
            dist.all_to_all_single(receive, send, group=group)
            send, receive = send.tolist(), receive.tolist()
            recv_x = _exchange(send_x, send, receive, group)
            recv_ids = torch.empty(sum(receive), dtype=sorted_ids.dtype, device=x.device)
            dist.all_to_all_single(recv_ids, sorted_ids, output_split_sizes=receive, input_split_sizes=send,
                                   group=group)
        else:
            recv_x, recv_ids = send_x, sorted_ids
        # out depends on recv_x even when no token came here: the backward of the exchange above is a
        # collective, and autograd runs it only for outputs the loss depends on. A rank whose experts got
        # no token would otherwise skip it while the others wait (the same graph on every rank).
        out = recv_x * 0
        grouped = isinstance(self.experts, GroupedExperts)
        for j in range(len(self.experts)):
            mask = recv_ids == self.first + j
            if mask.any():
                x_j = recv_x[mask]
                y_j = self.experts.expert(j, x_j) if grouped else self.experts[j](x_j)
                out = out.index_put((mask.nonzero().squeeze(1),), y_j)
        if group is not None:
            out = _exchange(out, receive, send, group)
        combined = torch.zeros_like(tokens).index_add(0, token_of, out * weights.reshape(-1)[order].unsqueeze(1))
        return combined.reshape(shape)


class MoEGPT(nn.Module):
    """Token and position embeddings, ``n_layer`` blocks of attention and an MoE feed-forward, a tied head."""

    def __init__(self, vocab_size: int = 96, block_size: int = 64, n_layer: int = 2, n_head: int = 4,
                 n_embd: int = 64, num_experts: int = 4, top_k: int = 2, expert_parallel_size: int = 1,
                 expert_rank: int = 0, grouped_experts: bool = False) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.attn = nn.ModuleList(nn.MultiheadAttention(n_embd, n_head, bias=False, batch_first=True)
                                  for _ in range(n_layer))
        self.ln1 = nn.ModuleList(nn.LayerNorm(n_embd) for _ in range(n_layer))
        self.ln2 = nn.ModuleList(nn.LayerNorm(n_embd) for _ in range(n_layer))
        self.moe = nn.ModuleList(MoE(n_embd, 2 * n_embd, num_experts, top_k, expert_parallel_size, expert_rank,
                                     grouped=grouped_experts) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.wte.weight
        nn.init.normal_(self.wte.weight, std=0.02)  # tied to the head: unit-variance rows would start at loss ~30
        nn.init.normal_(self.wpe.weight, std=0.02)

    def set_expert_group(self, group) -> None:
        for layer in self.moe:
            layer.expert_group = group

    @property
    def aux_loss(self) -> Tensor:
        return sum(layer.aux_loss for layer in self.moe)

    def forward(self, idx: Tensor) -> Tensor:
        T = idx.size(1)
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool, device=idx.device), 1)
        for attn, ln1, ln2, moe in zip(self.attn, self.ln1, self.ln2, self.moe):
            h = ln1(x)
            x = x + attn(h, h, h, attn_mask=causal, need_weights=False)[0]
            x = x + moe(ln2(x))
        return self.head(self.ln_f(x))


class MoEGPTLightningModule(L.LightningModule):
    """Character-level MoE GPT under ``LayerwiseStrategy(expert_parallel_size=E)``.

    The model is built in ``configure_model``, when the strategy knows which experts this
    rank holds (``strategy.expert_parallel_rank``); ``on_fit_start`` hands the MoE layers
    the expert-parallel group to exchange tokens over. Loss: next-token cross-entropy
    plus ``aux_loss_weight`` times the load-balancing loss. Under any other strategy (or
    ``expert_parallel_size=1``) every rank holds every expert.
    """

    def __init__(self, vocab_size: int = 0, block_size: int = 64, n_layer: int = 2, n_head: int = 4,
                 n_embd: int = 64, num_experts: int = 4, top_k: int = 2, aux_loss_weight: float = 0.01,
                 lr: float = 0.02, adamw_lr: float = 3e-3, grouped_experts: bool = False,
                 flatten_experts: bool = False) -> None:
        """``grouped_experts``: the experts stacked in 3-D parameters (:class:`GroupedExperts`), each expert's
        matrix orthogonalized on its own; ``flatten_experts`` makes Muon see each stack as one flattened
        ``(E, rest)`` matrix instead (what a stack got before matrix views; for comparison only)."""
        super().__init__()
        self.save_hyperparameters()
        self.model: MoEGPT | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        h = self.hparams
        vocab_size = h.vocab_size or getattr(self.trainer.datamodule, "vocab_size", 0)
        if not vocab_size:
            raise ValueError("MoEGPTLightningModule: pass vocab_size, or a datamodule with a `vocab_size`.")
        strategy = self.trainer.strategy
        E = getattr(strategy, "expert_parallel_size", 1)
        self.model = MoEGPT(vocab_size, h.block_size, h.n_layer, h.n_head, h.n_embd, h.num_experts, h.top_k,
                            expert_parallel_size=E, expert_rank=strategy.expert_parallel_rank if E > 1 else 0,
                            grouped_experts=h.get("grouped_experts", False))
        if h.get("flatten_experts", False):
            for layer in self.model.moe:
                for name in ("up", "down"):
                    llw.mark_matrices(layer.experts, name, stack=False)

    def on_fit_start(self) -> None:
        groups = getattr(self.trainer.strategy, "process_groups", None)
        self.model.set_expert_group(groups.expert_parallel if groups is not None else None)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        aux = self.model.aux_loss
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        self.log("balance_loss", aux.detach(), sync_dist=True)
        return loss + self.hparams.aux_loss_weight * aux

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.model(x).flatten(0, 1), y.flatten()), prog_bar=True,
                 sync_dist=True)

    def configure_optimizers(self):
        return llw.Muon(llw.muon_param_groups(self.model), lr=self.hparams.lr, adamw_lr=self.hparams.adamw_lr)
