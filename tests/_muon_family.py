"""What the Muon-family tests share: a model with every kind of matrix view, and a reference optimizer written
from the papers' formulas, independent of the package's implementation.

The model (:class:`FamilyNet`): an embedding, an attention with a fused QKV orthogonalized per head
(``3 * H`` row blocks), an attention with separate query, key (with biases) and value projections, the
query per head, and an MLP of ``E`` experts stacked in 3-D parameters (each token through every expert,
averaged: a dense stack, no routing), a LayerNorm and an output head. Attention is written out (softmax of
masked ``q k^T / sqrt(d)``) and keeps, per module, its own largest logit per head: the reference maximum
for QK-clip, next to what ``llw.record_attention_logits`` records.

The reference (:class:`ReferenceOptimizer`), per matrix ``M`` of a parameter (the slices :func:`matrices` lists,
by what the model means, not by the package's view code):

* Muon (Jordan et al. 2024; torch's momentum form): ``B <- mu B + (1 - mu) G``, ``D = (1 - mu) G + mu B``
  (Nesterov), ``O = NS5(D)`` (quintic Newton-Schulz, Frobenius-normalized, transposed when tall), ``W <- (1 -
  lr wd) W - lr sqrt(max(1, m / n)) O``.
* NorMuon (Li et al. 2025, arXiv:2510.05491, Algorithm 1): after ``O``, ``v <- b2 v + (1 - b2) mean_cols(O^2)``
  per row, ``O_hat = O / (sqrt(v) + eps)``, ``W <- (1 - lr wd) W - (0.2 lr sqrt(m n) / ||O_hat||_F) O_hat``.
* QK-clip (Kimi K2, arXiv:2507.20534): after the step, for each head ``gamma = min(1, tau / S_max)`` and the
  head's query and key rows (and bias entries) times ``sqrt(gamma)``.
* everything else: ``torch.optim.AdamW``.

"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import lightning_layerwise as llw

D, H, E, VOCAB, SEQ = 16, 4, 4, 23, 8
HD = D // H
COEFFS = (3.4445, -4.7750, 2.0315)
LR, MOMENTUM, WD, ADAMW_LR = 0.02, 0.95, 0.01, 3e-3
NORMUON_LR = 0.01


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal softmax attention written out; also each head's largest logit (the softmax's inputs only)."""
    T = q.shape[-2]
    logits = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    logits = logits.masked_fill(~causal, float("-inf"))
    largest = logits.detach().transpose(0, 1).reshape(q.shape[1], -1).amax(dim=1)
    return logits.softmax(-1) @ v, largest


class _Attention(nn.Module):
    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        B, T, _ = t.shape
        return t.view(B, T, H, HD).transpose(1, 2)

    def _attend(self, q, k, v) -> torch.Tensor:
        q, k, v = self._heads(q), self._heads(k), self._heads(v)
        llw.record_attention_logits(self, q, k, is_causal=True)  # what QKClip reads
        y, largest = attention(q, k, v)
        self.reference_max = largest if self.reference_max is None else torch.maximum(self.reference_max, largest)
        B, _, T, _ = y.shape
        return y.transpose(1, 2).reshape(B, T, D)


class FusedAttention(_Attention):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.o = nn.Linear(D, D, bias=False)
        self.reference_max = None
        llw.mark_matrices(self.qkv, "weight", split=3 * H)  # per head: 3H row blocks of HD
        llw.mark_attention(self, n_heads=H, head_dim=HD, q="qkv.weight", k="qkv.weight", k_offset=D)

    def forward(self, x):
        q, k, v = self.qkv(x).split(D, dim=-1)
        return self.o(self._attend(q, k, v))


class SplitAttention(_Attention):
    def __init__(self) -> None:
        super().__init__()
        # The query with a bias (QK-clip scales it with its rows); a key bias has no gradient (softmax ignores what
        # it adds to a row of logits), so AdamW would step on rounding noise.
        self.q, self.k = nn.Linear(D, D), nn.Linear(D, D, bias=False)
        self.v, self.o = nn.Linear(D, D, bias=False), nn.Linear(D, D, bias=False)
        self.reference_max = None
        llw.mark_matrices(self.q, "weight", split=H)  # the query per head
        llw.mark_attention(self, n_heads=H, head_dim=HD, q="q.weight", k="k.weight")

    def forward(self, x):
        return self.o(self._attend(self.q(x), self.k(x), self.v(x)))


class FamilyNet(nn.Module):
    def __init__(self, seed: int = 0, hot_heads: tuple[int, ...] = ()) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, D)
        self.att1, self.att2 = FusedAttention(), SplitAttention()
        self.up = nn.Parameter(torch.randn(E, 2 * D, D) / math.sqrt(D))  # a stack of E (2D, D) matrices
        self.down = nn.Parameter(torch.randn(E, D, 2 * D) / math.sqrt(2 * D))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        with torch.no_grad():  # heads whose logits start large: the ones QK-clip must rescale
            for h in hot_heads:
                self.att2.q.weight[h * HD:(h + 1) * HD] *= 6.0
                self.att2.k.weight[h * HD:(h + 1) * HD] *= 6.0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        x = x + self.att1(x)
        x = x + self.att2(x)
        h = torch.einsum("btd,efd->ebtf", x, self.up)  # every expert on every token
        x = x + torch.einsum("ebtf,edf->btd", F.gelu(h), self.down) / E
        return self.head(self.norm(x))


