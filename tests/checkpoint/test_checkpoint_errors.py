"""What a user sees when a checkpoint cannot be saved or loaded as asked (docs/reliability.md, "Checkpoints").

Every test asserts the text the user gets. The checkpoint helpers run in one process: an optimizer
holding a tensor outside the model, param groups in another order or length, a full checkpoint with
another number of optimizer states, a sharded checkpoint of a newer format version, storage options for
a sharded save. Through the ``Trainer``, one forked rank (``tests/_dist.py``) saves a sharded and a full
checkpoint of a tiny model and then loads what it should not, in both formats: a missing path, the
checkpoints folder, a checkpoint of a model with other parameter names or shapes, ``fit`` resumed from
a weights-only checkpoint, a URL, and a save interrupted between its two renames.

Some of these pin behaviour that docs/reliability.md lists under "messages to improve" (a raw
torch.distributed.checkpoint traceback for other shapes, the checkpoints folder). They assert what
happens today; when the library improves the message, such a test fails on purpose and the table row
changes with it. Damaged sharded directories and changed param groups on resume are checked in
``test_checkpoint_resharding.py``, objects ``weights_only`` refuses in ``test_checkpoint_gather.py``.
"""

from __future__ import annotations

import os
import shutil
import warnings

import pytest
import torch
from torch import nn

import lightning_layerwise as llw
from _dist import run_distributed
from helpers import Tiny, outcome, tiny_batches as batches, tiny_trainer as trainer
from lightning_layerwise import checkpoint as ckpt

# save_sharded / read_sharded_metadata in one process: torch.distributed.checkpoint warns that it has no group.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


# --- checkpoints: helpers in one process ------------------------------------------------------------------------


def _named(*shapes):
    params = [nn.Parameter(torch.randn(*s)) for s in shapes]
    return params, {p: name for p, name in zip(params, "abcdef")}


def test_an_optimizer_holding_a_tensor_outside_the_model_cannot_be_saved_by_name():
    (a, b), names = _named((3, 3), (3,))
    stray = nn.Parameter(torch.zeros(5))
    opt = torch.optim.SGD([a, b, stray], lr=0.1)
    with pytest.raises(ckpt.CheckpointError, match=r"^the optimizer holds 1 tensor\(s\) that are not parameters of "
                                                   r"the model \(shapes \[\(5,\)\]\); only the model's parameters "
                                                   r"can be checkpointed by name\.$"):
        ckpt.named_optimizer_state(opt, names)


def test_param_groups_in_another_order_or_length_name_the_group_and_position():
    (a, b), names = _named((3, 3), (3,))
    opt = torch.optim.SGD([a, b], lr=0.1)
    saved = ckpt.named_optimizer_state(opt, names)
    swapped = {"state": {}, "param_groups": [{**saved["param_groups"][0], "params": ["b", "a"]}]}
    with pytest.raises(ckpt.CheckpointError, match=r"^param group 0, position 0: the checkpoint has 'b' where this "
                                                   r"optimizer has 'a'; build the param groups in the same order as "
                                                   r"the run that saved it\.$"):
        ckpt.local_optimizer_state(swapped, opt, names, keep=lambda p: True)
    shorter = {"state": {}, "param_groups": [{**saved["param_groups"][0], "params": ["a"]}]}
    with pytest.raises(ckpt.CheckpointError, match=r"^param group 0 has 1 parameters in the checkpoint and 2 in "
                                                   r"this optimizer\.$"):
        ckpt.local_optimizer_state(shorter, opt, names, keep=lambda p: True)


def test_a_full_checkpoint_with_another_number_of_optimizer_states():
    strategy = llw.LayerwiseStrategy(checkpoint_format="full")
    strategy.optimizers = [torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)]
    with pytest.raises(ckpt.CheckpointError, match=r"^the checkpoint holds 2 optimizer state\(s\) and the model "
                                                   r"configures 1\.$"):
        strategy.load_optimizer_state_dict({"optimizer_states": [{}, {}]})


