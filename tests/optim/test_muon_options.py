"""Muon's settings that would do nothing are refused when the optimizer (or the group) is built, naming the
setting, the value and the fix (Note [options that do nothing] in ``optim/muon_options.py``).

* Arguments: ``adjust_lr="match_rms_adamw"``/``"spectral"`` with ``normuon=True``, ``normuon_beta2`` or
  ``normuon_eps`` without it (passed, even at the value NorMuon would use), ``ns_batch_bytes`` with
  ``batched=False``, and a non-boolean ``nesterov`` or ``batched``.
* Group keys: a key only the other kind of group reads, an ``adamw_*`` argument written into a group, and the
  same pairs as the arguments where the group sets the key without effect.
* What stays accepted: every default, the settings NorMuon does use, a group that overrides the optimizer's
  setting for itself, groups copied from an optimizer's ``param_groups``, and LightningCLI's parse of every
  argument at its default.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_layerwise as llw
from lightning_layerwise.optim import Muon


def _matrix() -> nn.Parameter:
    return nn.Parameter(torch.randn(4, 4))


def _vector() -> nn.Parameter:
    return nn.Parameter(torch.randn(4))


NO_EFFECT = r"has no effect with normuon=True: NorMuon's step size.*replaces the per-shape lr scale.*leave adjust_lr "


@pytest.mark.parametrize("kwargs, match", [
    ({"normuon": True, "adjust_lr": "match_rms_adamw"}, r"^Muon: adjust_lr='match_rms_adamw' " + NO_EFFECT),
    ({"normuon": True, "adjust_lr": "spectral"}, r"^Muon: adjust_lr='spectral' " + NO_EFFECT +
     r"at 'original' \(the default\) or None .*or pass normuon=False"),
    ({"normuon_beta2": 0.9}, r"^Muon: normuon_beta2=0\.9 has no effect without normuon=True: it is NorMuon's "
                             r"second-moment decay\. Pass normuon=True to use NorMuon, or leave normuon_beta2 out\.$"),
    ({"normuon_beta2": 0.95}, r"^Muon: normuon_beta2=0\.95 has no effect without normuon=True"),  # passed: refused
    ({"normuon_eps": 1e-6}, r"^Muon: normuon_eps=1e-06 has no effect without normuon=True"),
    ({"batched": False, "ns_batch_bytes": 2**20}, r"^Muon: ns_batch_bytes=1048576 has no effect with batched=False: "
                                                  r"every matrix is orthogonalised alone.*Pass batched=True"),
    ({"batched": False, "ns_batch_bytes": None}, r"^Muon: ns_batch_bytes=None has no effect with batched=False"),
    ({"nesterov": "no"}, r"^Muon: nesterov='no' is invalid: it must be True or False$"),
    ({"batched": 1}, r"^Muon: batched=1 is invalid: it must be True or False$"),
], ids=["normuon-match_rms_adamw", "normuon-spectral", "normuon_beta2", "normuon_beta2-default-value",
        "normuon_eps", "ns_batch_bytes-unbatched", "ns_batch_bytes-None-unbatched", "nesterov-str", "batched-int"])
def test_an_argument_that_would_do_nothing_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Muon([_matrix()], **kwargs)


@pytest.mark.parametrize("group, kwargs, match", [
    ({"use_muon": True, "adjust_lr": "spectral"}, {"normuon": True},
     r"^Muon param group 0: adjust_lr='spectral' " + NO_EFFECT),
    ({"use_muon": True, "adjust_lr": "match_rms_adamw", "normuon": True}, {},
     r"^Muon param group 0: adjust_lr='match_rms_adamw' " + NO_EFFECT),
    ({"use_muon": True, "normuon_beta2": 0.9}, {},
     r"^Muon param group 0: normuon_beta2=0\.9 has no effect without normuon=True"),
    ({"use_muon": True, "normuon": False, "normuon_eps": 1e-6}, {"normuon": True},
     r"^Muon param group 0: normuon_eps=1e-06 has no effect without normuon=True"),
    ({"use_muon": True, "ns_batch_bytes": 4096}, {"batched": False},
     r"^Muon param group 0: ns_batch_bytes=4096 has no effect with batched=False"),
    ({"use_muon": True, "nesterov": "yes"}, {}, r"^Muon param group 0: nesterov='yes' is invalid"),
    ({"use_muon": True, "betas": (0.9, 0.99)}, {},
     r"^Muon param group 0: a Muon group \(use_muon=True\) does not read betas=\(0\.9, 0\.99\): only AdamW groups "
     r"do\. Drop the key, or put these parameters in a use_muon=False group\.$"),
    ({"use_muon": False, "momentum": 0.9}, {},
     r"^Muon param group 0: an AdamW group \(use_muon=False\) does not read momentum=0\.9: only Muon groups do; "
     r"AdamW groups read 'lr', 'betas', 'eps' and 'weight_decay'\."),
    ({"use_muon": False, "normuon": True, "ns_steps": 3}, {},
     r"an AdamW group \(use_muon=False\) does not read ns_steps=3, normuon=True"),
    ({"use_muon": False, "adamw_lr": 1e-3}, {},
     r"^Muon param group 0: adamw_lr=0\.001 is an argument of Muon\(\.\.\.\), which a group does not read; give the "
     r"AdamW group its own 'lr' key instead"),
], ids=["adjust_lr-under-normuon", "both-in-group", "normuon_beta2", "normuon_eps-group-off",
        "ns_batch_bytes-unbatched", "nesterov-str", "betas-in-muon-group", "momentum-in-adamw-group",
        "muon-keys-in-adamw-group", "adamw_lr-in-group"])
def test_a_group_key_that_would_do_nothing_is_refused(group, kwargs, match):
    params = [_matrix()] if group["use_muon"] else [_vector()]
    with pytest.raises(ValueError, match=match):
        Muon([{"params": params, **group}], **kwargs)


def test_defaults_the_settings_in_use_and_overrides_for_one_group_are_accepted():
    assert Muon([_matrix()]).defaults["normuon_beta2"] == 0.95  # None stands for NorMuon's defaults
    assert Muon([_matrix()]).defaults["normuon_eps"] == 1e-8
    normuon = Muon([_matrix()], normuon=True, normuon_beta2=0.9, normuon_eps=1e-6, adjust_lr=None)
    assert (normuon.defaults["normuon_beta2"], normuon.defaults["normuon_eps"]) == (0.9, 1e-6)
    Muon([_matrix()], normuon=True, adjust_lr="original")  # the default: cannot be told from a value passed
    Muon([_matrix()], batched=False)
    # A group that turns NorMuon on, or batching off, overrides the optimizer's setting for itself only.
    opt = Muon([{"params": [_matrix()], "normuon": True, "normuon_beta2": 0.9}, {"params": [_matrix()]}],
               adjust_lr="spectral", ns_batch_bytes=None)
    assert [g["adjust_lr"] for g in opt.param_groups] == ["spectral", "spectral"]
    Muon([{"params": [_matrix()], "batched": False}], ns_batch_bytes=None)


def test_groups_copied_from_an_optimizer_are_accepted():
    """A copied group carries every key at the optimizer's value (ZeroRedundancyOptimizer builds its local
    optimizer from such copies): none of them counts as set by the group."""
    groups = [{"params": [_matrix()], "use_muon": True}, {"params": [_vector()], "use_muon": False}]
    first = Muon(groups, ns_dtype="float32", adamw_lr=1e-3, normuon=True, normuon_beta2=0.9)
    assert "momentum" in first.param_groups[1] and "normuon_beta2" in first.param_groups[1]
    copies = [{**g, "params": list(g["params"])} for g in first.param_groups]
    second = Muon(copies, ns_dtype="float32", adamw_lr=1e-3, normuon=True, normuon_beta2=0.9)
    assert [g["use_muon"] for g in second.param_groups] == [True, False]
    # keys filled from another optimizer's arguments, a dtype still spelled as a string, as ZeRO hands them over
    zero_like = [{**g, "ns_dtype": "float32"} for g in copies]
    Muon(zero_like, ns_dtype="float32", adamw_lr=1e-3, normuon=True, normuon_beta2=0.9)


def test_lightning_cli_parses_every_argument_at_its_default_and_refuses_what_would_do_nothing():
    jsonargparse = pytest.importorskip("jsonargparse")
    parser = jsonargparse.ArgumentParser()
    parser.add_class_arguments(Muon, "optimizer", skip={"params"})
    normuon = parser.parse_args(["--optimizer.normuon=true", "--optimizer.lr=0.01"])
    assert dict(normuon.optimizer)["normuon_beta2"] is None  # every argument is passed, at its default
    opt = llw.Muon([_matrix()], **dict(normuon.optimizer))
    assert opt.defaults["normuon"] and opt.defaults["normuon_beta2"] == 0.95
    alone = parser.parse_args(["--optimizer.normuon_beta2=0.9"])
    with pytest.raises(ValueError, match=r"normuon_beta2=0\.9 has no effect without normuon=True"):
        llw.Muon([_matrix()], **dict(alone.optimizer))
