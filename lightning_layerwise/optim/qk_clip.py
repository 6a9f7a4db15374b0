"""QK-clip (MuonClip): what an attention module reports, and the per-head rescale factors. Pure maths.

Note [QK-clip]
    Kimi K2 (arXiv:2507.20534, section 2.1) keeps attention logits bounded by rescaling,
    after each optimizer step, the query and key weights of every head whose largest
    pre-softmax logit in the step exceeded ``tau``:

        S_max^h = max over the step's batch of max_{i,j} scale * q_i^h . k_j^h
        gamma_h = min(1, tau / S_max^h),   W_q^h <- sqrt(gamma_h) W_q^h,   W_k^h <- sqrt(gamma_h) W_k^h

    so head h's logits shrink by ``gamma_h`` and no other head changes. Here:

    * An attention module declares its heads once (:func:`mark_attention`) and reports each
      forward's per-head maximum with :func:`record_attention_logits` (``q``, ``k``, mask and
      scale as ``F.scaled_dot_product_attention`` takes them): a running maximum over the
      step's micro-batches of the logits the softmax sees, kept on the device.
    * With grouped-query attention a key head serves ``n_heads / n_kv_heads`` query
      heads. The key rows of group g are scaled by ``sqrt(min_h gamma_h)`` over its
      heads and each query head by ``gamma_h / sqrt(min_h gamma_h)``, so every head's
      logits again shrink by exactly ``gamma_h`` (with one query head per key head
      this is the paper's ``sqrt(gamma_h)`` on each).
    * A bias of the query or key projection is scaled with its rows, so ``q`` and
      ``k`` scale exactly (the paper's projections have none).

    The distributed half (the maximum over every data-parallel rank, and each owner
    rescaling the rows it steps) is :class:`lightning_layerwise.engine.qk_clip.QKClip`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["ATTENTION_ATTRIBUTE", "LOGITS_ATTRIBUTE", "AttentionHeads", "head_factors", "mark_attention",
           "max_attention_logits", "record_attention_logits"]

ATTENTION_ATTRIBUTE = "llw_attention_heads"
"""The attribute :func:`mark_attention` sets on an attention module."""
LOGITS_ATTRIBUTE = "llw_max_logits"
"""The attribute :func:`record_attention_logits` keeps the running per-head maximum in."""


@dataclass(frozen=True)
class AttentionHeads:
    """Where an attention module's query and key heads live (names relative to the module)."""

    n_heads: int
    head_dim: int
    q: str
    k: str
    q_offset: int = 0
    """First row of head 0's query in ``q`` (a fused QKV weight holds queries, keys and values)."""
    k_offset: int = 0
    n_kv_heads: int | None = None
    """Key heads (grouped-query attention); ``None``: one per query head."""
    q_bias: str | None = None
    k_bias: str | None = None
    head_stride: int | None = None
    """Rows from one head's first row to the next head's (``None``: ``head_dim``, heads side by side); a fused QKV
    stacked head by head, ``[q_0; k_0; v_0; q_1; ...]``, has ``3 * head_dim``."""

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def stride(self) -> int:
        return self.head_stride or self.head_dim

    def rows(self, offset: int, count: int) -> Tensor:
        """The rows of ``count`` heads from ``offset``, head by head (``int64``)."""
        starts = offset + torch.arange(count).unsqueeze(1) * self.stride
        return (starts + torch.arange(self.head_dim)).reshape(-1)


