"""What a user sees for each bad input or fault that docs/reliability.md lists and no other test file checks.

Every test asserts the text the user gets (or, where there is none, what happens
instead). Most need no process group: strategy and optimizer arguments fail when
they are built, launch settings when ``fit`` starts, and checkpoint helpers run in
one process. The rest run on forked gloo ranks (``tests/_dist.py``): one rank for
checkpoint loads through the ``Trainer``, two where ranks must disagree.

A few tests pin behaviour that docs/reliability.md lists under "messages to
improve" (a value accepted silently, a raw torch traceback, a URL written to a
local directory). They assert what happens today; when the library improves the
message, such a test fails on purpose and the table row changes with it.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
import warnings
from collections import OrderedDict
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_layerwise as llw
from lightning_layerwise import LayerwiseDataParallel
from lightning_layerwise import checkpoint as ckpt
from lightning_layerwise.process_groups import ProcessGroups
from _dist import run_distributed

# save_sharded / read_sharded_metadata in one process: torch.distributed.checkpoint warns that it has no group.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class Tiny(L.LightningModule):
    """Two linear layers; ``head`` names the second one (another name makes another model)."""

    def __init__(self, width: int = 8, head: str = "out"):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, width)
        setattr(self, head, nn.Linear(width, 2))
        self.head_name = head

    def forward(self, x):
        return getattr(self, self.head_name)(self.inp(x).tanh())

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def batches(n: int = 8, batch_size: int = 2) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return DataLoader(TensorDataset(x, x[:, :2].sin()), batch_size=batch_size)


def trainer(devices: int = 1, strategy=None, **kwargs) -> L.Trainer:
    options = dict(accelerator="cpu", devices=devices, strategy=strategy or llw.LayerwiseStrategy(), max_steps=1,
                   logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    options.update(kwargs)
    return L.Trainer(**options)


def outcome(fn) -> str:
    """``"ok"``, or the type and text of what ``fn()`` raised."""
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - the message is what is under test
        return f"{type(e).__name__}: {e}"
    return "ok"


# --- strategy arguments: rejected when the strategy is built --------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    ({"overlap_param_gather": "yes"}, r"^LayerwiseStrategy\(overlap_param_gather='yes'\): use True, False or 'auto'\.$"),
    ({"start_method": "thread"},
     r"^LayerwiseStrategy\(start_method='thread'\): use 'popen', 'spawn', 'fork' or 'forkserver'\.$"),
    ({"bucket_size": 2.5e7}, r"^LayerwiseStrategy\(bucket_size=25000000\.0\): pass a positive number of elements, "
                             r"e\.g\. bucket_size=40000000\.$"),
    ({"bucket_size": True}, r"^LayerwiseStrategy\(bucket_size=True\): pass a positive number"),
    ({"prefetch_depth": 1.5}, r"^LayerwiseStrategy\(prefetch_depth=1\.5\): pass an integer >= 1\.$"),
    ({"grad_reduce_dtype": torch.float32},
     r"^LayerwiseStrategy\(grad_reduce_dtype=torch\.float32\): use one of \['bfloat16', 'float16', 'float32'\] "
     r"or None \(the parameter dtype\)\.$"),
    ({"replica_check_every": True},
     r"^LayerwiseStrategy\(replica_check_every=True\): pass a number of optimizer steps >= 1 \(e\.g\. 100\), "
     r"or None to never check\.$"),
    ({"param_read_guard": None}, r"^LayerwiseStrategy\(param_read_guard=None\): use 'wait' .*'strict' .*'off'"),
], ids=["overlap_param_gather", "start_method", "bucket_size-float", "bucket_size-bool", "prefetch_depth-float",
        "grad_reduce_dtype-torch-dtype", "replica_check_every-bool", "param_read_guard-None"])
def test_strategy_argument_errors_name_the_argument_and_the_choices(kwargs, match):
    with pytest.raises(ValueError, match=match):
        llw.LayerwiseStrategy(**kwargs)


@pytest.mark.parametrize("name, value", [("overlap_grad_reduce", "no"), ("broadcast_buffers", "false"),
                                         ("separate_all_gather_group", "off"), ("skip_nonfinite_steps", 1)])
def test_a_non_boolean_for_a_boolean_argument_is_refused(name, value):
    """A string such as "no" would otherwise count as True."""
    with pytest.raises(ValueError, match=rf"^LayerwiseStrategy\({name}={value!r}\): pass True or False\.$"):
        llw.LayerwiseStrategy(**{name: value})


def test_a_timeout_that_is_not_a_timedelta_is_refused_when_the_strategy_is_built():
    with pytest.raises(ValueError, match=r"^LayerwiseStrategy\(timeout=30\): pass a datetime\.timedelta, e\.g\. "
                                         r"timeout=timedelta\(minutes=30\)"):
        llw.LayerwiseStrategy(timeout=30)


# --- launch: devices and num_nodes against the cluster's world size --------------------------------------------


@pytest.fixture
def no_cluster_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith(("SLURM_", "TORCHELASTIC_", "PL_")) or key in (
                "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
                "MASTER_PORT"):
            monkeypatch.delenv(key)
    return monkeypatch


def test_devices_times_nodes_other_than_torchrun_world_size_is_reported_when_fit_starts(no_cluster_env):
    no_cluster_env.setenv("TORCHELASTIC_RUN_ID", "reliability")
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="4", LOCAL_WORLD_SIZE="4", GROUP_RANK="0",
                           MASTER_ADDR="127.0.0.1", MASTER_PORT="29400").items():
        no_cluster_env.setenv(key, value)
    t = trainer(devices=2, strategy="layerwise")
    assert type(t.strategy.cluster_environment).__name__ == "TorchElasticEnvironment"
    with pytest.raises(ValueError, match=r"You set `devices=2` and `num_nodes=1` in Lightning, but the product "
                                         r"\(2 \* 1\) does not match the world size \(4\)\."):
        t.fit(Tiny(), batches())
    assert not torch.distributed.is_initialized()


def test_devices_or_num_nodes_other_than_slurm_tasks_are_reported_when_fit_starts(no_cluster_env):
    for key, value in dict(SLURM_NTASKS="4", SLURM_NTASKS_PER_NODE="4", SLURM_NNODES="1", SLURM_PROCID="0",
                           SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_JOB_ID="4242", SLURM_JOB_NAME="layerwise",
                           SLURM_NODELIST="127.0.0.1").items():
        no_cluster_env.setenv(key, value)
    with pytest.raises(ValueError, match=r"You set `devices=2` in Lightning, but the number of tasks per node "
                                         r"configured in SLURM `--ntasks-per-node=4` does not match\. HINT: Set "
                                         r"`devices=4`\."):
        trainer(devices=2, strategy="layerwise").fit(Tiny(), batches())
    with pytest.raises(ValueError, match=r"You set `num_nodes=2` in Lightning, but the number of nodes configured "
                                         r"in SLURM `--nodes=1` does not match\. HINT: Set `num_nodes=1`\."):
        trainer(devices=4, num_nodes=2, strategy="layerwise").fit(Tiny(), batches())
    assert not torch.distributed.is_initialized()


# --- LightningCLI: a bad strategy value in a config ------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cli_errors(tmp_path_factory):
    """``examples/train.py fit`` with one bad strategy value each; both processes run side by side."""
    cwd = tmp_path_factory.mktemp("cli")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    bad = {"rejected_by_the_strategy": ["--trainer.strategy.init_args.bucket_size", "-4"],
           "outside_a_literal": ["--trainer.strategy.init_args.grad_reduce_dtype", "float64"]}
    procs = {name: subprocess.Popen([sys.executable, str(ROOT / "examples" / "train.py"), "fit", "--config",
                                     str(ROOT / "examples" / "configs" / "cpu.yaml"), *args, "--trainer.max_steps", "1"],
                                    cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, args in bad.items()}
    results = {}
    for name, proc in procs.items():
        output, _ = proc.communicate(timeout=180)
        results[name] = (proc.returncode, output)
    return results


def test_a_cli_value_the_strategy_rejects_ends_in_a_traceback(cli_errors):
    code, output = cli_errors["rejected_by_the_strategy"]
    assert code == 1, output[-2000:]
    assert "Traceback (most recent call last)" in output  # LightningCLI instantiates the strategy: no usage line
    assert "ValueError: Does not validate against any of the Union subtypes" in output
    assert "  - LayerwiseStrategy(bucket_size=-4): pass a positive number of elements, e.g. bucket_size=40000000.\n" \
        in output


def test_a_cli_value_outside_a_literal_choice_is_a_usage_error(cli_errors):
    code, output = cli_errors["outside_a_literal"]
    assert code == 2, output[-2000:]
    assert output.startswith("usage: train.py") and "Traceback" not in output
    assert re.search(r'error: Parser key "trainer\.strategy":.*Parser key "grad_reduce_dtype":.*'
                     r"Expected a typing\.Literal\['float32', 'bfloat16', 'float16'\].*Given value: float64",
                     output, re.S), output[-2000:]


# --- optimizer arguments not covered by test_muon.py ----------------------------------------------------------


def _matrix():
    return nn.Parameter(torch.randn(4, 4))


@pytest.mark.parametrize("kwargs, match", [
    ({"lr": math.nan}, r"^Muon: lr=nan is invalid: it must be a number >= 0, e\.g\. lr=0\.02$"),
    ({"weight_decay": -0.1}, r"^Muon: weight_decay=-0\.1 is invalid: it must be a number >= 0, e\.g\. "
                             r"weight_decay=0\.0$"),
    ({"ns_eps": -1.0}, r"^Muon: ns_eps=-1\.0 is invalid"),
    ({"adamw_eps": -1e-8}, r"^Muon: adamw_eps=-1e-08 is invalid"),
    ({"adamw_weight_decay": -1.0}, r"^Muon: adamw_weight_decay=-1\.0 is invalid"),
    ({"params": [{"params": [_matrix()], "use_muon": "yes"}]},
     r"^Muon param group 0: use_muon='yes' is invalid: it must be True or False$"),
    ({"params": [{"params": [_matrix()], "momentum": 1.5}]}, r"^Muon param group 0: momentum=1\.5 is invalid: it "
                                                             r"must lie in \[0, 1\)"),
    ({"params": [{"params": [_matrix()], "ns_steps": 0}]},
     r"^Muon param group 0: ns_steps=0 is invalid: Newton-Schulz needs at least one iteration; pass ns_steps=5$"),
    ({"params": [{"params": [_matrix()], "adjust_lr": "rms"}]}, r"^Muon param group 0: adjust_lr='rms' is not "
                                                                r"supported"),
], ids=["lr-nan", "weight_decay", "ns_eps", "adamw_eps", "adamw_weight_decay", "group-use_muon", "group-momentum",
        "group-ns_steps", "group-adjust_lr"])
def test_muon_arguments_name_the_argument_and_the_fix(kwargs, match):
    kwargs = dict(kwargs)
    params = kwargs.pop("params", [_matrix()])
    with pytest.raises(ValueError, match=match):
        llw.Muon(params, **kwargs)


# --- models: rejected when the wrapper is built ---------------------------------------------------------------


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


# --- data: ranks with different numbers of batches --------------------------------------------------------------


class StepLogged(Tiny):
    """Logs the validation loss with a collective on every validation step."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True, on_step=True, on_epoch=False)


