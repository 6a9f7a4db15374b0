"""The set-up of :class:`LayerwiseDataParallel`, as free functions its ``__init__`` calls: its arguments checked,
the layout planned from :func:`layout_specs` (or one handed in checked to fit), what ``shard_parameters=True``
does not support refused, where a meta-device model is materialized, the first values broadcast from rank 0, and
the helpers that build its parts: the per-parameter records (Note [the per-parameter record] in
``engine/param_records.py``), the expert buckets each layer's pre-hook gathers (Note [conditional experts] in
``engine/data_parallel.py``) and the callbacks the parts hold.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch
import torch.distributed as dist
from torch import nn

from . import collectives, read_guard
from .buffers import Bucket, FlatBuffer, allocate, free, view_of
from .grad_records import GradRecord, GradUnit
from .param_records import ParamRecord, ParamRecords
from .process_groups import ProcessGroups, Ranks
from .read_guard import READ_GUARDS
from ..experts import marked_containers
from ..layout import DEFAULT_BUCKET_SIZE, Layout, ParamSpec, is_bucket_size, param_specs, plan_layout
from ..optim.matrices import matrix_shapes, matrix_views
from .tensor_parallel import spec_of


def check_arguments(bucket_size, prefetch_depth, param_read_guard) -> None:
    """The wrapper's own arguments, before anything is built."""
    if not is_bucket_size(bucket_size):
        raise ValueError(f"bucket_size={bucket_size!r} must be a positive number of elements, "
                         f"e.g. {DEFAULT_BUCKET_SIZE}, or 'auto'.")
    if not isinstance(prefetch_depth, int) or prefetch_depth < 1:
        raise ValueError(f"prefetch_depth={prefetch_depth!r} must be an integer >= 1 "
                         "(1 overlaps one bucket's all-gather with the module before it).")
    if param_read_guard not in READ_GUARDS:
        raise ValueError(f"param_read_guard={param_read_guard!r}: use 'wait' (reads wait for their all-gather), "
                         "'strict' (such reads raise, for debugging) or 'off' (stale reads, measurements only).")


def layout_specs(module: nn.Module, elementwise: Callable[[str, nn.Parameter], bool] | None = None,
                 expert: Callable[[str, nn.Parameter], bool] | None = None) -> list[ParamSpec]:
    """The specs the wrapper plans ``module`` from; a layout handed to the wrapper must be planned from these.

    ``elementwise`` may split only contiguous parameters: a piece is a range of the parameter's storage, cut
    and joined in checkpoints as a range of its logical elements, and the two agree only for a contiguous
    parameter (Note [memory format] in ``engine/buffers.py``)."""
    if elementwise is not None:
        user_elementwise = elementwise
        elementwise = lambda name, p: p.is_contiguous() and user_elementwise(name, p)  # noqa: E731
    views = matrix_views(module)

    def matrices(name: str, p: nn.Parameter) -> tuple[tuple[int, int], ...] | None:
        tp = spec_of(p)
        if tp is not None and tp.shard_dim is not None and p.ndim == 2:
            # A tensor-parallel shard: Newton-Schulz runs on the whole matrix (Note [tensor-parallel exchange] in
            # engine/tp_exchange.py), so the layout balances the whole matrix's cost, not the shard's.
            return (tuple(tp.shape),)
        shapes = matrix_shapes(p.shape, views[id(p)]) if id(p) in views else []
        return tuple(shapes) if len(shapes) > 1 else None  # one matrix: the cost's own (shape[0], rest) rule

    return param_specs(module, expert=expert, elementwise=elementwise, matrices=matrices)


def plan_or_check_layout(specs: list[ParamSpec], layout: Layout | None, ranks: Ranks, bucket_size: int,
                         cost: Callable[[ParamSpec], float], follow_layers: bool) -> Layout:
    """The layout planned here for the owner group, or the one handed in, checked to fit."""
    r = ranks
    if layout is None:
        return plan_layout(specs, r.owner_group_size, bucket_size, cost, expert_group_size=r.expert_group_size,
                           follow_layers=follow_layers, replicas=r.replicas, expert_replicas=r.expert_replicas)
    _check_layout(layout, specs, r.owner_group_size, bucket_size, r.expert_group_size, r.replicas, r.expert_replicas)
    return layout


