"""A model the wrapper cannot train is refused before any collective, with a message naming what is wrong.

At wrapping (``LayerwiseDataParallel(...)``): parameters on several devices, a parameter without
elements, a sparse embedding, and parameters that differ across ranks (name, shape, dtype,
``requires_grad``, device type or number: every rank names the first difference and the fix; the same
model on both ranks is the control).

After wrapping (Note [fixed module]): a module changed after wrapping (a parameter added, removed or
replaced, ``.data`` reassigned, ``model.half()``) raises at the next training forward, before any
collective, naming what changed, on every rank; evaluation forwards and unchanged modules pass.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

import lightning_layerwise as llw
from _dist import run_distributed
from helpers import outcome
from lightning_layerwise import LayerwiseDataParallel
from lightning_layerwise.engine.process_groups import ProcessGroups


# --- at wrapping ---------------------------------------------------------------------------------------------------


def test_parameters_on_several_devices_are_rejected():
    """The Trainer moves the whole module to one device first; a hand-built wrapper is checked."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3, device="meta"))
    with pytest.raises(ValueError, match=r"^parameters of one buffer \(dense, torch\.float32\) sit on several "
                                         r"devices \['cpu', 'meta'\]; move the module to one device before wrapping "
                                         r"it\.$"):
        LayerwiseDataParallel(model, process_groups=ProcessGroups.single())


def test_a_parameter_without_elements_is_rejected():
    model = nn.Linear(3, 3)
    model.empty = nn.Parameter(torch.empty(0))
    with pytest.raises(ValueError, match=r"^parameter 'empty' has no elements \(shape \(0,\)\); remove it or set "
                                         r"requires_grad=False\.$"):
        LayerwiseDataParallel(model, process_groups=ProcessGroups.single())


def _differing_modules_worker(rank, world):
    groups = ProcessGroups.create()

    def build(case: str) -> nn.Module:
        torch.manual_seed(0)
        layers = OrderedDict(inp=nn.Linear(4, 4), out=nn.Linear(4, 2))
        if rank == 1 and case == "name":
            layers = OrderedDict(inp=layers["inp"], head=layers["out"])
        if rank == 1 and case == "count":
            layers["extra"] = nn.Linear(2, 2)
        model = nn.Sequential(layers)
        if rank == 1 and case == "dtype":
            model.double()
        if rank == 1 and case == "requires_grad":
            model.out.bias.requires_grad_(False)
        if rank == 1 and case == "device":  # another device type on one rank (meta: no GPU needed)
            model.out.bias = nn.Parameter(torch.empty(2, device="meta"))
        return model

    return {case: outcome(lambda: LayerwiseDataParallel(build(case), process_groups=groups))
            for case in ("name", "same", "dtype", "requires_grad", "count", "device")}


def test_parameters_differing_across_ranks_name_the_first_difference():
    first, second = run_distributed(_differing_modules_worker, 2)
    prefix = ("ValueError: the module's parameters differ across ranks (name, shape, dtype, requires_grad or device "
              "type); first difference: this rank has ")
    fix = ". Build the same model on every rank (same config and seed) before wrapping it."
    assert first["same"] == second["same"] == "ok"  # the control: the same model on both ranks
    assert first["name"] == prefix + "('out.weight', (2, 4), 'torch.float32', True, 'cpu'), rank 1 has " \
                                     "('head.weight', (2, 4), 'torch.float32', True, 'cpu')" + fix
    assert first["dtype"] == prefix + "('inp.weight', (4, 4), 'torch.float32', True, 'cpu'), rank 1 has " \
                                      "('inp.weight', (4, 4), 'torch.float64', True, 'cpu')" + fix
    assert first["requires_grad"] == prefix + "('out.bias', (2,), 'torch.float32', True, 'cpu'), rank 1 has " \
                                              "('out.bias', (2,), 'torch.float32', False, 'cpu')" + fix
    assert first["device"] == prefix + "('out.bias', (2,), 'torch.float32', True, 'cpu'), rank 1 has " \
                                       "('out.bias', (2,), 'torch.float32', True, 'meta')" + fix
    assert first["count"] == ("ValueError: the module's parameters differ across ranks (name, shape, dtype, "
                              "requires_grad or device type); this rank has 4 parameters, rank 1 has 6" + fix)
    assert second["count"].endswith("this rank has 6 parameters, rank 0 has 4" + fix)
    assert all(second[case].startswith(prefix) for case in ("name", "dtype", "requires_grad", "device")), second


def _bad_module_worker(rank, world):
    model = nn.Linear(4, 4 + rank)
    try:
        LayerwiseDataParallel(model)
    except ValueError as e:
        return str(e)
    return None


def test_parameters_differing_across_ranks_rejected_before_training():
    for message in run_distributed(_bad_module_worker, 2):
        assert message is not None and "differ across ranks" in message and "same model" in message


def test_a_sparse_embedding_is_refused_at_wrapping():
    with pytest.raises(ValueError, match=r"'0.weight' belongs to Embedding\(sparse=True\).*sparse=False"):
        LayerwiseDataParallel(nn.Sequential(nn.Embedding(5, 3, sparse=True)), process_groups=ProcessGroups.single())


# --- after wrapping: Note [fixed module] --------------------------------------------------------------------------


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
