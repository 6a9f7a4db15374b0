"""The tensor-parallel row of ``benchmarks/project.py``: local shapes, the exchange's bytes, the assignment.

Pure and fast: shapes and counts only, no weights, no process group, nothing timed.
"""

from __future__ import annotations

import pytest

from benchmarks import project
from benchmarks.model_shapes import _HEAD, ModelShapes, llama, model_shapes
from benchmarks.project_tp import (NS_BYTES, exchange_bytes, local_model, local_spec, position_work, project_tp,
                                   shard_dim)
from lightning_layerwise.engine.tp_exchange import assign
from lightning_layerwise.layout import plan_layout

HW = project.Hardware(project.H100_BF16_TFLOPS, 0.5, project.H100_HBM_TBPS, 0.8, 8, 4, 2, 5)
FABRIC = project.Fabric(project.NVLINK_GBPS, project.NIC_GBPS, 8, 8, 16, 10e-6)


def toy(vocab: int = 256) -> ModelShapes:
    specs = tuple(llama(3, 64, 192, n_heads=8, n_kv_heads=4, vocab=vocab))
    return ModelShapes("toy-llama", specs, _HEAD, sum(s.numel for s in specs), "test")


def test_llama3_70b_local_shapes_at_tp8():
    model = model_shapes("llama3-70b")
    local = {s.name: s.shape for s in local_model(model, 8).specs}
    b = "model.layers.0."
    assert local[b + "self_attn.q_proj.weight"] == (1024, 8192)
    assert local[b + "self_attn.k_proj.weight"] == (128, 8192)  # 8 KV heads x 128 = 1024 rows, 128 per rank
    assert local[b + "self_attn.v_proj.weight"] == (128, 8192)
    assert local[b + "self_attn.o_proj.weight"] == (8192, 1024)
    assert local[b + "mlp.gate_proj.weight"] == (3584, 8192)
    assert local[b + "mlp.up_proj.weight"] == (3584, 8192)
    assert local[b + "mlp.down_proj.weight"] == (8192, 3584)
    assert local["model.embed_tokens.weight"] == (16032, 8192)
    assert local["lm_head.weight"] == (16032, 8192)
    assert local[b + "input_layernorm.weight"] == (8192,) and local["model.norm.weight"] == (8192,)
    norms = sum(s.numel for s in model.specs if shard_dim(s) is None)
    assert local_model(model, 8).numel == (model.numel - norms) // 8 + norms


def test_uneven_shards_and_models_without_a_plan_are_refused():
    with pytest.raises(ValueError, match="does not divide"):
        local_model(toy(vocab=250), 8)
    with pytest.raises(ValueError, match="TP plan"):
        local_model(model_shapes("gpt2-124m"), 2)
    head = next(s for s in toy().specs if s.name == "lm_head.weight")
    assert local_spec(head, 4).shape == (64, 64)


def test_exchange_moves_t_minus_1_over_t_of_the_owned_shards_each_way():
    T = 4
    full = [64 * 64, 192 * 64, 64 * 192, 32 * 64, 64 * 64]
    sharded = [True, True, True, True, False]  # the last replicated: nothing there, the whole back
    local = [n // T if cut else n for n, cut in zip(full, sharded)]
    owner = assign([(64, 64), (192, 64), (64, 192), (32, 64), (64, 64)], T)
    ranks = exchange_bytes(full, local, sharded, owner, T, 4, NS_BYTES)
    shards = sum(n for n, cut in zip(local, sharded) if cut)
    for key, dtype in (("there_sent", 4), ("there_received", 4)):
        assert sum(r[key] for r in ranks) / T == (T - 1) / T * shards * dtype
    back = (T - 1) * (shards + full[-1]) * NS_BYTES
    assert sum(r["back_sent"] for r in ranks) == sum(r["back_received"] for r in ranks) == back
    owner_of_replicated = ranks[owner[-1]]
    assert owner_of_replicated["back_sent"] >= (T - 1) * full[-1] * NS_BYTES


@pytest.mark.parametrize("name, T, dp", [("toy", 4, 4), ("llama3-70b", 8, 64)])
def test_every_matrix_is_orthogonalized_exactly_once(name, T, dp):
    model = toy() if name == "toy" else model_shapes(name)
    local = local_model(model, T)
    layout = plan_layout(local.routed_specs(), dp)
    positions = position_work(model, local, layout, T, HW)
    muon = [s for s in model.specs if model.uses_muon(s)]
    assert sum(p["matrices"] for p in positions) == len(muon)
    total = sum(project.newton_schulz_flops(s.shape, HW.ns_steps) for s in muon)
    assert sum(sum(p["ns_flops"]) for p in positions) == pytest.approx(total)  # each on one TP rank
    assert sum(p["duplicated_flops"] for p in positions) == pytest.approx(total)
    assert sum(sum(p["whole_elements"]) for p in positions) == sum(s.numel for s in muon)


def test_row_on_a_toy_model():
    row = project_tp(toy(), 4, 4, HW, FABRIC, 2 ** 14, 1024, 0.4)
    o = row["optimizer"]
    assert row["gpus"] == 16 and row["nodes"] == 2  # 8 GPUs per node: two TP groups of 4 on each
    assert o["step_s"] >= o["bound_s"] > 0 and o["exchange_exposed"]
    assert o["step_s"] == pytest.approx(o["elementwise_s"] + o["newton_schulz_s"] + o["exchange_s"])
    assert o["duplicated"]["newton_schulz_s"] >= o["newton_schulz_s"]
    assert row["memory_bytes"]["buffers"] >= row["local_numel"] * (HW.param_bytes + HW.grad_bytes)


def test_flags():
    args = project.parse_args([])
    assert (args.tp, args.tp_dp, args.tp_model) == (8, 64, "llama3-70b")
    assert project.parse_args(["--tp", "0"]).tp == 0
    with pytest.raises(SystemExit):
        project.parse_args(["--tp", "3"])
