"""Tensor parallelism under the layer-wise engine: DTensor parameters trained as their local tensors.

Note [tensor-parallel mesh]
    With ``tensor_parallel_size=T`` the ``world`` ranks form a 2-D mesh ``(D, T)`` named
    ``("data_parallel", "tensor_parallel")``, laid out as Lightning's ``ModelParallelStrategy`` lays it out:
    rank ``d * T + t`` is data-parallel position ``d``, tensor-parallel position ``t``, so the ``T`` ranks of
    one tensor-parallel group are consecutive (one node). The module's ``configure_model`` applies
    ``parallelize_module`` over ``mesh["tensor_parallel"]`` as it would under ``ModelParallelStrategy``, and
    DTensor keeps all of tensor parallelism's own communication (activations, replicated gradients). The
    layer-wise engine runs over the data-parallel dimension only: every process group of
    :class:`~lightning_layerwise.ProcessGroups` is built inside one tensor-parallel position (the ranks
    ``t, t + T, t + 2T``...), so the layout, the reduce-scatters and the all-gathers are those of a run of
    ``D`` ranks, one such run per tensor-parallel position.

Note [local parameters]
    The engine lays out, reduces, gathers and steps plain tensors. So each DTensor parameter is replaced, under
    its own name, by an ``nn.Parameter`` holding its local tensor (the same storage), and the module's class is
    swapped for a subclass (as ``torch.nn.utils.parametrize`` does) whose attribute of that name returns
    ``DTensor.from_local(local, mesh, placements)`` at each read. So the module's forward, and any code that reads
    ``module.weight``, computes with the DTensor as before, while ``named_parameters()``, the optimizers, the
    layout and the checkpoints see the local tensors. ``from_local``'s backward redistributes the gradient to
    the parameter's placements (a partial sum becomes the replicated gradient), so the local gradient is the one
    the DTensor parameter would have had. Each read is a view of the local parameter: the read guard sees it
    (Note [read guard] in ``engine/read_guard.py``) and a read never keeps a stale copy.

    Every trained parameter of the module gets a :class:`TensorParallelSpec`: its mesh, placements and global
    shape. A parameter that was not a DTensor is replicated over the tensor-parallel group: every rank of the
    group holds it whole, and computes the same gradient for it from the same batch.

Note [norms over the mesh]
    A gradient norm under tensor parallelism is the norm of the full gradient, as one process without it computes:
    each rank's data-parallel sum covers its tensor-parallel position's local tensors, so the sums of sharded
    parameters are added over the tensor-parallel group, and a replicated parameter (held whole by every rank of
    the group) is counted once. :func:`sum_over_mesh` does it with one all-reduce over the group of the sharded
    part; a maximum (the inf-norm) is taken over the group whole, since a replicated value is the same on every
    rank. Clipping, ``clip_grad_norm_(model.parameters(), ...)`` and Lightning's ``grad_norm`` go through it.

Note [identical layouts]
    Tensor parallelism shards a matrix evenly, so the ranks of one tensor-parallel group hold local tensors of
    the same shapes under the same names, and plan the same layout: data-parallel position ``d`` owns the same
    matrices in every tensor-parallel position. That is what lets the group orthogonalize each of them whole
    (Note [tensor-parallel exchange] in ``engine/tp_exchange.py``). An uneven shard (a dimension the group size
    does not divide) would break it, and is refused. The layout balances each shard at its whole matrix's
    Newton-Schulz cost (``layout_specs``), the work its owner's group does for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

DIM_NAMES = ("data_parallel", "tensor_parallel")

_SPECS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # local parameter (or its master) -> TensorParallelSpec
_CLASSES: dict[tuple[type, frozenset], type] = {}  # (module class, DTensor attribute names) -> swapped class


@dataclass(frozen=True)
class TensorParallelSpec:
    """How one trained parameter lies on the tensor-parallel mesh (Note [local parameters])."""

    mesh: Any
    """The 1-D tensor-parallel ``DeviceMesh``."""
    group: Any
    """Its process group."""
    placements: tuple
    """The DTensor placements; ``(Replicate(),)`` for a parameter that was not a DTensor."""
    shape: torch.Size
    """The global shape."""
    stride: tuple[int, ...]

    @property
    def shard_dim(self) -> Optional[int]:
        """The dimension sharded over the group, ``None`` where every rank holds the whole tensor."""
        placement = self.placements[0]
        return placement.dim % len(self.shape) if placement.is_shard() else None



def spec_of(tensor: torch.Tensor) -> Optional[TensorParallelSpec]:
    """The :class:`TensorParallelSpec` of a local parameter (or the float32 master stepped for it); ``None``
    outside tensor parallelism."""
    return _SPECS.get(tensor)


def share_spec(tensor: torch.Tensor, like: torch.Tensor) -> None:
    """``tensor`` (a master stepped in place of ``like``) lies on the mesh as ``like`` does."""
    spec = _SPECS.get(like)
    if spec is not None:
        _SPECS[tensor] = spec


def build_mesh(device_type: str, world_size: int, tensor_parallel_size: int):
    """The ``(data_parallel, tensor_parallel)`` mesh of Note [tensor-parallel mesh] (collective)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (world_size // tensor_parallel_size, tensor_parallel_size),
                            mesh_dim_names=DIM_NAMES)