def _check_layout(layout: Layout, specs: list[ParamSpec], owner_group_size: int, bucket_size: int,
                  expert_group_size: int | None, replicas: int = 1, expert_replicas: int = 1) -> None:
    """A layout handed in (planned once, by the caller) must fit this module, these groups and this bucket size."""
    shapes = {s.name: s.shape for s in specs}
    planned = {n: slot.shape for n, slot in layout.params.items()}
    whole = {s.name for s in specs if not s.elementwise}
    split_whole = sorted(n for n, slot in layout.params.items() if slot.split and n in whole)
    kinds = {s.name: s.kind for s in specs}
    other_kind = sorted(n for n, slot in layout.params.items()
                        if n in kinds and layout.buffers[slot.buffer].kind != kinds[n])
    expert_ranks = sorted({b.shards for b in layout.buffers if b.kind == "expert"} - {expert_group_size or owner_group_size})
    g = layout.group_size
    problem = (f"planned for {g} ranks per owner group, not {owner_group_size}" if g != owner_group_size else
               f"shared among {layout.replicas} owner groups, not {replicas}" if layout.replicas != replicas else
               f"shared among {layout.expert_replicas} expert owner groups, not {expert_replicas}"
               if layout.expert_replicas != expert_replicas and any(b.kind == "expert" for b in layout.buffers) else
               f"planned with bucket_size={layout.bucket_size}, not {bucket_size}"
               if layout.bucket_size != bucket_size else
               f"planned for other parameters ({sorted(set(planned) ^ set(shapes))[:3]} differ, or their shapes)"
               if planned != shapes else
               f"splits {split_whole[:3]}, which this wrapper owns whole" if split_whole else
               f"planned with {other_kind[:3]} in buffers of another kind (expert or dense)" if other_kind else
               f"planned with expert buffers over {expert_ranks[0]} ranks, not {expert_group_size or owner_group_size}"
               if expert_ranks else None)
    if problem is not None:
        raise ValueError(f"LayerwiseDataParallel(layout=...) does not fit: the layout was {problem}. Plan it with "
                         "lightning_layerwise.engine.wrapper_setup.layout_specs(module, ...) for these process "
                         "groups, or pass layout=None to plan here.")


def check_sharding(param_read_guard: str, named: dict[str, nn.Parameter], trainable: dict[nn.Parameter, str]) -> None:
    """What ``shard_parameters=True`` does not support yet raises before anything is built."""
    unguardable = [n for p, n in trainable.items() if not read_guard.can_guard(p)]
    problem = (
        "with param_read_guard='off': a read of a freed parameter would read freed memory; use 'wait'"
        if param_read_guard == "off" else
        f"with parameters of class {type(named[unguardable[0]]).__name__} ({unguardable[:3]}), not nn.Parameter: "
        "their reads cannot be made to gather their bucket" if unguardable else None)
    if problem is not None:
        raise ValueError(f"shard_parameters=True is not supported {problem}.")


def materialize_device(device: torch.device | None, group: dist.ProcessGroup | None) -> torch.device:
    """Where a model built on the meta device is materialized: ``device``, else the current CUDA device under NCCL,
    else the CPU."""
    if device is not None:
        return torch.device(device)
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_from_rank0(module: nn.Module, layout: Layout, flat_buffers: list[FlatBuffer],
                         in_layout: Collection[nn.Parameter], expert_names: Collection[str], expert_parallel_size: int,
                         groups: ProcessGroups) -> None:
    """Every rank starts from rank 0's values of ``flat_buffers`` (none: the parameters in the layout were
    broadcast bucket by bucket already, Note [meta-device models]), of the parameters not ``in_layout`` and of the
    module's buffers; expert parameters from the first rank holding the same experts (Note [expert parallelism]
    in ``engine/process_groups.py``)."""
    group = groups.dp
    if group is None:
        return
    experts = expert_parallel_size > 1
    expert_buffers = {i for i, plan in enumerate(layout.buffers) if experts and plan.kind == "expert"}
    frozen = [(n, p) for n, p in module.named_parameters() if p not in in_layout]
    dense = [flat.params for i, flat in enumerate(flat_buffers) if i not in expert_buffers]
    dense += [p.data for n, p in frozen if not (experts and n in expert_names)]
    dense += [b for b in module.buffers()]
    expert = [flat.params for i, flat in enumerate(flat_buffers) if i in expert_buffers]
    expert += [p.data for n, p in frozen if experts and n in expert_names]
    with torch.no_grad():
        collectives.broadcast_tensors(dense, group)
        if expert:
            collectives.broadcast_tensors(expert, groups.expert_dp)