def matrices(name: str, shape: tuple[int, ...]) -> list[tuple] | None:
    """Index tuples of the matrices Muon must see in parameter ``name`` (``None``: AdamW), by the model's meaning."""
    if name in ("up", "down"):
        return [(e,) for e in range(shape[0])]  # one matrix per expert
    if name == "att1.qkv.weight":
        return [(slice(b * HD, (b + 1) * HD),) for b in range(3 * H)]  # per head of q, k and v
    if name == "att2.q.weight":
        return [(slice(h * HD, (h + 1) * HD),) for h in range(H)]
    if name in ("att1.o.weight", "att2.k.weight", "att2.v.weight", "att2.o.weight"):
        return [()]
    return None


def batches(steps: int, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (12, SEQ + 1), generator=g) for _ in range(steps)]


def loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


def ns5(G: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    X = G.double()
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / X.norm().clamp(min=eps)
    a, b, c = COEFFS
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return (X.T if tall else X).float()


class ReferenceOptimizer:
    """The formulas of the module docstring over ``model``'s named parameters (float64 Newton-Schulz)."""

    def __init__(self, model: nn.Module, normuon: bool = False, tau: float | None = None, beta2: float = 0.95,
                 eps: float = 1e-8, matrices=matrices) -> None:
        self.model, self.normuon, self.tau, self.beta2, self.eps = model, normuon, tau, beta2, eps
        self.lr = NORMUON_LR if normuon else LR
        named = dict(model.named_parameters())
        self.muon = {n: matrices(n, tuple(p.shape)) for n, p in named.items() if matrices(n, tuple(p.shape))}
        self.adamw = torch.optim.AdamW([p for n, p in named.items() if n not in self.muon], lr=ADAMW_LR,
                                       betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
        self.buf = {n: torch.zeros_like(named[n]) for n in self.muon}
        self.v: dict[tuple, torch.Tensor] = {}

    @torch.no_grad()
    def step(self) -> None:
        named = dict(self.model.named_parameters())
        for n, indices in self.muon.items():
            W, G, B = named[n], named[n].grad, self.buf[n]
            W.mul_(1 - self.lr * WD)
            for j, idx in enumerate(indices):
                B[idx] = MOMENTUM * B[idx] + (1 - MOMENTUM) * G[idx]
                O = ns5((1 - MOMENTUM) * G[idx] + MOMENTUM * B[idx])
                m, k = O.shape
                if self.normuon:
                    v = self.v.setdefault((n, j), torch.zeros(m))
                    v.mul_(self.beta2).add_((1 - self.beta2) * (O * O).mean(dim=1))
                    O_hat = O / (v.sqrt() + self.eps)[:, None]
                    W[idx] -= 0.2 * self.lr * math.sqrt(m * k) / O_hat.norm() * O_hat
                else:
                    W[idx] -= self.lr * math.sqrt(max(1.0, m / k)) * O
        self.adamw.step()
        if self.tau is not None:
            self.clip()

    @torch.no_grad()
    def clip(self) -> None:
        for attn, q, k, qb, kb in ((self.model.att1, "qkv.weight", "qkv.weight", None, None),
                                   (self.model.att2, "q.weight", "k.weight", "q.bias", None)):
            params = dict(attn.named_parameters())
            k_offset = D if q == k else 0
            for h, s in enumerate(attn.reference_max.tolist()):
                gamma = min(1.0, self.tau / s)
                for name, offset in ((q, 0), (k, k_offset), (qb, 0), (kb, k_offset)):
                    if name is not None:
                        params[name][offset + h * HD:offset + (h + 1) * HD] *= math.sqrt(gamma)
            attn.reference_max = None

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)


def package_optimizer(model: nn.Module, normuon: bool = False, adamw: bool = False) -> torch.optim.Optimizer:
    """The package's optimizer for the same run: the model's marks make the views (``muon_param_groups``);
    ``adamw``: torch's AdamW for every parameter (QK-clip works with any optimizer)."""
    if adamw:
        return torch.optim.AdamW(model.parameters(), lr=ADAMW_LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    return llw.Muon(llw.muon_param_groups(model), lr=NORMUON_LR if normuon else LR, momentum=MOMENTUM,
                    nesterov=True, weight_decay=WD, ns_coefficients=COEFFS, ns_dtype=torch.float32,
                    adamw_lr=ADAMW_LR, adamw_betas=(0.9, 0.95), adamw_eps=1e-8, adamw_weight_decay=0.0,
                    normuon=normuon)


def reference_run(variant: str, steps: int = 10, tau: float | None = None, hot_heads=(1, 3)) -> dict:
    """One process, the whole global batch, the reference optimizer: parameters after ``steps`` and the losses."""
    model = FamilyNet(hot_heads=hot_heads)
    everything_adamw = (lambda name, shape: None) if variant.startswith("adamw") else matrices
    opt = ReferenceOptimizer(model, normuon=variant == "normuon", tau=tau, matrices=everything_adamw)
    return train_one_process(model, opt, steps)


def train_one_process(model: nn.Module, opt, steps: int, after_step=lambda: None) -> dict:
    """``steps`` whole global batches in one process: the parameters after them and each step's loss."""
    losses = []
    for tokens in batches(steps):
        opt.zero_grad()
        loss = loss_fn(model, tokens)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        after_step()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "losses": losses}


def moe_matrices(name: str, shape: tuple[int, ...]) -> list[tuple] | None:
    """The example MoE GPT with grouped experts: each expert of a 3-D stack its own matrix; the attention's
    projections and the routers one matrix each; embeddings, the tied head and norms AdamW."""
    if len(shape) == 3:
        return [(e,) for e in range(shape[0])]
    if len(shape) == 2 and not name.startswith(("wte", "wpe", "head")):
        return [()]
    return None


