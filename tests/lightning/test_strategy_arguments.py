"""The strategies' arguments: ``LayerwiseConfig`` holds every setting of both, typed and checked once, and a bad
value is refused when the strategy is built, with a message naming the argument, the value and a fix.

* ``LayerwiseConfig``: the defaults are written once (the Trainer strategy's signature, which LightningCLI
  reads, repeats them and must agree), a config is frozen and checked on construction, both strategies
  keep the config they built, and one bucket-size rule holds everywhere.
* ``LayerwiseStrategy(...)`` with a bad value: each argument's exact message (a value of the wrong type,
  a non-boolean for a boolean, a number for ``timeout``), the element-wise fill settings, a misspelt
  argument (the closest valid names suggested), an owner group size that is not a positive divisor
  (at construction, or when ``fit`` starts on a world it does not divide), and a setting that the others would
  leave without effect (``reshard_after_forward=False`` without ``shard_parameters``, ``elementwise_optimizers``
  with ``elementwise_fill=False``).

docs/reliability.md lists each message with its test. Fabric's own arguments are checked in
``test_fabric.py``, the LightningCLI's handling of a bad value in ``test_cli.py``, settings that belong
to one feature next to it (``param_read_guard``, ``replica_check_every``, ``skip_nonfinite_steps``,
``checkpoint_format``).
"""

from __future__ import annotations

import dataclasses
import inspect

import lightning as L
import pytest
import torch

import lightning_layerwise as llw
from _dist import run_distributed
from lightning_layerwise.config import SETTINGS, LayerwiseConfig
from helpers import Regressor, loaders


# --- LayerwiseConfig ---------------------------------------------------------------------------------------------


def test_the_trainer_strategy_signature_repeats_the_config_defaults():
    signature = inspect.signature(llw.LayerwiseStrategy.__init__).parameters
    for field in dataclasses.fields(LayerwiseConfig):
        assert field.name in signature, f"LayerwiseStrategy has no argument {field.name!r}"
        assert signature[field.name].default == field.default, field.name
        assert signature[field.name].annotation == field.type, field.name


def test_both_strategies_build_one_config_and_keep_it():
    trainer = llw.LayerwiseStrategy(bucket_size=1024, elementwise_optimizers=["torch.optim.Adamax"])
    fabric = llw.LayerwiseFabricStrategy(bucket_size=1024, elementwise_optimizers=["torch.optim.Adamax"])
    for strategy in (trainer, fabric):
        assert isinstance(strategy.config, LayerwiseConfig)
        assert strategy.config.elementwise_optimizers == (torch.optim.Adamax,)  # resolved once
        for name in SETTINGS:
            assert getattr(strategy, name) == getattr(strategy.config, name)
    assert dataclasses.replace(trainer.config, owner="LayerwiseStrategy") == fabric.config


def test_a_config_is_frozen_and_checked_on_construction():
    config = LayerwiseConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.bucket_size = 3
    with pytest.raises(ValueError, match=r"^LayerwiseConfig\(bucket_size=True\): pass a positive number"):
        LayerwiseConfig(bucket_size=True)
    with pytest.raises(ValueError, match=r"^MyStrategy\(prefetch_depth=0\): pass an integer >= 1"):
        LayerwiseConfig(prefetch_depth=0, owner="MyStrategy")
    with pytest.raises(TypeError, match=r"LayerwiseFabricStrategy got unknown argument\(s\) \['bucket'\]"):
        llw.LayerwiseFabricStrategy(bucket=3)


def test_one_bucket_size_rule_everywhere():
    """The strategies, the wrapper and the planner reject the same values (a bool is not a size)."""
    from torch import nn

    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="bucket_size="):
            LayerwiseConfig(bucket_size=bad)
        with pytest.raises(ValueError, match="bucket_size="):
            llw.LayerwiseDataParallel(nn.Linear(2, 2), process_groups=llw.ProcessGroups.single(), bucket_size=bad)
        with pytest.raises(ValueError, match="bucket_size="):
            llw.plan_layout([], 2, bad)


# --- strategy arguments: rejected when the strategy is built --------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"bucket_size": -1}, "bucket_size=-1"),
        ({"bucket_size": 0}, "bucket_size=0"),
        ({"prefetch_depth": 0}, "prefetch_depth=0"),
        ({"grad_reduce_dtype": "float64"}, "grad_reduce_dtype='float64'"),
        ({"checkpoint_format": "zip"}, "checkpoint_format='zip'"),
    ],
)
def test_bad_strategy_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        llw.LayerwiseStrategy(**kwargs)