def mark_attention(module: nn.Module, *, n_heads: int, head_dim: int, q: str, k: str, q_offset: int = 0,
                   k_offset: int = 0, n_kv_heads: int | None = None, q_bias: str | None = "auto",
                   k_bias: str | None = "auto", head_stride: int | None = None) -> nn.Module:
    """Declares ``module``'s attention heads for QK-clip (Note [QK-clip]) and returns it.

    ``q``, ``k``: the names (relative to ``module``) of the weights whose rows ``[offset + h*head_dim, offset +
    (h+1)*head_dim)`` produce head h's queries and keys, e.g. ``q="c_attn.weight", k="c_attn.weight",
    k_offset=n_embd`` for a fused QKV or ``q="q_proj.weight", k="k_proj.weight"``. ``q_bias``, ``k_bias``: their
    biases; ``"auto"`` takes the ``.bias`` beside a ``.weight`` if there is one. ``head_stride``: rows from one
    head's first row to the next's when heads are not side by side, e.g. ``head_stride=3 * head_dim``, ``q_offset=0``,
    ``k_offset=head_dim`` for a fused QKV stacked head by head (as a tensor-parallel plan shards it).
    """
    for name, value in (("n_heads", n_heads), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"mark_attention({name}={value!r}): pass a positive integer.")
    for name, value in (("q_offset", q_offset), ("k_offset", k_offset)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"mark_attention({name}={value!r}): pass the first row of head 0, an integer >= 0.")
    if head_stride is not None and (isinstance(head_stride, bool) or not isinstance(head_stride, int)
                                    or head_stride < head_dim):
        raise ValueError(f"mark_attention(head_stride={head_stride!r}): pass the rows from one head's first row to "
                         f"the next's, an integer >= head_dim={head_dim} (e.g. 3 * head_dim for a fused QKV stacked "
                         "head by head), or None for heads side by side.")
    kv = n_heads if n_kv_heads is None else n_kv_heads
    if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1 or n_heads % kv:
        raise ValueError(f"mark_attention(n_kv_heads={n_kv_heads!r}): pass the number of key heads, a positive "
                         f"integer dividing n_heads={n_heads}, or None (one key head per query head).")
    params = dict(module.named_parameters())

    def resolve_bias(weight: str, bias: str | None) -> str | None:
        if bias != "auto":
            return bias
        sibling = weight.removesuffix("weight") + "bias" if weight.endswith("weight") else None
        return sibling if sibling in params else None

    heads = AttentionHeads(n_heads, head_dim, q, k, q_offset, k_offset, n_kv_heads, resolve_bias(q, q_bias),
                           resolve_bias(k, k_bias), head_stride)
    for role, name, offset, count in (("q", q, q_offset, n_heads), ("k", k, k_offset, kv),
                                      ("q_bias", heads.q_bias, q_offset, n_heads),
                                      ("k_bias", heads.k_bias, k_offset, kv)):
        if name is None:
            continue
        if name not in params:
            raise ValueError(f"mark_attention({role}={name!r}): {type(module).__name__} has no parameter of that name "
                             f"(it has {sorted(params)[:6]}).")
        rows = params[name].shape[0]
        if offset < 0 or offset + (count - 1) * heads.stride + head_dim > rows:
            raise ValueError(f"mark_attention: {role}={name!r} has {rows} rows, too few for {count} heads of "
                             f"{head_dim} from row {offset}" + (f", {heads.stride} apart." if head_stride else "."))
    _check_disjoint(heads)
    setattr(module, ATTENTION_ATTRIBUTE, heads)
    return module


def _check_disjoint(heads: AttentionHeads) -> None:
    """Refuses query rows that overlap key rows of the same parameter: QK-clip would scale the rows both hold by a
    query factor and a key factor, the one written last winning, and the bound would not hold."""
    q_rows = (heads.q_offset, heads.q_offset + heads.n_heads * heads.head_dim)
    k_rows = (heads.k_offset, heads.k_offset + heads.kv_heads * heads.head_dim)
    shared = bool(set(heads.rows(heads.q_offset, heads.n_heads).tolist()) &
                  set(heads.rows(heads.k_offset, heads.kv_heads).tolist()))
    for q_name, k_name in ((heads.q, heads.k), (heads.q_bias, heads.k_bias)):
        if q_name is not None and q_name == k_name and shared and heads.head_stride is not None:
            raise ValueError(
                f"mark_attention(q={heads.q!r}, k={heads.k!r}, q_offset={heads.q_offset}, k_offset={heads.k_offset}, "
                f"head_stride={heads.head_stride}): some query rows of {q_name!r} are also key rows; each row is a "
                "query or a key. In a fused QKV stacked head by head pass q_offset=0, k_offset=head_dim, "
                "head_stride=3 * head_dim.")
        if q_name is not None and q_name == k_name and shared:
            raise ValueError(
                f"mark_attention(q={heads.q!r}, k={heads.k!r}, q_offset={heads.q_offset}, k_offset={heads.k_offset}): "
                f"the query rows [{q_rows[0]}, {q_rows[1]}) and the key rows [{k_rows[0]}, {k_rows[1]}) of "
                f"{q_name!r} overlap; each row is a query or a key. In a fused QKV whose keys follow the queries "
                f"pass k_offset=q_offset + n_heads * head_dim (= {q_rows[1]}).")