def test_a_sharded_checkpoint_of_a_newer_format_version(tmp_path):
    path = tmp_path / "future.ckpt"
    path.mkdir()
    torch.save({"layerwise": {"format": ckpt.FORMAT, "version": ckpt.FORMAT_VERSION + 1}}, path / ckpt.META_FILENAME)
    (path / ckpt.DCP_METADATA_FILENAME).write_bytes(b"")
    with pytest.raises(ckpt.CheckpointError, match=rf"^sharded checkpoint '.*future\.ckpt' has format version "
                                                   rf"{ckpt.FORMAT_VERSION + 1}; this lightning_layerwise reads up to "
                                                   rf"version {ckpt.FORMAT_VERSION}\. Upgrade lightning_layerwise\.$"):
        ckpt.read_sharded_metadata(path)


def test_storage_options_for_a_sharded_save_are_refused(tmp_path):
    strategy = llw.LayerwiseStrategy(checkpoint_format="sharded")
    with pytest.raises(TypeError, match=r"^LayerwiseStrategy\(checkpoint_format='sharded'\)\.save_checkpoint\(\.\.\., "
                                        r"storage_options=\.\.\.\) is not supported: .*Use checkpoint_format='full' "
                                        r"for a CheckpointIO plugin\.$"):
        strategy.save_checkpoint({"state_dict": {}}, tmp_path / "x.ckpt", storage_options={"acl": "private"})


# --- checkpoints through the Trainer: one forked rank saves, then loads what it should not ----------------------


def _checkpoint_worker(rank, world, root):
    os.chdir(root)  # a URL mistaken for a local path lands here
    seen = {}
    for fmt in ("sharded", "full"):
        def fit(model=None, ckpt_path=None, max_steps=2):
            t = trainer(strategy=llw.LayerwiseStrategy(checkpoint_format=fmt), max_steps=max_steps)
            t.fit(model or Tiny(), batches(), ckpt_path=ckpt_path)
            return t

        t = fit(max_steps=1)
        good, weights = f"{root}/{fmt}.ckpt", f"{root}/{fmt}_weights.ckpt"
        t.save_checkpoint(good)
        t.save_checkpoint(weights, weights_only=True)
        seen[fmt, "missing path"] = outcome(lambda: fit(ckpt_path=f"{root}/nothing_here.ckpt"))
        seen[fmt, "the checkpoints folder"] = outcome(lambda: fit(ckpt_path=root))
        seen[fmt, "other names"] = outcome(lambda: fit(Tiny(head="classifier"), ckpt_path=good))
        seen[fmt, "other shapes"] = outcome(lambda: fit(Tiny(width=16), ckpt_path=good))
        seen[fmt, "weights only"] = outcome(lambda: fit(ckpt_path=weights))
        seen[fmt, "url save"] = outcome(lambda: t.save_checkpoint(f"memory://bucket/{fmt}.ckpt"))
        seen[fmt, "url save wrote locally"] = os.path.exists(os.path.join(root, "memory:", "bucket", f"{fmt}.ckpt"))
    # A save killed between its two renames leaves the previous directory aside as .NAME.old.
    shutil.copytree(f"{root}/sharded.ckpt", f"{root}/.renamed.ckpt.old")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seen["sharded", "interrupted rename"] = outcome(
            lambda: trainer(max_steps=2).fit(Tiny(), batches(), ckpt_path=f"{root}/renamed.ckpt"))
    seen["sharded", "interrupted rename warnings"] = [str(w.message) for w in caught]
    return seen


@pytest.fixture(scope="module")
def loads(tmp_path_factory):
    root = tmp_path_factory.mktemp("reliability_checkpoints")
    (seen,) = run_distributed(_checkpoint_worker, 1, str(root))
    return seen, str(root)


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_a_missing_checkpoint_path(loads, fmt):
    seen, root = loads
    assert seen[fmt, "missing path"] == f"FileNotFoundError: Checkpoint file not found: {root}/nothing_here.ckpt"


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_the_checkpoints_folder_instead_of_a_checkpoint(loads, fmt):
    seen, root = loads
    assert seen[fmt, "the checkpoints folder"] == (
        f"CheckpointError: sharded checkpoint '{root}' has no meta.pt: it is not a complete checkpoint.")


