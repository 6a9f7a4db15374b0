"""A model built on the meta device under ``record_init`` and materialized equals an eager build, bitwise.

One process, no process group (Note [meta-device models] in ``engine/materialize.py``): each model is built
eagerly after ``torch.manual_seed(3)`` and again on the meta device under the recording after the same seed,
then materialized; every parameter and buffer must be bitwise equal, the random generator must stand where the
eager build left it, and materializing must leave the generator as it found it. The models initialize
themselves in the ways users' models do (``_init_styles.py``); the example GPT's configurations are built at
their sizes. Mutations that break the replay (an overwritten init that draws nothing, a re-seed that is not
followed) make the comparison fail. Models whose init cannot be reproduced are refused, naming what.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from _init_styles import InitZoo, NanoGPT, llama
from helpers import RMSNorm
from lightning_layerwise.engine import init_replay
from lightning_layerwise.engine.init_record import record_init, recordings_of
from lightning_layerwise.engine.init_replay import plan_replay
from lightning_layerwise.engine.materialize import check_materializable, materialize

CPU = torch.device("cpu")
CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"


def example_gpt() -> nn.Module:
    from examples.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=40, block_size=8, n_layer=2, n_head=2, n_embd=32))


def example_module(**shape) -> nn.Module:
    from examples.module import GPTLightningModule

    return GPTLightningModule(vocab_size=96, **(shape or dict(n_layer=2, n_head=2, n_embd=32, block_size=8)))


def hf_llama() -> nn.Module:
    pytest.importorskip("transformers")
    return llama()


def hf_llama_tied() -> nn.Module:
    pytest.importorskip("transformers")
    return llama(tie=True)


def both_builds(build) -> tuple[nn.Module, nn.Module, bool, bool]:
    """(eager, materialized, the generator after both builds agrees, materializing left it alone)."""
    torch.manual_seed(3)
    eager = build()
    after_eager = torch.get_rng_state()
    torch.manual_seed(3)
    with torch.device("meta"), record_init(CPU):
        meta = build()
    after_meta = torch.get_rng_state()
    materialize(meta, CPU)
    return eager, meta, torch.equal(after_eager, after_meta), torch.equal(torch.get_rng_state(), after_meta)


def values(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict and the buffers it leaves out (``persistent=False``: rotary frequencies)."""
    return {**model.state_dict(), **dict(model.named_buffers())}


def differences(eager: nn.Module, meta: nn.Module) -> list[str]:
    want, got = values(eager), values(meta)
    assert want.keys() == got.keys()
    names = [k for k in want if not torch.equal(want[k], got[k])]
    return names + [f"{k} (meta)" for k, v in got.items() if v.is_meta]


BUILDS = {"example GPT": example_gpt, "example LightningModule": example_module, "nanoGPT": NanoGPT,
          "init zoo": InitZoo, "HF Llama": hf_llama, "HF Llama, tied": hf_llama_tied}


@pytest.mark.parametrize("name", list(BUILDS))
def test_a_recorded_build_equals_the_eager_build_bitwise(name):
    eager, meta, generator_agrees, generator_untouched = both_builds(BUILDS[name])
    assert not differences(eager, meta)
    assert generator_agrees, "the recording draws what the eager build draws"
    assert generator_untouched, "the replay gives the generator back as it found it"
    assert all(not p.is_meta for p in meta.parameters())


@pytest.mark.parametrize("config", ["cpu.yaml", "sharded_cpu.yaml", "gpu1.yaml"])
def test_the_example_configs_start_from_the_same_values_under_both_builds(config):
    """``examples/configs``' model shapes, the example LightningModule (``examples/module.py``) with its metrics."""
    shape = {k: v for k, v in yaml.safe_load((CONFIGS / config).read_text())["model"].items()
             if k not in ("optimizer", "lr_scheduler")}
    eager, meta, generator_agrees, _ = both_builds(lambda: example_module(**shape))
    assert not differences(eager, meta) and generator_agrees


@pytest.mark.parametrize("mutation", ["overwritten-init-draws-nothing", "re-seed-ignored"])
def test_a_broken_replay_fails_the_comparison(mutation, monkeypatch):
    """The comparison can fail: without the draws of an init whose values are overwritten (``apply(
    _init_weights)`` after the constructors' own), or without the state a re-seed left, the values differ."""
    if mutation == "overwritten-init-draws-nothing":
        monkeypatch.setattr(init_replay.Replay, "_draw", lambda self, op: None)
        build = NanoGPT
    else:
        real = init_replay.plan_replay

        def forget_reseeds(ops, roots, device):
            for op in ops[1:]:
                op.rng_state = None
            return real(ops, roots, device)
        monkeypatch.setattr("lightning_layerwise.engine.materialize.plan_replay", forget_reseeds)
        build = InitZoo
    eager, meta, _, _ = both_builds(build)
    assert differences(eager, meta)


