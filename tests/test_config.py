"""``LayerwiseConfig``: every setting of both strategies, typed and checked once.

The bad-input tables (``test_reliability.py``, ``test_fabric.py``) check each message through the
strategies; here: the defaults are written once (the Trainer strategy's signature, which LightningCLI
reads, repeats them and must agree), a config is frozen, and both strategies keep the config they built.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import lightning_layerwise as llw
from lightning_layerwise.config import SETTINGS, LayerwiseConfig


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
