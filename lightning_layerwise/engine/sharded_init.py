"""The shards of sharded parameters, built at set-up: bucket by bucket for a model built on its device
(:func:`shard_bucket_by_bucket`), each parameter as soon as its value is final for one built on the meta device
(:func:`materialize_sharded`).

Note [publishing parameters one by one]
    While a meta-device model is materialized (Note [meta-device models] in ``materialize.py``), each layout
    parameter gets memory of its own when its value starts (:meth:`ParameterPublisher.memory_for`). Once final
    (:meth:`ParameterPublisher.final`) it is broadcast from the first rank of its bucket's group (every replica
    holds rank 0's values), the part of it inside this rank's shard is copied there and its memory is freed.
    When a bucket's last parameter is published, a full buffer is made, the shard copied in and the parameters
    pointed at it or at the shard (``cut_shard``), and the buffer freed. A rank so holds its shards, the
    parameters being initialized, and for a moment one bucket: however the model orders its init (an
    ``apply(_init_weights)`` at the end of ``__init__``, a re-init by name of weights spread over every bucket),
    no bucket waits, full, for its last parameter. Every rank publishes in the same order (the replay's op
    order, or module order), so the broadcasts match.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch import nn

from . import collectives
from .buffers import Bucket, FlatBuffer, allocate_shards, cut_shard, is_dense_permutation, single_device, view_of
from .materialize import materialize
from .process_groups import ProcessGroups
from ..layout import Layout

Dtypes = list[tuple[torch.dtype, torch.dtype]]
"""Each layout buffer's parameter and gradient dtypes."""


def shard_bucket_by_bucket(layout: Layout, buckets: list[Bucket], dtypes: Dtypes, named: dict[str, nn.Parameter],
                           names: list[str], stepped: set[str], groups: ProcessGroups) -> list[FlatBuffer]:
    """Sharded parameters of a model built on its device: each bucket is filled from its parameters ``names``,
    broadcast from the first rank of its group (so every replica holds the same values), cut to this rank's shard
    and freed in turn, so a rank holds the model as built plus one bucket (Note [sharded parameters] in
    ``engine/buffers.py``). ``stepped``: the parameters this rank steps whole. Returns the shards' buffers."""
    device = single_device([named[n] for n in names], "the trainable parameters")
    relaid = [n for n in names if not named[n].is_contiguous() and not is_dense_permutation(named[n])]
    if relaid:
        warnings.warn(f"parameters {relaid[:3]} have strides with gaps or overlaps; strategy='layerwise' keeps "
                      "them contiguous in its buffers (Note [memory format]).", stacklevel=5)
    plans = [bp for plan in layout.buffers for bp in plan.buckets]  # build_buckets' order
    sharded = allocate_shards(layout, buckets, dtypes, device)
    with torch.no_grad():
        for bucket, bp in zip(buckets, plans):
            full = torch.zeros(bp.numel, dtype=dtypes[bucket.buffer][0], device=device)
            for name in bp.params:
                p, slot = named[name], layout.params[name]
                view_of(full, slot, like=p, offset=slot.offset - bp.start).copy_(p.detach())
            collectives.broadcast_tensors([full], groups.expert_dp if bucket.expert else groups.dp)
            cut_shard(bucket, bp, layout, named, stepped, full)  # the parameters' own memory goes
    return sharded