def test_an_init_overwritten_unread_only_draws():
    """nanoGPT's constructors draw kaiming-uniform values that ``apply(_init_weights)`` overwrites unread: those
    ops only draw (on scratch memory), so no bucket is filled before the apply reaches it."""
    torch.manual_seed(0)
    with torch.device("meta"), record_init(CPU):
        model = NanoGPT()
    ops = [op for r in recordings_of(model) for op in r.ops]
    roots = {p.untyped_storage()._cdata for p in model.parameters()}
    plan = plan_replay(ops, roots, CPU)
    uniform = [live for op, live in zip(ops, plan.live) if op.name == "aten.uniform_"]
    normal = [live for op, live in zip(ops, plan.live) if op.name == "aten.normal_"]
    assert uniform and not any(uniform), "every constructor init is overwritten by the apply"
    assert sum(normal) == len(roots) - sum(1 for n, _ in model.named_parameters() if "ln" in n or "bias" in n)


class WithNorm(nn.Module):
    def __init__(self, norm: nn.Module | None = None) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = norm if norm is not None else RMSNorm(4)


class PoissonInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        with torch.no_grad():
            self.lin.weight.copy_(torch.poisson(torch.full((4, 4), 3.0)))


class LeftEmpty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(4))  # nothing writes it: an eager build holds whatever memory held
        self.bias = nn.Parameter(torch.zeros(4))


def unsupported(case: str) -> nn.Module:
    if case == "built before the recording":
        with torch.device("meta"):
            norm = RMSNorm(4)
        with torch.device("meta"), record_init(CPU):
            return WithNorm(norm)
    if case == "not recorded":
        with torch.device("meta"):
            return WithNorm()
    with torch.device("meta"), record_init(CPU):
        if case == "computed from an unrecorded tensor":
            outside = torch.empty(4, 4)  # uninitialized memory, read before anything writes it
            model = WithNorm()
            model.lin.weight = nn.Parameter(outside[:, :2].repeat(1, 2))
            return model
        return {"draws depending on values": PoissonInit, "left empty": LeftEmpty}[case]()


@pytest.mark.parametrize("case, named", [
    ("built before the recording", ["norm.weight", "RMSNorm", "reset_parameters"]),
    ("not recorded", ["norm.weight", "RMSNorm"]),
    ("computed from an unrecorded tensor", ["lin.weight", "aten.repeat"]),
    ("draws depending on values", ["lin.weight", "aten.poisson"]),
    ("left empty", ["scale", "LeftEmpty", "torch.empty"]),
])
def test_an_init_that_cannot_be_reproduced_is_refused_naming_it(case, named):
    model = unsupported(case)
    with pytest.raises(ValueError) as refused:
        check_materializable(model, CPU)
    message = str(refused.value)
    assert all(n in message for n in named), message
    assert "reset_parameters()" in message and "init_module(empty_init=True)" in message, "the supported ways"


def test_modules_without_a_recording_use_their_reset_parameters():
    """Built under a plain ``torch.device("meta")``: each module's ``reset_parameters`` fills it, in module order
    (equal to an eager build here, where every module's initializer fills exactly its own parameters)."""
    torch.manual_seed(1)
    eager = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    torch.manual_seed(1)
    materialize(meta, CPU)
    assert not differences(eager, meta)


def test_a_hugging_face_model_that_skipped_its_init_is_refused(monkeypatch):
    """Hugging Face skips ``init_weights`` where it sees the meta device; the recording shows it the device. If a
    version saw through that, the model would keep its constructors' values: refused, naming the model."""
    modeling = pytest.importorskip("transformers.modeling_utils")
    monkeypatch.setattr(modeling, "get_torch_context_manager_or_global_device", lambda: torch.device("meta"))
    with torch.device("meta"), record_init(CPU):
        model = llama()
    with pytest.raises(ValueError, match=r"the root \(LlamaForCausalLM\): Hugging Face skipped its init_weights"):
        check_materializable(model, CPU)
