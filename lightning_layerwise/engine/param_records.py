"""What the engine knows of each trained parameter, in one place (Note [the per-parameter record]).

Note [the per-parameter record]
    Every parameter in the layout has one :class:`ParamRecord`: its name, its place in the layout, its bucket, its
    gradient record (:class:`~.grad_records.GradRecord`: its slot of the grad buffer and what arrived of it this
    accumulation) and what this rank steps of it (:class:`~.grad_records.GradUnit`: the parameter whole, or its
    piece of a split one, with the float32 master where there is one; ``None`` where another rank steps it). The
    wrapper builds the records once, after the buckets (``param_records`` in ``engine/wrapper_setup.py``), and
    hands the one :class:`ParamRecords` to its parts: the gradient side, the clipping lists, the module check, the
    replica check and the release. A question about a parameter, or about a tensor the optimizer holds in its place
    (a piece, a master), is asked of it: ``wrapper.records.of(tensor)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from .buffers import Bucket, ParamState
from .grad_records import GradRecord, GradUnit
from ..layout import ParamSlot

__all__ = ["ParamRecord", "ParamRecords"]


@dataclass(eq=False)
class ParamRecord:
    """One trained parameter, as the engine knows it (Note [the per-parameter record])."""

    param: nn.Parameter
    name: str
    slot: ParamSlot
    """Its place in the layout: buffer, bucket, offset, pieces."""
    bucket: Bucket
    """Its bucket (``bucket.expert``: reduced over its expert data-parallel group, Note [expert parallelism] in
    ``engine/process_groups.py``)."""
    gradient: GradRecord
    """Its gradient path and what arrived of it this accumulation."""
    unit: GradUnit | None
    """What this rank steps of it; ``None``: another rank steps all of it."""

    @property
    def owned(self) -> bool:
        """Whether this rank steps all of it."""
        return self.unit is not None and not self.unit.split

    @property
    def piece(self) -> nn.Parameter | None:
        """This rank's piece of it where it is split (Note [pieces] in ``engine/data_parallel.py``), else ``None``."""
        unit = self.unit
        return unit.tensor if unit is not None and unit.split else None

    @property
    def held(self) -> bool:
        """Whether this rank holds its values now: always, unless its bucket is sharded and freed and this rank
        does not step it whole (Note [sharded parameters] in ``engine/buffers.py``)."""
        return not self.bucket.sharded or self.owned or self.bucket.param.state is ParamState.READY


class ParamRecords:
    """Every trained parameter's record, in layout order, found by the parameter or by a tensor the optimizer holds
    in its place (this rank's piece, a master). Released (:meth:`release`) when the wrapper is, last."""

    def __init__(self, records: list[ParamRecord]) -> None:
        self._records = records
        self._by_param: dict[nn.Parameter, ParamRecord] = {r.param: r for r in records}
        self._by_stand_in: dict[torch.Tensor, ParamRecord] = {
            r.unit.tensor: r for r in records if r.unit is not None and r.unit.tensor is not r.param}
        """The tensors the optimizer holds in a parameter's place: this rank's pieces, and masters once set."""
        self.names: dict[nn.Parameter, str] = {r.param: r.name for r in records}
        """Each parameter's name, in layout order."""
        self.units: list[GradUnit] = [r.unit for r in records if r.unit is not None]
        """What this rank steps, in layout order (Note [gradient lifecycle] in ``engine/grad_sync.py``)."""

    def __iter__(self) -> Iterator[ParamRecord]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, param: nn.Parameter) -> ParamRecord:
        """The record of ``param``, a parameter in the layout."""
        return self._by_param[param]

    def of(self, tensor: torch.Tensor) -> ParamRecord | None:
        """The record of the parameter ``tensor`` is, or is this rank's piece or master of; ``None`` for a tensor
        the wrapper does not train."""
        record = self._by_param.get(tensor)
        return record if record is not None else self._by_stand_in.get(tensor)

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a parameter in the layout that this rank steps all of."""
        record = self._by_param.get(tensor)
        return record is not None and record.owned

    def piece_of(self, param: torch.Tensor) -> nn.Parameter | None:
        """This rank's piece of the split parameter ``param``, or ``None`` (Note [pieces] in
        ``engine/data_parallel.py``)."""
        record = self._by_param.get(param)
        return record.piece if record is not None else None

    @property
    def pieces(self) -> dict[nn.Parameter, nn.Parameter]:
        """Each split parameter this rank steps a piece of, and that piece."""
        return {u.param: u.tensor for u in self.units if u.split}

    @property
    def stepped_whole(self) -> frozenset[nn.Parameter]:
        """The parameters this rank steps whole."""
        return frozenset(u.param for u in self.units if not u.split)

    def set_master(self, tensor: torch.Tensor, master: torch.Tensor) -> None:
        """Declares ``master`` the tensor the optimizer steps for ``tensor`` (an owned parameter or piece): it gets
        the reduced gradient in float32 at each sync (``bf16-true``, :class:`~.masters.MasterWeights`)."""
        record = self.of(tensor)
        record.unit.master = master
        self._by_stand_in[master] = record

    def release(self) -> None:
        """The wrapper is released: this rank steps nothing, and pieces and masters are no longer its tensors."""
        for record in self._records:
            record.unit = None
        self.units = []
        self._by_stand_in = {}
