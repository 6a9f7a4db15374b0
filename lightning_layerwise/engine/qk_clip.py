"""QK-clip under data parallelism: the step's largest logits over every rank, and each owner rescaling its rows.

Note [QK-clip across ranks]
    The maths is Note [QK-clip] in ``optim/qk_clip.py``. Two things make it distributed:

    * ``S_max`` is over the whole global batch: each rank's running maxima (every
      micro-batch of the step) are concatenated into one small tensor and all-reduced
      with ``MAX`` over the data-parallel group, so every rank computes the same
      factors. On a GPU nothing waits on the host.
    * Under the layer-wise wrapper each row is rescaled by the rank that steps it: the
      tensor the optimizer holds (the parameter owned whole, this rank's piece of a
      split one, or its float32 master), so the rescale rides the same all-gather as
      the step's update and every rank ends with the same weights. The query and
      key weights of one head may have two owners: each rescales its own.

    * Under tensor parallelism a rank computes the heads of its shard of the query weight (rows
      ``[t n / T, (t + 1) n / T)``), so it records those; after the data-parallel maximum the heads are
      gathered over the tensor-parallel group in rank order, every rank computes every factor, and each
      scales its block of the rows. The parameters are looked up by name at the step: the strategy gives
      the module local parameters when it wraps it, after the optimizer and this clip were made.

    :meth:`QKClip.attach` runs it as a step post-hook of the optimizer, so a step the
    optimizer skips (a ``GradScaler`` that found an inf) skips the rescale too, and
    its logits count towards the next step's maximum (the weights did not change).
    The running maxima are cleared after every rescale.

Note [a step without recorded logits]
    A step in which no declared attention recorded a logit (a forward that never calls
    ``record_attention_logits``, or one run in eval mode, where it records nothing) raises
    ``RuntimeError``: clipping nothing is what such a step would do, and the bound asked for
    would silently not hold. The check reads only which modules hold a maximum (no device
    synchronization), and every rank runs the same forward code, so every rank raises at
    the same step, before the maxima's all-reduce. With :meth:`QKClip.attach` it runs in a
    step pre-hook, before the optimizer changes anything, unless the step is given a
    closure (Lightning's automatic optimization runs the forward inside
    ``optimizer.step(closure)``): then :meth:`QKClip.step`, the post-hook, raises after that
    first update. Validation takes no optimizer step and records nothing (eval mode), so it
    does not count. A declared attention without a maximum in a step where others have one
    (a layer skipped this step, or one whose forward does not record) is clipped by
    nothing that step, and a warning names it, once per ``QKClip``.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..optim.qk_clip import ATTENTION_ATTRIBUTE, LOGITS_ATTRIBUTE, AttentionHeads, head_factors
from . import collectives
from .live_wrappers import wrapper_of
from .tensor_parallel import spec_of, tensor_parallel_group

__all__ = ["QKClip"]


class QKClip:
    """QK-clip (MuonClip) for the attention modules of ``model`` declared with
    :func:`~lightning_layerwise.optim.qk_clip.mark_attention` (Notes [QK-clip], [QK-clip across ranks]).

    ``tau``: the logit bound (Kimi K2 used 100). ``group``: the data-parallel group the maxima are reduced over;
    default: the group of the layer-wise wrapper training ``model``, else the default group if one is initialized.
    Call :meth:`step` after each optimizer step, or :meth:`attach` it to the optimizer once.
    """

    def __init__(self, model: nn.Module, tau: float = 100.0, group: Any = "auto") -> None:
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau > 0:
            raise ValueError(f"QKClip(tau={tau!r}): the logit bound must be a number > 0, e.g. tau=100.0.")
        self.model, self.tau, self._group = model, float(tau), group
        self.attentions: list[tuple[str, nn.Module, AttentionHeads]] = [
            (path, m, getattr(m, ATTENTION_ATTRIBUTE)) for path, m in model.named_modules()
            if hasattr(m, ATTENTION_ATTRIBUTE)]
        if not self.attentions:
            raise ValueError(f"QKClip: no module of {type(model).__name__} declares its attention heads; call "
                             "lightning_layerwise.mark_attention(module, n_heads=..., head_dim=..., q=..., k=...) on "
                             "each attention module and record_attention_logits(...) in its forward.")
        params = dict(model.named_parameters(remove_duplicate=False))
        self._rows: list[tuple[str, list[tuple[int, str, int, int]]]] = []
        """Each parameter holding query or key rows, once (a fused QKV holds both), by name, with its ranges:
        (attention, "q" or "k", first row, head_dim); :meth:`_params` holds the parameters."""
        for a, (path, _, heads) in enumerate(self.attentions):
            for role, kind, offset in (("q", "q", heads.q_offset), ("k", "k", heads.k_offset),
                                       ("q_bias", "q", heads.q_offset), ("k_bias", "k", heads.k_offset)):
                name = getattr(heads, role)
                if name is None:
                    continue
                param = params[_join(path, name)]
                entry = next((e for e in self._rows if params[e[0]] is param), None)
                if entry is None:
                    entry = (_join(path, name), [])
                    self._rows.append(entry)
                entry[1].append((a, kind, offset, heads.head_dim))
        self._check_rows_declared_once()
        self._held: list[Tensor] = []
        self.last_max_logits: Tensor | None = None
        """Every declared head's largest logit of the last clipped step, over all ranks (attention order)."""
        self.clipped_heads: int | Tensor = 0
        """How many heads the last step rescaled (a tensor: reading it syncs with the device)."""
        self._handles: list[Any] = []
        self._warned_unrecorded = False

    def state_dict(self) -> dict[str, Any]:
        return {"tau": self.tau}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tau = float(state["tau"])

    def attach(self, optimizer: torch.optim.Optimizer) -> "QKClip":
        """Runs :meth:`step` after every step of ``optimizer`` (a step post-hook); returns ``self``. A step with no
        recorded logits is refused before the optimizer updates anything (Note [a step without recorded logits])."""
        self.detach()
        self._handles = [optimizer.register_step_pre_hook(self._before_step),
                         optimizer.register_step_post_hook(lambda *_: self.step())]
        return self

    def detach(self) -> None:
        """Removes the hooks :meth:`attach` registered."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _before_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        closure = args[1] if len(args) > 1 else kwargs.get("closure")  # args[0] is the optimizer
        if closure is None:  # a closure runs the forward inside the step: the post-hook checks then
            self._check_recorded()

    def _check_recorded(self) -> None:
        """Note [a step without recorded logits]."""
        missing = [path or type(module).__name__ for path, module, _ in self.attentions
                   if getattr(module, LOGITS_ATTRIBUTE, None) is None]
        if len(missing) == len(self.attentions):
            raise RuntimeError(
                f"QKClip(tau={self.tau:g}): no attention recorded its logits in this step, so QK-clip has nothing to "
                f"clip by (declared with mark_attention: {_names(missing)}). Call "
                "lightning_layerwise.record_attention_logits(self, q, k, attn_mask=..., is_causal=..., scale=...) in "
                "each one's forward, with the arguments given to F.scaled_dot_product_attention; it records in "
                "training mode only (model.train()). For steps that run no attention, clip.detach() the clip before "
                "them and clip.attach(optimizer) it again after.")
        if missing and not self._warned_unrecorded:
            self._warned_unrecorded = True
            warnings.warn(
                f"QKClip(tau={self.tau:g}): {_names(missing)} recorded no logits in this step while other attentions "
                "did, so their heads are not clipped this step. If their forward does not call "
                "lightning_layerwise.record_attention_logits(self, q, k, ...), add it; a layer skipped this step is "
                "fine. (Warned once.)", stacklevel=3)

    def _check_rows_declared_once(self) -> None:
        """Refuses a row that two declarations scale (two attentions sharing a parameter's rows): each would write
        its own factor, the last one winning."""
        for name, ranges in self._rows:
            declared: dict[int, tuple[int, str]] = {}
            for a, kind, offset, _ in ranges:
                for row in self._head_rows(a, kind, offset).tolist():
                    b, kind2 = declared.setdefault(row, (a, kind))
                    if (b, kind2) != (a, kind):
                        raise ValueError(
                            f"QKClip: row {row} of {name!r} is declared twice, as one of the {kind2} rows of attention "
                            f"{self.attentions[b][0]!r} and as {kind} rows of {self.attentions[a][0]!r}; QK-clip would "
                            "scale them by one head's factor and drop the other's. Give each attention its own rows "
                            "(a parameter shared by two attentions cannot be clipped yet).")

    def _head_rows(self, a: int, kind: str, offset: int) -> Tensor:
        heads = self.attentions[a][2]
        return heads.rows(offset, heads.n_heads if kind == "q" else heads.kv_heads)

    def _reduce_group(self, wrapper) -> Any:
        if self._group != "auto":
            return self._group
        if wrapper is not None:
            return wrapper.process_groups.dp
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None

    @torch.no_grad()
    def step(self) -> None:
        """Rescales the heads whose largest logit since the last call exceeded ``tau`` (collective over the
        data-parallel group when there is one: every rank calls it, as every rank steps)."""
        self._check_recorded()
        params = self._params()
        wrapper, device = wrapper_of(params[0]), params[0].device
        ways = [self._ways(path, heads) for path, _, heads in self.attentions]
        maxima = []
        for (path, module, heads), w in zip(self.attentions, ways):
            held = getattr(module, LOGITS_ATTRIBUTE, None)
            if held is not None and held.numel() != heads.n_heads // w:
                raise ValueError(
                    f"QKClip: attention {path!r} recorded the logits of {held.numel()} heads; it declares "
                    f"n_heads={heads.n_heads}" + (f", {heads.n_heads // w} on each of its {w} tensor-parallel ranks "
                                                  "(its query weight is sharded by rows)" if w > 1 else "") +
                    ". Pass record_attention_logits the q and k handed to F.scaled_dot_product_attention.")
            maxima.append(held.to(device) if held is not None else
                          torch.full((heads.n_heads // w,), float("-inf"), device=device))
            object.__setattr__(module, LOGITS_ATTRIBUTE, None)
        s_max = torch.cat(maxima)
        group = self._reduce_group(wrapper)
        if group is not None and dist.get_world_size(group) > 1:
            # Through the engine's dispatch, in program order with its other collectives on the group (the timing
            # fuzzer queues them all on one thread per group; a direct call would overtake its queue).
            collectives.all_reduce_max(s_max, group)
        tp_group = tensor_parallel_group(params)
        if tp_group is not None:
            s_max = _all_heads(s_max, [(w, heads.n_heads // w) for w, (_, _, heads) in zip(ways, self.attentions)],
                               tp_group)
        self.last_max_logits = s_max
        self.clipped_heads = (s_max > self.tau).sum()
        factors, start = [], 0
        for _, _, heads in self.attentions:
            q_factor, k_factor = head_factors(s_max[start:start + heads.n_heads], self.tau, heads.n_kv_heads)
            factors.append({"q": q_factor, "k": k_factor})
            start += heads.n_heads
        for param, (_, ranges) in zip(params, self._rows):
            spec = spec_of(param)
            rows = torch.ones(param.shape[0] if spec is None else spec.shape[0], device=device, dtype=torch.float32)
            for a, kind, offset, head_dim in ranges:
                factor = factors[a][kind]
                if self.attentions[a][2].head_stride is None:
                    rows[offset:offset + factor.numel() * head_dim] = factor.repeat_interleave(head_dim)
                else:
                    rows[self._head_rows(a, kind, offset).to(device)] = factor.repeat_interleave(head_dim)
            if spec is not None and spec.shard_dim == 0:  # this rank holds a block of the rows
                rows = rows.chunk(dist.get_world_size(spec.group))[dist.get_rank(spec.group)]
            self._scale_rows(param, rows, wrapper)

    def _params(self) -> list[Tensor]:
        """The parameters of :attr:`_rows`, looked up again when the module's are new (tensor parallelism gives
        a module local parameters when the strategy wraps it, after the optimizer and this clip were made)."""
        if not self._held or _parameter(self.model, self._rows[0][0]) is not self._held[0]:
            self._held = [_parameter(self.model, name) for name, _ in self._rows]
        return self._held

    def _ways(self, path: str, heads: AttentionHeads) -> int:
        """Over how many tensor-parallel ranks an attention's query heads are spread: the group's size where its
        query weight is sharded by rows (each rank computes its block of heads), else 1."""
        spec = spec_of(_parameter(self.model, _join(path, heads.q)))
        return 1 if spec is None or spec.shard_dim != 0 else dist.get_world_size(spec.group)

    @staticmethod
    def _scale_rows(param: Tensor, rows: Tensor, wrapper) -> None:
        """Multiplies each row of ``param`` by its factor in ``rows``, in the tensor this rank steps (Note [QK-clip
        across ranks])."""
        if wrapper is None:
            target, piece = param, None
        else:
            record = wrapper.records.of(param)
            unit = record.unit if record is not None else None
            if unit is None:  # another rank steps it
                return
            target, piece = unit.stepped, unit.piece
        row_length = math.prod(param.shape[1:])  # from the shape alone: a sharded parameter is not read
        if piece is None:
            view = target.view(param.shape[0], -1)
            view.mul_(rows.to(view.dtype).unsqueeze(1))
        else:  # a piece: elements [start, stop) of the flattened parameter
            flat = rows.repeat_interleave(row_length)[piece.start:piece.stop]
            target.view(-1).mul_(flat.to(target.dtype))


def _all_heads(local: Tensor, counts: list[tuple[int, int]], group) -> Tensor:
    """Every head's maximum from each tensor-parallel rank's ``local`` ones (collective over ``group``), with
    ``counts`` each attention's ``(ranks its heads are spread over, heads on a rank)``: rank ``t`` of an attention
    spread over ``w`` ranks holds its heads ``[t n / w, (t + 1) n / w)``; one held whole is the same on every rank."""
    gathered = collectives.all_gather_stacked(local, group)
    out, start = [], 0
    for w, n in counts:
        out.append(gathered[:, start:start + n].reshape(-1) if w > 1 else gathered[0, start:start + n])
        start += n
    return torch.cat(out)


def _parameter(model: nn.Module, name: str) -> Tensor:
    """``model``'s parameter ``name`` as registered (under tensor parallelism its attribute reads as a DTensor)."""
    owner, _, attr = name.rpartition(".")
    return model.get_submodule(owner)._parameters[attr]


def _names(paths: list[str]) -> str:
    shown = ", ".join(repr(p) for p in paths[:4])
    return shown + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