def test_a_checkpoint_of_a_model_with_other_parameter_names(loads):
    seen, root = loads
    assert seen["sharded", "other names"] == (
        f"CheckpointError: sharded checkpoint '{root}/sharded.ckpt' does not match Tiny: missing keys "
        "['classifier.bias', 'classifier.weight'], unexpected keys ['out.bias', 'out.weight']. Set "
        "`strict_loading = False` on the LightningModule to load the keys that match.")
    assert seen["full", "other names"].startswith(
        'RuntimeError: Error(s) in loading state_dict for Tiny:\n\tMissing key(s) in state_dict: "classifier.weight", '
        '"classifier.bias". \n\tUnexpected key(s) in state_dict: "out.weight", "out.bias". ')


def test_a_checkpoint_of_a_model_with_other_shapes(loads):
    seen, _ = loads
    full = seen["full", "other shapes"]
    assert full.startswith("RuntimeError: Error(s) in loading state_dict for Tiny:\n\tsize mismatch for inp.weight: "
                           "copying a param with shape torch.Size([8, 4]) from checkpoint, the shape in current "
                           "model is torch.Size([16, 4])."), full
    # Sharded: torch.distributed.checkpoint's own exception, a rank's traceback as its text (messages to improve).
    sharded = seen["sharded", "other shapes"]
    assert sharded.startswith("CheckpointException: CheckpointException ranks:dict_keys([0])\n"
                              "Traceback (most recent call last): (RANK 0)\n"), sharded
    assert sharded.rstrip().endswith("ValueError: Size mismatch between saved torch.Size([8, 4]) and current: "
                                     "torch.Size([16, 4]) for model.inp.weight"), sharded


def test_resuming_fit_from_a_weights_only_checkpoint(loads):
    seen, root = loads
    assert seen["sharded", "weights only"] == (
        f"CheckpointError: sharded checkpoint '{root}/sharded_weights.ckpt' holds 0 optimizer state(s) and the model "
        "configures 1; it was saved without optimizer state (ModelCheckpoint(save_weights_only=True)?) or for "
        "another set of optimizers.")
    assert seen["full", "weights only"] == (
        "KeyError: 'Trying to restore optimizer state but checkpoint contains only the model. This is probably due "
        "to `ModelCheckpoint.save_weights_only` being set to `True`.'")


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_a_url_goes_to_its_filesystem_or_is_refused(loads, fmt):
    """``sharded`` refuses a URL (DCP writes to a local or mounted filesystem); ``full`` hands it to the
    CheckpointIO plugin (fsspec's in-memory filesystem here). Nothing lands in a local ``./memory:/`` folder
    (``Path("memory://b/x")`` reads ``memory:/b/x``: locality is decided on the string)."""
    seen, _ = loads
    if fmt == "sharded":
        assert seen[fmt, "url save"] == (
            "ValueError: LayerwiseStrategy(checkpoint_format='sharded') writes a sharded directory to a local or "
            "mounted filesystem, not 'memory://bucket/sharded.ckpt'; use checkpoint_format='full' for remote "
            "storage."), seen[fmt, "url save"]
    else:
        assert seen[fmt, "url save"] == "ok"
    assert not seen[fmt, "url save wrote locally"]


def test_an_interrupted_rename_loads_the_previous_checkpoint_with_a_warning(loads):
    seen, root = loads
    assert seen["sharded", "interrupted rename"] == "ok"
    assert f"'{root}/renamed.ckpt' does not exist, but '{root}/.renamed.ckpt.old' does: a save to " \
           f"'{root}/renamed.ckpt' was interrupted while replacing it. Loading the previous checkpoint." in \
           seen["sharded", "interrupted rename warnings"]