def localize(module: nn.Module, tp_mesh, owner: str = "LayerwiseStrategy") -> dict[nn.Parameter, nn.Parameter]:
    """Replaces every DTensor parameter of ``module`` by a parameter holding its local tensor (Note [local
    parameters]) and gives every parameter its :class:`TensorParallelSpec`. Returns ``{DTensor parameter: local
    parameter}``, for optimizers made before (a parameter shared by several modules maps to one local one)."""
    from torch.distributed.tensor import DTensor, Replicate

    check_dtensor_parameters(module, tp_mesh, owner)
    group = tp_mesh.get_group()
    replaced: dict[nn.Parameter, nn.Parameter] = {}
    for mod in module.modules():
        names = [n for n, p in mod._parameters.items() if isinstance(p, DTensor)]
        for name in names:
            dt = mod._parameters[name]
            local = replaced.get(dt)
            if local is None:
                local = nn.Parameter(dt.to_local().detach(), requires_grad=dt.requires_grad)
                _SPECS[local] = TensorParallelSpec(tp_mesh, group, tuple(dt.placements), dt.shape, dt.stride())
                replaced[dt] = local
            mod._parameters[name] = local
        if names:
            # The reader looks its spec up here, not in the weak registry: a dict on the module is what
            # torch.compile traces through without a graph break.
            mod._tensor_parallel_specs = {name: _SPECS[mod._parameters[name]] for name in names}
            _swap_class(mod, frozenset(names))
    for p in module.parameters():
        if p not in _SPECS:
            _SPECS[p] = TensorParallelSpec(tp_mesh, group, (Replicate(),), p.shape, p.stride())
    return replaced


def check_dtensor_parameters(module: nn.Module, tp_mesh, owner: str) -> None:
    """Refuses, before anything changes, parameters this strategy cannot train under tensor parallelism: on the meta
    device, DTensors on another mesh (FSDP2's ``fully_shard`` over the data-parallel dimension), sharded twice, or
    sharded unevenly."""
    from torch.distributed.tensor import DTensor

    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        FSDPModule = ()
    sharded = [name or type(module).__name__ for name, m in module.named_modules() if isinstance(m, FSDPModule)]
    if sharded:
        raise ValueError(
            f"{owner}: {sharded[0]!r} was passed to fully_shard; under tensor_parallel_size the strategy shards "
            "over the data-parallel dimension itself. Apply only tensor parallelism in configure_model "
            "(parallelize_module over self.device_mesh['tensor_parallel']), drop fully_shard, and pass "
            "shard_parameters=True to shard parameters.")
    for name, p in module.named_parameters():
        if p.is_meta:
            raise ValueError(
                f"{owner}: parameter {name!r} is on the meta device (trainer.init_module(empty_init=True)); a model "
                "built on the meta device is not materialized under tensor_parallel_size > 1 yet. Build it on the "
                "device (empty_init=False).")
        if not isinstance(p, DTensor):
            continue
        mesh = p.device_mesh
        if mesh.ndim != 1 or mesh.mesh_dim_names != ("tensor_parallel",):
            raise ValueError(
                f"{owner}: parameter {name!r} is a DTensor on the mesh {mesh.mesh_dim_names} (placements "
                f"{tuple(p.placements)}); under tensor_parallel_size the strategy shards over the data-parallel "
                "dimension itself. Apply only tensor parallelism in configure_model (parallelize_module over "
                "self.device_mesh['tensor_parallel']), drop fully_shard, and pass shard_parameters=True to shard "
                "parameters.")
        placement = p.placements[0]
        if placement.is_partial():
            raise ValueError(f"{owner}: parameter {name!r} has a Partial placement; a parameter must be Shard or "
                             "Replicate on the tensor-parallel mesh.")
        if placement.is_shard():
            size = mesh.size()
            dim = placement.dim % p.ndim
            if p.shape[dim] % size:
                raise ValueError(
                    f"{owner}: parameter {name!r} of shape {tuple(p.shape)} is sharded over dimension {dim} by "
                    f"{size} tensor-parallel ranks, which does not divide {p.shape[dim]}; every rank of a "
                    "tensor-parallel group must hold a shard of the same shape (Note [identical layouts]). Pick a "
                    f"tensor_parallel_size dividing {p.shape[dim]}, or pad that dimension.")