def _uneven_worker(rank, world, outdir, phase):
    """Rank 0 gets 3 batches, rank 1 gets 2 (no DistributedSampler); each records its outcome and exits at once,
    as a script ends after ``fit`` (the other rank then sees the connection close instead of a timeout)."""
    t = trainer(devices=2, use_distributed_sampler=False, num_sanity_val_steps=0,
                max_steps=-1 if phase == "train" else 2, max_epochs=1,
                **({"val_check_interval": 2} if phase == "validation" else {}))
    uneven = batches(6 if rank == 0 else 4)
    if phase == "train":
        result = outcome(lambda: t.fit(Tiny(), uneven))
    else:
        result = outcome(lambda: t.fit(StepLogged(), batches(8), uneven))
    with open(os.path.join(outdir, f"rank{rank}.txt"), "w") as f:
        f.write(f"{t.global_step}\n{result}")
    os._exit(0)


def _uneven(tmp_path, phase) -> list[tuple[int, str]]:
    with pytest.raises(RuntimeError, match="died without a result"):  # both ranks exit without returning
        run_distributed(_uneven_worker, 2, str(tmp_path), phase, timeout=60)
    found = [(tmp_path / f"rank{r}.txt").read_text().split("\n", 1) for r in range(2)]
    return [(int(step), text) for step, text in found]