@torch.no_grad()
def max_attention_logits(q: Tensor, k: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False,
                         scale: float | None = None, chunk: int = 1024) -> Tensor:
    """Each head's largest pre-softmax logit ``scale * q . k`` over a batch, as ``F.scaled_dot_product_attention``
    would compute it from the same arguments: ``q`` ``(..., H, L, E)``, ``k`` ``(..., H_kv, S, E)`` (``H_kv``
    dividing ``H``: grouped-query attention), ``scale`` default ``1/sqrt(E)``. Positions the mask excludes (a
    ``False`` of a boolean ``attn_mask``, ``-inf`` of a float one, above the diagonal with ``is_causal``) are left
    out; a float mask's values are not added (the clip bounds ``q . k``). Returns ``(H,)`` in float32; ``-inf``
    for a head that saw no position. Query rows are taken ``chunk`` at a time to bound the memory."""
    H, L, E = q.shape[-3], q.shape[-2], q.shape[-1]
    S = k.shape[-2]
    if H % k.shape[-3]:
        raise ValueError(f"max_attention_logits: {k.shape[-3]} key heads do not divide {H} query heads.")
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    q = q.reshape(-1, H, L, E).float()
    k = k.reshape(-1, k.shape[-3], S, E).float().repeat_interleave(H // k.shape[-3], dim=1)
    best = torch.full((H,), float("-inf"), device=q.device)
    for start in range(0, L, chunk):
        stop = min(start + chunk, L)
        logits = torch.matmul(q[:, :, start:stop], k.transpose(-2, -1)) * scale
        allowed = torch.ones(stop - start, S, dtype=torch.bool, device=q.device)
        if is_causal:  # SDPA's top-left alignment: query i sees keys j <= i
            rows = torch.arange(start, stop, device=q.device).unsqueeze(1)
            allowed = rows >= torch.arange(S, device=q.device)
        if attn_mask is not None:
            mask = attn_mask[..., start:stop, :]
            allowed = allowed & (mask if mask.dtype == torch.bool else mask > float("-inf"))
        logits = logits.masked_fill(~allowed.expand_as(logits), float("-inf"))
        best = torch.maximum(best, logits.transpose(0, 1).reshape(H, -1).amax(dim=1))
    return best


def record_attention_logits(module: nn.Module, q: Tensor, k: Tensor, attn_mask: Tensor | None = None,
                            is_causal: bool = False, scale: float | None = None) -> None:
    """Folds this forward's per-head maximum logit (:func:`max_attention_logits`) into ``module``'s running
    maximum for QK-clip (Note [QK-clip]); call it in the forward with the arguments handed to
    ``F.scaled_dot_product_attention``. Records only while the module is in training mode. On a module declared with
    :func:`mark_attention`, ``q`` and ``k`` must have its heads in dimension -3 and ``head_dim`` in -1."""
    if not module.training:
        return
    heads = getattr(module, ATTENTION_ATTRIBUTE, None)
    if heads is not None:
        _check_layout(module, heads, q, k)
    current = max_attention_logits(q.detach(), k.detach(), attn_mask, is_causal, scale)
    held = getattr(module, LOGITS_ATTRIBUTE, None)
    object.__setattr__(module, LOGITS_ATTRIBUTE, current if held is None else torch.maximum(held, current))


def _check_layout(module: nn.Module, heads: AttentionHeads, q: Tensor, k: Tensor) -> None:
    """``q`` ``(..., n_heads, L, head_dim)`` and ``k`` with ``n_kv_heads`` (or ``n_heads``, repeated) heads, as
    declared: another layout (``(B, L, H, E)``) would give maxima of other heads, or of no head at all. Under tensor
    parallelism a rank computes ``1/w`` of the heads (``n_heads / w`` and ``n_kv_heads / w``, or as many repeated);
    ``QKClip`` checks ``w`` against the sharding (``engine/qk_clip.py``)."""
    ways = heads.n_heads // q.shape[-3] if q.ndim >= 3 and q.shape[-3] and not heads.n_heads % q.shape[-3] else 0
    if q.ndim < 3 or k.ndim < 3 or not ways or q.shape[-1] != heads.head_dim or heads.kv_heads % ways or \
            k.shape[-3] not in (heads.kv_heads // ways, q.shape[-3]) or k.shape[-1] != heads.head_dim:
        raise ValueError(
            f"record_attention_logits({type(module).__name__}): q has shape {tuple(q.shape)} and k "
            f"{tuple(k.shape)}, but mark_attention declared n_heads={heads.n_heads}, n_kv_heads="
            f"{heads.n_kv_heads}, head_dim={heads.head_dim}. Pass q and k as F.scaled_dot_product_attention takes "
            "them, (batch, heads, sequence, head_dim): e.g. q.view(B, T, n_heads, head_dim).transpose(1, 2).")


def head_factors(s_max: Tensor, tau: float, n_kv_heads: int | None = None) -> tuple[Tensor, Tensor]:
    """The row factors of Note [QK-clip] for one attention: ``(query factor per head, key factor per key head)``
    from the heads' largest logits ``s_max`` ``(H,)``: ``gamma = min(1, tau / s_max)`` (1 where ``s_max <= tau``),
    query ``gamma_h / sqrt(min gamma over its key head's group)``, key ``sqrt(that min)``."""
    s = s_max.float()
    gamma = torch.where(s > tau, tau / s.clamp(min=tau), torch.ones_like(s))
    kv = n_kv_heads or s.numel()
    group_min = gamma.reshape(kv, -1).amin(dim=1)
    k_factor = group_min.sqrt()
    if kv == s.numel():  # one query head per key head: the paper's sqrt(gamma) on each
        return k_factor, k_factor
    return gamma / k_factor.repeat_interleave(s.numel() // kv), k_factor
