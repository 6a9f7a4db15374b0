"""Note [fixed module]: a module changed after wrapping raises before any collective, naming what changed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_layerwise as llw
from _dist import run_distributed


def wrapped(groups=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    return model, llw.LayerwiseDataParallel(model, process_groups=groups or llw.ProcessGroups.single(),
                                            bucket_size=64)


CHANGES = {
    "added": (lambda m: m.add_module("extra", nn.Linear(2, 2)), r"added or replaced \['extra.weight', 'extra.bias'\]"),
    "module_replaced": (lambda m: m.__setitem__(2, nn.Linear(8, 2)),
                        r"added or replaced \['2.weight', '2.bias'\], removed or replaced \['2.weight', '2.bias'\]"),
    "parameter_replaced": (lambda m: setattr(m[0], "bias", nn.Parameter(torch.zeros(8))),
                           r"added or replaced \['0.bias'\], removed or replaced \['0.bias'\]"),
    "removed": (lambda m: m.__delitem__(2), r"removed or replaced \['2.weight', '2.bias'\]"),
    "data_reassigned": (lambda m: setattr(m[0].weight, "data", m[0].weight.data.clone()),
                        r"'0.weight' no longer lives in its bucket"),
    "half": (lambda m: m.half(), r"no longer lives in its bucket: its .data, dtype or device"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_after_wrapping_is_a_clear_error(change):
    model, wrapper = wrapped()
    wrapper(torch.randn(3, 4)).sum().backward()  # a normal step first
    wrapper.finish_grad_sync()
    apply, message = CHANGES[change]
    apply(model)
    with pytest.raises(RuntimeError, match=message):
        wrapper(torch.randn(3, 4))


def test_eval_forwards_and_unchanged_modules_pass():
    model, wrapper = wrapped()
    for _ in range(2):
        wrapper.zero_grad()
        wrapper(torch.randn(3, 4)).sum().backward()
        wrapper.finish_grad_sync()
    with torch.no_grad():
        wrapper(torch.randn(3, 4))


def _two_rank_worker(rank, world):
    model, wrapper = wrapped(llw.ProcessGroups.create())
    model.add_module("extra", nn.Linear(2, 2))  # the same change on every rank, as user code makes it
    try:
        wrapper(torch.randn(3, 4))
    except RuntimeError as e:
        return str(e)
    return None


def test_every_rank_raises_before_any_collective():
    for error in run_distributed(_two_rank_worker, 2, timeout=60):
        assert error is not None and "extra.weight" in error