# gloo's words for "the other process is gone", whichever socket operation notices it first.
PEER_GONE = r"^RuntimeError: \[.*gloo.*\] .*(Connection (closed|reset) by peer|Broken pipe)"  # Lightning's own
PEER_GONE_IN_WRAPPER = (r"^CollectiveError: the gradient reduce-scatter \(end of backward\) failed on rank 0 of 2: another rank "
             r"died, hung past the collective timeout, or left the job \(RuntimeError: \[.*gloo.*\] .*"
             r"(Connection (closed|reset) by peer|Broken pipe)")


def test_a_rank_with_more_training_batches_waits_for_a_peer_that_has_finished(tmp_path):
    (steps0, result0), (steps1, result1) = _uneven(tmp_path, "train")
    assert (steps1, result1) == (2, "ok"), "the rank with fewer batches ends its fit without a word"
    assert steps0 == 2, "the other never completes its third step"
    assert re.match(PEER_GONE_IN_WRAPPER, result0), result0


def test_a_collective_per_validation_step_with_uneven_validation_batches(tmp_path):
    (_, result0), (steps1, result1) = _uneven(tmp_path, "validation")
    assert (steps1, result1) == (2, "ok")
    assert re.match(PEER_GONE, result0), result0


# --- non-finite gradients on one rank, per precision (docs/reliability.md) -----------------------------------------


