"""Marking the expert parameters of a mixture-of-experts model (Note [expert parallelism] in
``engine/process_groups.py``).

A model with expert parallelism builds, on each rank, only its *local* experts: with
``expert_parallel_size=E`` and ``n`` experts, the rank at position ``r`` of its
expert-parallel group holds experts ``[r * n/E, (r + 1) * n/E)``. It puts them in one
container per layer and marks that container once::

    self.experts = llw.mark_experts(nn.ModuleList(make_expert(i) for i in local_ids), num_experts=n)

Grouped experts (torchtitan's ``GroupedExperts``, DeepSeek-V3 and recent Hugging Face
MoE code) keep the local experts stacked in ``[local, ...]`` parameters of one module;
that module is marked the same way, and its parameters' leading dimension is the local
expert count (Muon orthogonalizes each expert's matrix: Note [matrix views] in
``optim/matrices.py``)::

    self.experts = llw.mark_experts(GroupedExperts(local, d, hidden), num_experts=n)

Checkpoints name an expert of a ``ModuleList`` by its global index; a stack has no such
name yet, so with ``expert_parallel_size > 1`` a checkpoint of grouped experts is refused
before anything is written (``SessionCheckpoints.check_save``).

Every parameter under a marked container is an expert parameter: it gets a buffer
of its own, reduced and gathered over the expert data-parallel group. The marks
are checked on every rank before any work (:func:`check_expert_marks`).
"""

from __future__ import annotations

from torch import nn

EXPERTS_ATTRIBUTE = "llw_num_experts"


def mark_experts(experts: nn.Module, num_experts: int) -> nn.Module:
    """Marks ``experts`` (the local experts of one MoE layer) as holding ``len(experts)`` of ``num_experts``."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"mark_experts(num_experts={num_experts!r}): pass the layer's total number of experts "
                         "(over every expert-parallel rank), an integer >= 1.")
    if not isinstance(experts, nn.Module):
        raise ValueError(f"mark_experts expects the container of the local experts (nn.ModuleList) or a module of "
                         f"grouped experts, got {type(experts).__name__}.")
    if not isinstance(experts, _CONTAINERS):
        sizes = {tuple(p.shape[:1]) for p in experts.parameters()}
        if len(sizes) != 1 or sizes == {()}:
            raise ValueError(f"mark_experts({type(experts).__name__}): a module of grouped experts keeps its local "
                             "experts stacked along the first dimension of every parameter, but its parameters' "
                             f"first dimensions are {sorted(sizes)}; mark the nn.ModuleList of experts instead.")
    setattr(experts, EXPERTS_ATTRIBUTE, num_experts)
    return experts


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def grouped_expert_paths(module: nn.Module) -> list[str]:
    """The marked modules of ``module`` that stack their local experts in their parameters (grouped experts)."""
    return [path for path, m in marked_containers(module).items() if not isinstance(m, _CONTAINERS)]


def local_expert_count(container: nn.Module) -> int:
    """How many experts a marked container holds on this rank: its length, or the leading dimension of a grouped
    module's parameters."""
    if isinstance(container, _CONTAINERS):
        return len(container)
    return next(iter(container.parameters())).shape[0]


def marked_containers(module: nn.Module) -> dict[str, nn.Module]:
    """The marked expert containers of ``module`` by their path."""
    return {name: m for name, m in module.named_modules() if hasattr(m, EXPERTS_ATTRIBUTE)}


def expert_parameter_names(module: nn.Module) -> frozenset[str]:
    """Names (as ``named_parameters`` gives them) of the parameters under a marked container."""
    prefixes = [f"{path}." if path else "" for path in marked_containers(module)]
    return frozenset(n for n, _ in module.named_parameters() if any(n.startswith(p) for p in prefixes))


def check_expert_marks(module: nn.Module, expert_parallel_size: int) -> None:
    """Raises if a marked layer's expert count is not divisible by ``expert_parallel_size`` or a rank
    holds another number of local experts than ``num_experts / expert_parallel_size``."""
    for path, container in marked_containers(module).items():
        total = getattr(container, EXPERTS_ATTRIBUTE)
        if total % expert_parallel_size:
            raise ValueError(f"the MoE layer {path!r} has {total} experts, which expert_parallel_size="
                             f"{expert_parallel_size} does not divide; choose an expert_parallel_size that divides "
                             f"{total}.")
        local, per_rank = local_expert_count(container), total // expert_parallel_size
        if local != per_rank:
            raise ValueError(f"the MoE layer {path!r} holds {local} local experts on this rank, but {total} experts "
                             f"over expert_parallel_size={expert_parallel_size} ranks is {per_rank} per rank; build "
                             "only this rank's experts (strategy.expert_parallel_rank says which).")


def expert_key_map(module: nn.Module, expert_rank: int) -> dict[str, str]:
    """``state_dict`` key of every tensor under a marked container -> its name in a model holding every
    expert: local expert ``j`` of the rank at expert-parallel position ``expert_rank`` is expert
    ``expert_rank * len(container) + j`` (Note [expert parallelism] in ``engine/process_groups.py``).

    Checkpoints use these global names, so they reshard across expert-parallel sizes.
    """
    mapping = {}
    keys = list(module.state_dict(keep_vars=True))
    for path, container in marked_containers(module).items():
        prefix = f"{path}." if path else ""
        first = expert_rank * local_expert_count(container)
        for key in keys:
            if not key.startswith(prefix):
                continue
            index, dot, rest = key[len(prefix):].partition(".")
            if dot and index.isdigit():
                mapping[key] = f"{prefix}{first + int(index)}.{rest}"
    return mapping


def expert_key_predicate(module: nn.Module):
    """Whether a ``state_dict`` key (local or global) names a tensor of some expert of a marked layer."""
    prefixes = tuple(f"{path}." if path else "" for path in marked_containers(module))

    def is_expert_key(key: str) -> bool:
        for prefix in prefixes:
            if key.startswith(prefix) and key[len(prefix):].partition(".")[0].isdigit():
                return True
        return False

    return is_expert_key