def expert_buckets_by_layer(module: nn.Module, records: ParamRecords, buckets: list[Bucket],
                            every: bool) -> dict[nn.Module, list[Bucket]]:
    """The expert buckets of each layer holding a marked expert container (``llw.mark_experts``): its
    parent, which runs on every rank whichever experts its tokens reach. ``every``: every expert bucket must
    be in a marked container (sharded parameters). Note [conditional experts] in ``engine/data_parallel.py``."""
    layers: dict[nn.Module, list[Bucket]] = {}
    for path, container in marked_containers(module).items():
        parent = module.get_submodule(path.rpartition(".")[0]) if path else module
        held = {id(r.bucket): r.bucket for r in map(records.of, container.parameters()) if r is not None}
        layers.setdefault(parent, []).extend(b for b in held.values() if b.expert)
    unmarked = sorted({b.name for b in buckets if b.expert}
                      - {b.name for routed in layers.values() for b in routed})
    if unmarked and every:
        raise ValueError(
            f"shard_parameters=True with expert parameters outside a container marked with llw.mark_experts "
            f"(buckets {unmarked[:3]}): their layer must gather them whichever experts its tokens reach. "
            "Mark each layer's expert container with llw.mark_experts(experts, num_experts=...).")
    return layers


def param_records(layout: Layout, buckets: list[Bucket], flat_buffers: list[FlatBuffer],
                  names: dict[nn.Parameter, str], rank_for: Callable[[str], int], sharded: bool) -> ParamRecords:
    """Every trained parameter's record (Note [the per-parameter record] in ``engine/param_records.py``): its bucket,
    its gradient record over its slot of the grad buffer (strided as the parameter, so the reduced gradient keeps its
    memory format: Note [memory format] in ``engine/buffers.py``), and what this rank steps of it. ``rank_for``:
    this rank's index among the owners of a parameter's pieces. A split parameter's piece here becomes a parameter
    of its own viewing the param buffer (Note [pieces] in ``engine/data_parallel.py``). With ``sharded``
    parameters (Note [sharded parameters] in ``engine/buffers.py``) local gradients go to the full buffer, and what
    this rank steps is handed its slot of the bucket's shard."""
    bucket_of = {p: b for b in buckets for p in b.params}
    views = _full_gradient_views(buckets, layout, names) if sharded else {}
    records = []
    for p, name in names.items():
        slot, bucket = layout.params[name], bucket_of[p]
        if sharded:
            params_of, grads_of, base = bucket.param.shard, bucket.grad.shard, bucket.start + bucket.shard[0]
        else:
            flat = flat_buffers[slot.buffer]
            views[p] = view_of(flat.grads, slot, like=p)
            params_of, grads_of, base = flat.params, flat.grads, 0
        gradient = GradRecord(p, views[p], bucket)
        unit = None
        if not slot.split:
            if slot.owner == rank_for(name):
                stepped = view_of(grads_of, slot, like=p, offset=slot.offset - base) if sharded else views[p]
                unit = GradUnit(p, p, stepped, bucket, gradient)
        elif (piece := slot.piece_of(rank_for(name))) is not None:
            begin, end = slot.offset + piece.start - base, slot.offset + piece.stop - base
            unit = GradUnit(p, nn.Parameter(params_of[begin:end], requires_grad=p.requires_grad), grads_of[begin:end],
                            bucket, gradient, split=True, piece=piece)
        records.append(ParamRecord(p, name, slot, bucket, gradient, unit))
    return ParamRecords(records)


def _full_gradient_views(buckets: list[Bucket], layout: Layout,
                         param_names: dict[nn.Parameter, str]) -> dict[nn.Parameter, torch.Tensor]:
    """Each parameter's slot of its bucket's full gradient buffer, strided as the parameter, made bucket by
    bucket (a view of a freed storage cannot be made; the buffer is freed again at once)."""
    views = {}
    for bucket in buckets:
        allocate(bucket.grad.data)
        for p in bucket.params:
            slot = layout.params[param_names[p]]
            views[p] = view_of(bucket.grad.data, slot, like=p, offset=slot.offset - bucket.start)
        free(bucket.grad.data)
    return views
