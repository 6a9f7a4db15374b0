"""``Trainer(strategy=LayerwiseStrategy(shard_parameters=True))`` against ``Trainer(strategy="ddp")``.

Both Trainers run in the same forked gloo worker on the same data and seed (as ``test_trainer.py``), for
10 optimizer steps with validation every 5, and every parameter is compared rank by rank (fp32: relative
error <= 1e-5; ``bf16-mixed``: 2e-2, autocast rounds activations differently in the two runs); every rank's
copy is bitwise rank 0's. The model is a small language model with what users' models have: an embedding
tied to the output layer, ``nn.MultiheadAttention`` inside ``nn.TransformerEncoderLayer`` (reads
``out_proj.weight`` without calling ``out_proj``), an unused layer, and a weight read in ``training_step``
before the forward (a penalty). Cases: AdamW at 2 ranks; Muon at 3 with accumulation and clipping by norm;
AdamW at 4 with non-reentrant activation checkpointing; Muon at 2 under ``bf16-mixed``; AdamW at 2 with
each block ``torch.compile``d (``aot_eager``: dynamo and AOTAutograd, no C compiler needed); and the
parameters after ``trainer.fit`` and ``llw.release`` own their storage again. Each eager case runs under the
timing fuzzer too. The model (``TinyLM``) and its data are in ``tests/helpers.py``.
Also: ``bf16-true`` (float32 masters of the shard) against the unsharded run, and a model built in
``trainer.init_module(empty_init=True)`` (on the meta device, materialized by the strategy) against ``ddp`` from
the same start.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

import lightning_layerwise as llw
from _dist import LATE_MS, run_distributed
from helpers import TINY_LM_STEPS as STEPS, TinyLM, rel_err, tiny_lm_loader as loader


class Probe(L.Callback):
    """What the sharded run really did: buckets freed between steps, reads outside modules gathered."""

    def __init__(self):
        self.seen = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        wrapper = trainer.strategy.session.wrapper
        self.seen["sharded"] = wrapper.shard_parameters and len(wrapper.buckets) > 1
        self.seen.setdefault("freed_between_steps", True)
        self.seen["freed_between_steps"] &= all(b.param.state.value == "freed" for b in wrapper.buckets)

    def on_train_end(self, trainer, pl_module):
        self.seen["guarded_reads"] = trainer.strategy.session.wrapper.param_sync.guarded_reads


def _fit(strategy, world, model_kwargs, trainer_kwargs):
    model = TinyLM(**model_kwargs)
    probe = Probe()
    if not isinstance(strategy, str):
        trainer_kwargs = dict(trainer_kwargs, callbacks=[probe])
    accumulate = trainer_kwargs.get("accumulate_grad_batches", 1)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=2, val_check_interval=5, num_sanity_val_steps=1, **trainer_kwargs)
    trainer.fit(model, loader(world, accumulate), loader(world, 1))
    llw.release(model)  # a sharded run goes on after fit; this ends it (a no-op after ddp)
    plain = all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in model.parameters())
    return {n: p.detach().clone() for n, p in model.named_parameters()}, (plain, probe.seen)


def _compare_worker(rank, world, model_kwargs, trainer_kwargs):
    ddp, _ = _fit("ddp_find_unused_parameters_true", world, model_kwargs, trainer_kwargs)
    sharded, plain = _fit(llw.LayerwiseStrategy(shard_parameters=True, bucket_size=3000), world, model_kwargs,
                          trainer_kwargs)
    return ddp, sharded, plain


CASES = {
    "adamw-2": (2, {"optimizer": "adamw"}, {}),
    "muon-3-accumulate-clip": (3, {"optimizer": "muon"}, {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5}),
    "adamw-4-activation-checkpointing": (4, {"optimizer": "adamw", "activation_checkpointing": True}, {}),
    "muon-2-bf16-mixed": (2, {"optimizer": "muon"}, {"precision": "bf16-mixed"}),
    "adamw-2-compiled-blocks": (2, {"optimizer": "adamw", "compile_blocks": "aot_eager"}, {}),
}


# Every case now and under the timing fuzzer; the compiled one (15 s a run, compiling) now only: its collectives
# are the eager cases' own.
RUNS = [pytest.param(case, late, id=f"{case}-{'late' if late else 'now'}") for case in CASES
        for late in ((None,) if "compiled" in case else (None, LATE_MS))]


@pytest.mark.slow
@pytest.mark.parametrize("case, late", RUNS)
def test_sharded_parameters_equal_ddp_under_the_trainer(case, late):
    world, model_kwargs, trainer_kwargs = CASES[case]
    tol = 2e-2 if "bf16" in case else 1e-5
    results = run_distributed(_compare_worker, world, model_kwargs, trainer_kwargs, late_ms=late)
    initial = TinyLM().state_dict()
    for rank, (ddp, sharded, (plain, seen)) in enumerate(results):
        assert plain, "after fit the parameters own their storage again"
        assert seen["sharded"] and seen["freed_between_steps"], seen
        assert seen["guarded_reads"] >= STEPS, "the penalty's read gathered its bucket at every step"
        assert max(rel_err(v, initial[n.replace("._orig_mod", "")]) for n, v in sharded.items()
                   if n != "unused.weight") > 1e-3
        for n in ddp:
            assert rel_err(sharded[n], ddp[n]) <= tol, (case, rank, n, rel_err(sharded[n], ddp[n]))
            assert torch.equal(sharded[n], results[0][1][n]), (case, rank, n)


def _bf16_true_worker(rank, world):
    out = []
    for shard in (False, True):
        model = TinyLM("adamw")
        trainer = L.Trainer(accelerator="cpu", devices=world, max_steps=6, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, precision="bf16-true",
                            strategy=llw.LayerwiseStrategy(shard_parameters=shard, bucket_size=3000))
        trainer.fit(model, loader(world, 1))
        llw.release(model)
        out.append({n: p.detach().float().clone() for n, p in model.named_parameters()})
    return out


def test_bf16_true_keeps_float32_masters_of_the_shard_and_equals_unsharded():
    """``bf16-true``: the optimizer steps float32 masters of what a rank steps (in its shard), so the run equals
    the unsharded one: the same gradients reach the same masters (bf16 parameters: one ulp, 2**-8)."""
    for unsharded, sharded in run_distributed(_bf16_true_worker, 2):
        for n in unsharded:
            assert rel_err(sharded[n], unsharded[n]) <= 2 ** -8, (n, rel_err(sharded[n], unsharded[n]))


class InitProbe(L.Callback):
    """The parameters as training starts (a sharded model's, gathered for it)."""

    def on_train_start(self, trainer, pl_module):
        with llw.full_parameters(pl_module):
            self.values = {n: p.detach().clone() for n, p in pl_module.named_parameters()}


def _meta_worker(rank, world):
    torch.manual_seed(rank)  # each rank's own random state: rank 0's values are broadcast
    probe = InitProbe()
    trainer = L.Trainer(accelerator="cpu", devices=world, max_steps=STEPS, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[probe],
                        strategy=llw.LayerwiseStrategy(shard_parameters=True, bucket_size=3000))
    with trainer.init_module(empty_init=True):
        model = TinyLM("muon")
    built_on_meta = all(p.is_meta for p in model.parameters())
    trainer.fit(model, loader(world, 1))
    llw.release(model)
    sharded = {n: p.detach().clone() for n, p in model.named_parameters()}
    reference = TinyLM("muon")
    loaded = reference.load_state_dict(probe.values, strict=False)  # named_parameters() lists the tied head once
    assert loaded.missing_keys == ["head.weight"] and not loaded.unexpected_keys, loaded
    L.Trainer(accelerator="cpu", devices=world, max_steps=STEPS, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False,
              strategy="ddp_find_unused_parameters_true").fit(reference, loader(world, 1))
    return built_on_meta, probe.values, sharded, {n: p.detach().clone() for n, p in reference.named_parameters()}


def test_a_model_built_in_init_module_empty_init_trains_as_ddp_from_the_same_start():
    """``trainer.init_module(empty_init=True)`` with sharded parameters builds the model on the meta device; the
    strategy materializes it when it wraps it (tied embedding, attention, norms), every rank with rank 0's values,
    and training from there equals ``ddp`` from the same values."""
    results = run_distributed(_meta_worker, 2)
    for rank, (built_on_meta, start, sharded, ddp) in enumerate(results):
        assert built_on_meta
        for n in ddp:
            assert torch.equal(start[n], results[0][1][n]), (rank, n)
            assert rel_err(sharded[n], ddp[n]) <= 1e-5, (rank, n, rel_err(sharded[n], ddp[n]))