def test_a_misspelt_argument_names_the_closest_one_and_the_valid_ones():
    with pytest.raises(TypeError, match=r"^LayerwiseStrategy got unknown argument\(s\) \['bucket_sise'\] \(did you "
                                        r"mean 'bucket_size'\?\); its arguments are \['broadcast_buffers', "
                                        r"'bucket_size', .*'timeout'\] and Lightning's \(process_group_backend, "
                                        r"accelerator, .*precision_plugin\)\.$"):
        llw.LayerwiseStrategy(bucket_sise=10)
    with pytest.raises(TypeError, match=r"^LayerwiseStrategy got unknown argument\(s\) \['prefech_depth', 'zzz'\] "
                                        r"\(did you mean 'prefetch_depth' for 'prefech_depth'\?\); its arguments"):
        llw.LayerwiseStrategy(zzz=1, prefech_depth=2)
    with pytest.raises(TypeError, match=r"^LayerwiseStrategy got unknown argument\(s\) \['zzz'\]; its arguments"):
        llw.LayerwiseStrategy(zzz=1)
    # The check leaves the explicit signature in place: LightningCLI reads the arguments and their types from it.
    import inspect

    params = inspect.signature(llw.LayerwiseStrategy).parameters
    assert params["bucket_size"].annotation == "Union[int, Literal['auto']]" and "kwargs" not in params
    assert llw.LayerwiseStrategy(4096, prefetch_depth=3).config.bucket_size == 4096


@pytest.mark.parametrize("kwargs, match", [
    ({"overlap_param_gather": "yes"}, r"^LayerwiseStrategy\(overlap_param_gather='yes'\): use True, False or 'auto'\.$"),
    ({"start_method": "thread"},
     r"^LayerwiseStrategy\(start_method='thread'\): use 'popen', 'spawn', 'fork' or 'forkserver'\.$"),
    ({"bucket_size": 2.5e7}, r"^LayerwiseStrategy\(bucket_size=25000000\.0\): pass a positive number of elements, "
                             r"e\.g\. bucket_size=40000000, or 'auto' \(40000000, and 4194304 with "
                             r"shard_parameters=True\)\.$"),
    ({"bucket_size": True}, r"^LayerwiseStrategy\(bucket_size=True\): pass a positive number"),
    ({"prefetch_depth": 1.5}, r"^LayerwiseStrategy\(prefetch_depth=1\.5\): pass an integer >= 1, or 'auto' \(2, and "
                              r"1 with shard_parameters=True\)\.$"),
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


@pytest.mark.parametrize("kwargs, match", [
    ({"elementwise_fill": "yes"}, "elementwise_fill='yes'"),
    ({"elementwise_optimizers": "torch.optim.AdamW"}, "pass a list"),
    ({"elementwise_optimizers": ["Lion"]}, "'Lion' is not an optimizer class"),
    ({"elementwise_optimizers": ["no_such_package.Lion"]}, "cannot import 'no_such_package.Lion'"),
    ({"elementwise_optimizers": ["math.pi"]}, "'math.pi' is float, not a class"),
])
def test_bad_elementwise_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        llw.LayerwiseStrategy(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"reshard_after_forward": False},
     r"\(reshard_after_forward=False\): it applies only with shard_parameters=True \(whether a bucket gathered for "
     r"the forward is kept for its backward\); without it every rank holds the whole model and nothing is freed\. "
     r"Pass shard_parameters=True as well, or leave reshard_after_forward out\.$"),
    ({"elementwise_fill": False, "elementwise_optimizers": ["torch.optim.Adamax"]},
     r"\(elementwise_optimizers=\['torch\.optim\.Adamax'\]\): it applies only with elementwise_fill=True .*"
     r"elementwise_fill=False owns every parameter whole\. Drop one of the two\.$"),
], ids=["reshard_after_forward-unsharded", "elementwise_optimizers-without-fill"])
def test_a_setting_that_would_do_nothing_is_refused_by_every_front(kwargs, match):
    """The check lives in LayerwiseConfig: the Trainer strategy, the Fabric strategy and a session's config refuse
    it alike. ``reshard_after_forward=True`` is the default, so passing it is no choice and stays accepted."""
    for build, owner in ((llw.LayerwiseStrategy, "LayerwiseStrategy"),
                         (llw.LayerwiseFabricStrategy, "LayerwiseFabricStrategy"),
                         (LayerwiseConfig, "LayerwiseConfig")):
        with pytest.raises(ValueError, match=rf"^{owner}" + match):
            build(**kwargs)
    assert llw.LayerwiseStrategy(reshard_after_forward=True).config.reshard_after_forward is True
    assert llw.LayerwiseStrategy(shard_parameters=True, reshard_after_forward=False).reshard_after_forward is False
    declared = LayerwiseConfig(elementwise_optimizers=["torch.optim.Adamax"])
    assert declared.elementwise_optimizers == (torch.optim.Adamax,)


def test_owner_group_size_must_divide_the_world():
    with pytest.raises(ValueError, match=r"owner_group_size=0"):
        llw.LayerwiseStrategy(owner_group_size=0)
    with pytest.raises(ValueError, match=r"owner_group_size='half'"):
        llw.LayerwiseStrategy(owner_group_size="half")
    error = run_distributed(_indivisible_worker, 2)[0]
    assert "owner_group_size=3) does not divide the 2 ranks" in error


def _indivisible_worker(rank, world):
    try:
        L.Trainer(accelerator="cpu", devices=world, strategy=llw.LayerwiseStrategy(owner_group_size=3), max_steps=1,
                  logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False).fit(Regressor(), loaders()[0])
    except ValueError as error:
        return str(error)
    return "no error"
