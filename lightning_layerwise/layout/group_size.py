"""Choosing the owner group size (and the experts'): the smallest group whose plan pads
little, judged from planned layouts (Note [choosing the owner group size]).

Note [choosing the owner group size]
    With replica sharing (Note [replica sharing] in ``layout/sharing.py``) every element is stepped by one
    rank of the world whatever ``g`` is, so the optimizer state is about ``1/dp``
    of the model per rank and Newton–Schulz runs once per matrix for every ``g``.
    What ``g`` still decides is padding and where the traffic goes: the buffers
    are planned for ``g`` ranks (whole matrices pad once a size class has fewer
    than ``g``), the reduce-scatter and all-gather run inside the group, and the
    rooted reduces and broadcasts across the ``dp / g`` replicas. So the planner takes the
    largest ``g`` that divides the ranks per node (the in-group collectives stay on
    the node's fast links, and fewer replicas mean shorter rooted pipelines across
    nodes) whose buffers exceed the unpadded parameters by at most
    :data:`PADDING_TOLERANCE`, trying sizes from the largest down; if none does,
    the one whose busiest rank holds the fewest bytes (:func:`estimated_rank_bytes`:
    buffers with padding plus that rank's optimizer state). On one node
    (``dp <= ranks_per_node``) it keeps one group. ``ranks_per_node=None`` assumes
    :data:`DEFAULT_RANKS_PER_NODE`. With one rank per node no group can stay inside a
    node, and a group of one would make every collective a rooted one across the
    replicas, so one group of all ranks is tried first there, then groups of one.
    Expert parameters (``kind="expert"``, with
    ``expert_dp_size``) are planned inside their expert data-parallel group whatever ``g``
    is (their owner group size chosen by :func:`choose_expert_group_size`), so the
    choice weighs the dense parameters alone, as the wrapper then plans them. Pure:
    every rank computes the same answer.
"""

from __future__ import annotations

from typing import Callable, Sequence

from .packing import _validate, plan_layout
from .plan import DEFAULT_BUCKET_SIZE, Layout, ParamSpec, aligned, newton_schulz_cost

DEFAULT_STATE_BYTES = 8


"""Optimizer state per stepped element assumed by :func:`choose_owner_group_size`: AdamW's two
float32 moments (Muon keeps one; float32 masters of ``bf16-true`` add four)."""


def estimated_rank_bytes(layout: Layout, grad_bytes: int | None = None,
                         state_bytes: int = DEFAULT_STATE_BYTES) -> int:
    """Bytes one rank holds for ``layout``: the param and grad buffers (padding included) and the
    optimizer state of the busiest rank's elements. ``grad_bytes``: per gradient element
    (default: the parameter's)."""
    buffers = sum(b.numel * (b.dtype.itemsize + (grad_bytes or b.dtype.itemsize)) for b in layout.buffers)
    # Dense owners are positions in the owner group, expert owners in the expert data-parallel group
    # (Note [expert parallelism] in ``engine/process_groups.py``): each kind's busiest position, added, bounds a rank's
    # state.
    by_kind: dict[str, dict[int, int]] = {}
    kinds = {name: plan.kind for plan in layout.buffers for bucket in plan.buckets for name in bucket.params}
    for name, slot in layout.params.items():
        owners = by_kind.setdefault(kinds[name], {})
        for piece in slot.pieces:
            owners[piece.owner] = owners.get(piece.owner, 0) + piece.numel
    return buffers + sum(max(owners.values()) for owners in by_kind.values() if owners) * state_bytes


DEFAULT_RANKS_PER_NODE = 8


"""Ranks per node :func:`choose_owner_group_size` assumes when it is not told."""


PADDING_TOLERANCE = 0.01


"""Buffer growth (padding beyond alignment) :func:`choose_owner_group_size` accepts for a larger owner group."""


def choose_owner_group_size(specs: Sequence[ParamSpec], dp: int, bucket_size: int = DEFAULT_BUCKET_SIZE,
                            cost: Callable[[ParamSpec], float] = newton_schulz_cost, ranks_per_node: int | None = None,
                            grad_bytes: int | None = None, state_bytes: int = DEFAULT_STATE_BYTES,
                            expert_dp_size: int | None = None, follow_layers: bool = False) -> tuple[int, Layout]:
    """The owner group size ``g`` (a divisor of ``dp``) and its layout, shared among the ``dp / g`` groups
    (Note [choosing the owner group size])."""
    specs = list(specs)
    _validate(specs, dp, bucket_size, what="dp")
    ge = choose_expert_group_size(specs, expert_dp_size, bucket_size, cost) if expert_dp_size is not None else None
    shared = {"expert_group_size": ge, "expert_replicas": expert_dp_size // ge if ge else 1,
              "follow_layers": follow_layers}
    per_node = ranks_per_node or DEFAULT_RANKS_PER_NODE
    if dp <= per_node:
        return dp, plan_layout(specs, dp, bucket_size, cost, **shared)
    expert_groups = expert_dp_size is not None
    dense = [s for s in specs if not (expert_groups and s.kind == "expert")]
    unpadded = sum(aligned(s.numel) for s in dense)

    def dense_elements(layout: Layout) -> int:
        return sum(b.numel for b in layout.buffers if not (expert_groups and b.kind == "expert"))

    planned: dict[int, tuple[int, Layout]] = {}
    for g in _group_candidates(dp, per_node):
        layout = plan_layout(specs, g, bucket_size, cost, replicas=dp // g, **shared)
        if dense_elements(layout) <= (1 + PADDING_TOLERANCE) * unpadded:
            return g, layout
        planned[g] = (estimated_rank_bytes(layout, grad_bytes, state_bytes), layout)
    g = min(planned, key=lambda k: (planned[k][0], -k))
    return g, planned[g][1]


def _group_candidates(dp: int, per_node: int) -> list[int]:
    """Owner group sizes :func:`choose_owner_group_size` tries, in order (Note [choosing the owner group size])."""
    if per_node == 1:
        return [dp, 1]
    return sorted((g for g in range(1, dp + 1) if dp % g == 0 and per_node % g == 0), reverse=True)


def choose_expert_group_size(specs: Sequence[ParamSpec], expert_dp_size: int, bucket_size: int = DEFAULT_BUCKET_SIZE,
                             cost: Callable[[ParamSpec], float] = newton_schulz_cost) -> int:
    """The owner group size for the expert buffers inside an expert data-parallel group of ``expert_dp_size``
    ranks (Note [expert owner groups] in ``engine/process_groups.py``): the largest divisor of ``expert_dp_size``
    whose expert buffers exceed the unpadded expert parameters by at most :data:`PADDING_TOLERANCE`, else the one
    that pads least. The experts' own rule of Note [choosing the owner group size]: their replicas share the
    stepping, so only padding is at stake. Pure."""
    experts = [s for s in specs if s.kind == "expert"]
    if not experts:
        return expert_dp_size
    unpadded = sum(aligned(s.numel) for s in experts)
    planned = {}
    for ge in sorted((d for d in range(1, expert_dp_size + 1) if expert_dp_size % d == 0), reverse=True):
        total = plan_layout(experts, ge, bucket_size, cost).total_numel
        if total <= (1 + PADDING_TOLERANCE) * unpadded:
            return ge
        planned[ge] = total
    return min(planned, key=lambda d: (planned[d], -d))