class InfGradient(Tiny):
    """Rank 1 adds ``value * out.bias.sum()`` to its loss at step 0: one parameter's gradient is non-finite there."""

    def __init__(self, value: float):
        super().__init__()
        self.value = value
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x).float(), y.float())
        if self.global_rank == 1 and self.global_step == 0:
            loss = loss + self.value * self.out.bias.sum()
        self.losses.append(loss.item())
        return loss


class AfterEachStep(L.Callback):
    def __init__(self):
        self.steps: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.steps.append({"params": {n: p.detach().float().clone() for n, p in pl_module.named_parameters()},
                           "scale": scaler.get_scale() if scaler is not None else None})


NONFINITE_CASES = [("32-true", math.inf, None), ("32-true", math.nan, None), ("bf16-mixed", math.inf, None),
                   ("bf16-true", math.inf, None), ("16-mixed", math.inf, None), ("16-mixed", math.nan, None),
                   ("32-true", math.inf, 1.0)]


def _nonfinite_worker(rank, world):
    results = []
    for precision, value, clip in NONFINITE_CASES:
        model, spy = InfGradient(value), AfterEachStep()
        initial = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        # 16-mixed through the plugin: precision="16-mixed" on CPU falls back to bf16-mixed (Lightning warns).
        kind = {"plugins": [MixedPrecision("16-mixed", "cpu")]} if precision == "16-mixed" else {"precision": precision}
        t = trainer(devices=2, max_steps=2, callbacks=[spy], gradient_clip_val=clip, **kind)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t.fit(model, batches(16))
        results.append({"initial": initial, "steps": spy.steps, "losses": model.losses,
                        "warnings": [str(w.message) for w in caught]})
    return results


def test_a_nonfinite_gradient_on_one_rank_by_precision():
    ranks = run_distributed(_nonfinite_worker, 2)
    for i, (precision, value, clip) in enumerate(NONFINITE_CASES):
        case = (precision, value, clip)
        per_rank = [r[i] for r in ranks]
        for rank, res in enumerate(per_rank):
            after0, after1 = res["steps"][0]["params"], res["steps"][1]["params"]
            finite0 = {n: bool(torch.isfinite(p).all()) for n, p in after0.items()}
            if precision == "16-mixed":
                # ShardedGradScaler: found-inf is all-reduced, every rank skips step 0 and halves the scale.
                assert all(torch.equal(after0[n], res["initial"][n]) for n in after0), case
                assert [s["scale"] for s in res["steps"]] == [2.0**15, 2.0**15], case
                assert all(torch.isfinite(p).all() for p in after1.values()), case
                assert any(not torch.equal(after1[n], after0[n]) for n in after1), (case, "step 1 trains")
                assert math.isfinite(res["losses"][1]), case
            else:
                # The owner of out.bias steps with the non-finite gradient; the all-gather gives every rank the
                # result, and the next forward spreads it through the loss into every parameter.
                assert finite0 == {"inp.weight": True, "inp.bias": True, "out.weight": True, "out.bias": False}, \
                    (case, rank, finite0)
                assert not math.isfinite(res["losses"][1]), (case, rank, res["losses"])
                assert not any(torch.isfinite(p).all() for p in after1.values()), (case, rank)
                silent = [w for w in res["warnings"] if re.search(r"\bnan\b|\binf\b|finite", w, re.I)]
                assert not silent, (case, "no warning mentions it", silent)
        for n in per_rank[0]["steps"][0]["params"]:  # both ranks hold the same values (NaN compared as equal)
            assert torch.equal(per_rank[0]["steps"][0]["params"][n].nan_to_num(7.0),
                               per_rank[1]["steps"][0]["params"][n].nan_to_num(7.0)), (case, n)
