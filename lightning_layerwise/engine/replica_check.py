"""Whether every rank holds bitwise the same parameters (:meth:`LayerwiseDataParallel.check_replicas`).

Note [replica check]
    After the all-gather every rank must hold bitwise the same parameters.
    :func:`check_replicas` tests that with one small
    collective: each rank sums the bits of every parameter, frozen ones included
    (the values viewed as integers of their width, summed in int64: any change of
    one element, one ulp included, changes the sum), and all-gathers that vector
    of one int64 per parameter. A mismatch names the parameters, their buckets and
    the ranks. Every rank sees the same gathered values and raises the same error,
    so none hangs. Padding is not compared: it holds no parameter.
    Non-owned parameters are rewritten by every all-gather, so a rank-local
    corruption of one lives until the next gather; what the check sees is the
    state right after it (a faulty transfer, a rank-local write after it, a
    frozen parameter that differs: frozen parameters are never re-sent).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from . import collectives

if TYPE_CHECKING:
    from .param_records import ParamRecords


class ReplicaDivergenceError(RuntimeError):
    """Ranks hold different parameters after the all-gather (:meth:`LayerwiseDataParallel.check_replicas`)."""


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BIT_SUM_CHUNK = 1 << 22  # elements summed at once: bounds the int64 temporary


def check_replicas(names: dict[nn.Parameter, str], group: dist.ProcessGroup, records: ParamRecords,
                   experts: Collection[str], expert_parallel_size: int, ranks: str = "rank") -> None:
    """Raises :class:`ReplicaDivergenceError` on every rank of ``group`` unless all hold bitwise-equal parameters
    ``names`` (parameter -> name; Note [replica check]). Collective: every rank calls it at the same point, after
    the all-gathers. ``records`` name where each parameter in the layout lives; ``experts`` are the names of the
    expert parameters, held alike within their expert data-parallel group only. ``ranks`` names the group's ranks
    in the error (under tensor parallelism the check runs over the data-parallel group, then over the
    tensor-parallel group for the parameters its ranks all hold whole)."""
    if not names:
        return
    params = list(names)
    with torch._C.DisableTorchFunctionSubclass():
        sums = torch.stack([_bit_sum(p.detach()) for p in params])
    gathered = collectives.all_gather_stacked(sums, group)
    # Each rank against the first rank holding the same values: rank 0, or for an expert parameter the
    # first of its expert data-parallel group (rank r mod E, Note [expert parallelism] in
    # ``engine/process_groups.py``).
    E = expert_parallel_size
    expert = torch.tensor([E > 1 and names[p] in experts for p in params], device=gathered.device)
    rows = torch.arange(gathered.size(0), device=gathered.device).unsqueeze(1)
    source = torch.where(expert, rows % E, torch.zeros_like(rows))  # (ranks, parameters)
    mismatch = gathered != gathered.gather(0, source)
    differs = mismatch.any(0).nonzero().flatten().tolist()
    if not differs:
        return
    differing = sorted({r for i in differs for r in range(gathered.size(0)) if mismatch[r, i]})
    where = []
    for i in differs[:5]:
        record = records.of(params[i])
        place = f"bucket {record.bucket.name}" if record is not None else "frozen, never all-gathered"
        where.append(f"{names[params[i]]!r} ({place})")
    raise ReplicaDivergenceError(
        f"ranks hold different parameters after the all-gather: {', '.join(where)}"
        f"{' and more' if len(differs) > 5 else ''} differ between {ranks} 0 and {ranks}(s) {differing}. Training stops "
        "here because the replicas would drift apart. Causes: a rank-local in-place write to a parameter (a "
        "hook or callback run on some ranks only), a frozen parameter set differently per rank, or a faulty "
        "device or link; resume from the last checkpoint."
    )


def _bit_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of ``tensor``'s elements read as integers of the same width, in int64 (0-d tensor)."""
    flat = tensor.reshape(-1)
    if flat.dtype.is_floating_point or flat.dtype.is_complex:
        flat = flat.view(_INT_OF_SIZE[flat.element_size()]) if not flat.dtype.is_complex else flat.view(torch.int32)
    total = torch.zeros((), dtype=torch.int64, device=tensor.device)
    for chunk in flat.split(_BIT_SUM_CHUNK):
        total += chunk.sum(dtype=torch.int64)
    return total