def tensor_parallel_group(params) -> Any:
    """The tensor-parallel group of a run whose parameters are ``params`` (``None`` outside tensor parallelism).
    :func:`localize` gives every parameter of the module a spec, so the first one answers: a norm without tensor
    parallelism, every step, looks at one parameter, not all of them."""
    first = next(iter(params), None)
    spec = None if first is None else _SPECS.get(first)
    return None if spec is None else spec.group


def is_sharded(param: torch.Tensor) -> bool:
    """Whether ``param`` is a shard of a tensor-parallel parameter (not held whole by its group)."""
    spec = _SPECS.get(param)
    return spec is not None and spec.shard_dim is not None


def sum_over_mesh(sharded: torch.Tensor, replicated: torch.Tensor, group) -> torch.Tensor:
    """``sharded`` summed over the tensor-parallel ``group`` plus ``replicated`` counted once (Note [norms over the
    mesh]); collective over the group."""
    import torch.distributed as dist

    total = sharded.clone()
    dist.all_reduce(total, group=group)
    return total + replicated


def check_tensor_parallel_optimizer(optimizer, elementwise_optimizers, owner: str) -> None:
    """Refuses an optimizer that would step shards of tensor-parallel matrices as if they were whole: anything but
    :class:`~lightning_layerwise.Muon` (which orthogonalizes them whole) or an element-wise optimizer (for which a
    shard is as good as the whole). Its parameters are the local ones (:func:`localize`)."""
    from ..optim.elementwise import elementwise_parameters
    from ..optim.muon import Muon

    if isinstance(optimizer, Muon):
        return
    elementwise = elementwise_parameters(optimizer, elementwise_optimizers)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p not in elementwise and is_sharded(p):
                spec = _SPECS[p]
                raise ValueError(
                    f"{owner}(tensor_parallel_size=...): {type(optimizer).__name__} is given shards of "
                    f"tensor-parallel parameters (one of shape {tuple(spec.shape)}, placements {spec.placements}) "
                    "and is not known to update element-wise, so it would step each shard as a whole tensor. Use "
                    "lightning_layerwise.Muon (it orthogonalizes each matrix whole) or an element-wise optimizer "
                    "(AdamW, Adam, SGD...), or declare yours with elementwise_optimizers=[...].")


def _swap_class(module: nn.Module, names: frozenset) -> None:
    """Gives ``module`` a subclass of its class whose attributes ``names`` read as DTensors (Note [local
    parameters]); one subclass per (class, names), so modules of one kind still share a class."""
    cls = type(module)
    key = (cls, names)
    swapped = _CLASSES.get(key)
    if swapped is None:
        swapped = type(cls.__name__, (cls,), {n: property(_dtensor_reader(n)) for n in sorted(names)})
        swapped.__qualname__ = cls.__qualname__
        swapped.__module__ = cls.__module__
        _CLASSES[key] = swapped
    module.__class__ = swapped


def _dtensor_reader(name: str):
    def read(module: nn.Module):
        from torch.distributed.tensor import DTensor

        local = module._parameters[name]
        spec = module._tensor_parallel_specs[name]
        return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False, shape=spec.shape,
                                  stride=spec.stride)

    return read