def materialize_sharded(module: nn.Module, layout: Layout, buckets: list[Bucket], dtypes: Dtypes,
                        named: dict[str, nn.Parameter], stepped: set[str], device: torch.device,
                        groups: ProcessGroups) -> tuple[list[FlatBuffer], dict[int, nn.Parameter]]:
    """A meta-device model with sharded parameters (Note [meta-device models] in ``engine/materialize.py``):
    each parameter is published into the shards as soon as its value is final, and each bucket pointed at its
    shard once complete (Note [publishing parameters one by one]). Returns the buffers of the shards and the
    replaced parameters (``id`` of each meta parameter -> the parameter that replaced it)."""
    plans = [bp for plan in layout.buffers for bp in plan.buckets]  # build_buckets' order
    sharded = allocate_shards(layout, buckets, dtypes, device)
    publisher = ParameterPublisher(
        layout, buckets, {id(b): bp for b, bp in zip(buckets, plans)}, {id(p): n for n, p in named.items()},
        [d for d, _ in dtypes], stepped, device,
        group_of=lambda bucket: groups.expert_dp if bucket.expert else groups.dp)
    replaced = materialize(module, device, publisher.final, publisher.memory_for)
    publisher.check_complete()
    for bucket in buckets:
        bucket.params = [replaced.get(id(p), p) for p in bucket.params]
    return sharded, replaced


class ParameterPublisher:
    """Publishes a meta-device model's layout parameters into their buckets' shards, one by one (Note
    [publishing parameters one by one]). ``plans``: each bucket's plan (``id(bucket)``); ``names``: ``id`` of each
    meta parameter -> its name; ``group_of(bucket)``: the group its values are broadcast over."""

    def __init__(self, layout, buckets: list[Bucket], plans: dict[int, object], names: dict[int, str],
                 dtypes: list[torch.dtype], stepped_whole: set[str], device: torch.device,
                 group_of: Callable[[Bucket], object]) -> None:
        self.layout, self.plans, self.names, self.dtypes = layout, plans, names, dtypes
        self.stepped_whole, self.device, self.group_of = stepped_whole, device, group_of
        self.bucket_of = {name: b for b in buckets for name in plans[id(b)].params}
        self.left = {id(b): len(plans[id(b)].params) for b in buckets}
        self.published: dict[str, nn.Parameter] = {}
        for bucket in buckets:
            bucket.param.shard.zero_()  # the padding between slots

    def memory_for(self, old: nn.Parameter) -> torch.Tensor:
        """Memory of its own for a meta parameter's value, strided as it (a dense permutation stays one)."""
        return torch.empty_like(old, device=self.device)

    def final(self, old: nn.Parameter, new: nn.Parameter) -> None:
        """``new`` holds ``old``'s final value: broadcast, its part of the shard kept, its memory freed."""
        name = self.names.get(id(old))
        bucket = self.bucket_of.get(name)
        if bucket is None:  # frozen: outside the layout, broadcast with the module's buffers
            return
        bp, slot = self.plans[id(bucket)], self.layout.params[name]
        flat = new.detach()
        if not flat.is_contiguous():  # the slot keeps the parameter's memory order (Note [memory format])
            flat = torch.empty(slot.numel, dtype=new.dtype, device=self.device)
            view_of(flat, slot, like=new, offset=0).copy_(new.detach())
        flat = flat.reshape(-1)
        collectives.broadcast_tensors([flat], self.group_of(bucket))
        begin, end = bucket.shard
        inside = slot.offset - bp.start
        low, high = max(inside, begin), min(inside + slot.numel, end)
        if low < high:
            bucket.param.shard[low - begin:high - begin].copy_(flat[low - inside:high - inside])
        new.detach().untyped_storage().resize_(0)  # its value lives on in the shards
        self.published[name] = new
        self.left[id(bucket)] -= 1
        if self.left[id(bucket)] == 0:
            full = torch.empty(bp.numel, dtype=self.dtypes[bucket.buffer], device=self.device)
            full[begin:end].copy_(bucket.param.shard)
            cut_shard(bucket, bp, self.layout, self.published, self.stepped_whole, full)

    def check_complete(self) -> None:
        missing = [n for n, b in self.bucket_of.items() if self.left[id(b)] and n not in self.published]
        if missing:
            raise RuntimeError(f"parameters {missing[:3]} were never given a value while the meta-device model was "
                               "materialized (Note [publishing parameters one by one]).")
