"""Tensor parallelism x data parallelism, projected (computed, never measured): one row for ``benchmarks/project.py``.

Run through ``benchmarks/project.py`` (``--tp 8 --tp-dp 64 --tp-model llama3-70b`` are the defaults; ``--tp 0``
leaves it out). The rates, latencies and byte counts are that module's, named there; the formulas are in
``docs/benchmarks/projection.md``, section "Tensor parallelism".

Note [projected tensor parallelism]
    ``T`` ranks of one node form a tensor-parallel group; ``D`` such groups, one per node, are the data-parallel
    positions, so a data-parallel group (one TP position of every node) has one rank per node and its
    collectives cross the NIC. Megatron's and torchtitan's plan for Llama: q, k, v, gate and up column-wise
    (``Shard(0)``), o and down row-wise (``Shard(1)``), the token embedding row-wise on the vocabulary
    (``Shard(0)``), the output head column-wise (``Shard(0)``), norms replicated. Each rank trains its local
    shards: the layout ``LayerwiseStrategy`` plans under TP (``plan_layout`` over the local shapes, one owner
    group of all ``D`` ranks: ``owner_group_size="auto"`` keeps one group under TP, and ``newton_schulz_cost``
    of the local shapes, the strategy's default) is the same on every TP position (Note [identical layouts]).
    Per step and rank:

    * data-parallel: the reduce-scatter (fp32) and all-gather (bf16) of every local bucket over the ``D``
      ranks, one per node, with the page's overlap model (``layerwise_comm`` with that communicator);
    * the TP exchange (Note [tensor-parallel exchange] in ``engine/tp_exchange.py``): position ``d``'s Muon
      matrices are assigned to TP ranks by ``assign`` on the full shapes; one all-to-all sends every shard
      (directions, in the gradient dtype) to its matrix's rank, a second sends the orthogonalized shards back
      (``ns_dtype``, bf16). It runs inside the optimizer step, between the momentum and Newton-Schulz and
      after Newton-Schulz, with nothing to overlap: it is counted exposed;
    * the optimizer step: Newton-Schulz of the whole matrices assigned to the rank, element-wise updates of its
      local shards (Muon's of the matrices its position owns, AdamW's of its element-wise pieces).

    TP's own communication (activations in the forward and backward, the replicated parameters' gradient
    all-reduce) is the same whatever the optimizer, and is left out.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from benchmarks.model_shapes import ModelShapes
from benchmarks.project import (ADAMW_BYTES_PER_ELEMENT, ADAMW_STATE_BYTES, MUON_BYTES_PER_ELEMENT, MUON_STATE_BYTES,
                                Comm, Fabric, Hardware, all_to_all_seconds, best_cost, layerwise_comm,
                                newton_schulz_flops, workload)
from lightning_layerwise.engine.tp_exchange import assign
from lightning_layerwise.layout import Layout, ParamSpec, plan_layout

TP_PLAN = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0, "o_proj": 1, "down_proj": 1,
           "embed_tokens": 0, "lm_head": 0}


"""Sharded dimension of a Llama parameter by module name (Megatron-LM's and torchtitan's plan: column-wise
``Shard(0)``, row-wise ``Shard(1)``, embedding on the vocabulary, head column-wise); anything else is
replicated (the norms)."""


NS_BYTES = 2


"""Bytes per element of the orthogonalized result sent back (``ns_dtype=torch.bfloat16``, Muon's default)."""


def shard_dim(spec: ParamSpec) -> int | None:
    """The dimension :data:`TP_PLAN` shards ``spec`` on, ``None`` where it is replicated."""
    parts = spec.name.split(".")
    return TP_PLAN.get(parts[-2]) if len(parts) >= 2 and len(spec.shape) >= 2 else None


def local_spec(spec: ParamSpec, T: int) -> ParamSpec:
    """``spec`` as one rank of a TP group of ``T`` holds it: the sharded dimension divided by ``T`` (even shards
    only, as the strategy requires)."""
    dim = shard_dim(spec)
    if dim is None:
        return spec
    if spec.shape[dim] % T:
        raise ValueError(f"tensor parallelism {T} does not divide dimension {dim} of {spec.name} {spec.shape}; "
                         "the strategy refuses uneven shards.")
    shape = list(spec.shape)
    shape[dim] //= T
    # The strategy costs a shard at its whole matrix's Newton-Schulz (engine/wrapper_setup.py layout_specs).
    matrices = (tuple(spec.shape),) if len(spec.shape) == 2 else spec.matrices
    return replace(spec, shape=tuple(shape), matrices=matrices)


def local_model(model: ModelShapes, T: int) -> ModelShapes:
    """The local shapes of every parameter, same names and order (refuses a model with nothing to shard)."""
    if not any(shard_dim(s) is not None for s in model.specs):
        raise ValueError(f"{model.name}: no parameter matches the Llama TP plan ({', '.join(TP_PLAN)}).")
    return replace(model, name=f"{model.name} (TP {T} local)", specs=tuple(local_spec(s, T) for s in model.specs))


def exchange_bytes(full: Sequence[int], local: Sequence[int], sharded: Sequence[bool], owner: Sequence[int], T: int,
                   dir_bytes: int, result_bytes: int) -> list[dict[str, int]]:
    """Bytes each TP rank sends and receives in the two all-to-alls of one data-parallel position, for matrices
    of ``full`` and ``local`` element counts assigned to ``owner`` (Note [tensor-parallel exchange]): there, a
    sharded matrix's shard from every other rank to its owner (a replicated one sends nothing); back, the owner
    sends each other rank its shard (or the whole of a replicated matrix)."""
    out = [{"there_sent": 0, "there_received": 0, "back_sent": 0, "back_received": 0} for _ in range(T)]
    for n_full, n_local, cut, r in zip(full, local, sharded, owner):
        piece = n_local if cut else n_full
        for t in range(T):
            if t == r:
                out[t]["there_received"] += (T - 1) * n_local * dir_bytes if cut else 0
                out[t]["back_sent"] += (T - 1) * piece * result_bytes
            else:
                out[t]["there_sent"] += n_local * dir_bytes if cut else 0
                out[t]["back_received"] += piece * result_bytes
    return out


def position_work(model: ModelShapes, local: ModelShapes, layout: Layout, T: int, hw: Hardware) -> list[dict]:
    """Per data-parallel position: its Muon matrices, their TP ranks, each rank's Newton-Schulz flops (whole and,
    for contrast, blockwise), its element-wise seconds and state, and the exchange's bytes per TP rank."""
    full = {s.name: s for s in model.specs}
    positions = [{"muon": [], "elementwise_s": 0.0, "state": 0.0} for _ in range(layout.ranks)]
    for spec in local.specs:  # registration order: the order of Muon's param group, which assign() sees
        slot = layout.params[spec.name]
        muon = local.uses_muon(spec)
        for piece in slot.pieces:
            share = piece.numel / slot.numel
            pos = positions[piece.owner]
            pos["elementwise_s"] += share * spec.numel * (MUON_BYTES_PER_ELEMENT if muon else ADAMW_BYTES_PER_ELEMENT
                                                          ) / hw.hbm_bytes_per_s
            pos["state"] += share * spec.numel * (MUON_STATE_BYTES if muon else ADAMW_STATE_BYTES)
            if muon:
                pos["muon"].append(spec)
    for pos in positions:
        mats = pos.pop("muon")
        shapes = [full[s.name].shape for s in mats]
        owner = assign(shapes, T)
        flops = [newton_schulz_flops(shape, hw.ns_steps) for shape in shapes]
        pos["matrices"] = len(mats)
        pos["ns_flops"] = [sum(f for f, r in zip(flops, owner) if r == t) for t in range(T)]
        pos["duplicated_flops"] = sum(flops)
        pos["blockwise_flops"] = sum(newton_schulz_flops(s.shape, hw.ns_steps) for s in mats)
        pos["whole_elements"] = [sum(full[s.name].numel for s, r in zip(mats, owner) if r == t) for t in range(T)]
        pos["sharded_elements"] = sum(full[s.name].numel for s in mats if shard_dim(s) is not None)
        pos["exchange"] = exchange_bytes([full[s.name].numel for s in mats], [s.numel for s in mats],
                                         [shard_dim(s) is not None for s in mats], owner, T, hw.grad_bytes, NS_BYTES)
    return positions


def _busiest(values: Sequence[dict[str, int]], *keys: str) -> int:
    return max((max(v[k] for k in keys) for v in values), default=0)


def _optimizer(model: ModelShapes, positions: list[dict], T: int, hw: Hardware, fabric: Fabric) -> dict:
    """The busiest rank's optimizer step: compute, the exchange (exposed), and the bounds and contrasts."""
    node = Comm(T, 1)
    steps, busiest = [], None
    for d, pos in enumerate(positions):
        # One all-to-all's time is set by the rank that sends or receives most; all_to_all_seconds spreads what
        # it is given over all T ranks (itself included), hence the T / (T - 1).
        there = all_to_all_seconds(_busiest(pos["exchange"], "there_sent", "there_received") * T // (T - 1), node,
                                   fabric)
        back = all_to_all_seconds(_busiest(pos["exchange"], "back_sent", "back_received") * T // (T - 1), node,
                                  fabric)
        ns = max(pos["ns_flops"]) / hw.flops_per_s
        steps.append((pos["elementwise_s"] + ns + there + back, d, ns, there, back))
    total_s, d, ns, there, back = max(steps)
    pos = positions[d]
    muon = [s for s in model.specs if model.uses_muon(s)]
    all_ns = sum(newton_schulz_flops(s.shape, hw.ns_steps) for s in muon) / hw.flops_per_s
    all_elementwise = sum(s.numel * (MUON_BYTES_PER_ELEMENT if model.uses_muon(s) else ADAMW_BYTES_PER_ELEMENT)
                          for s in model.specs) / hw.hbm_bytes_per_s
    largest = max(muon, key=lambda s: newton_schulz_flops(s.shape, hw.ns_steps))
    gather = max(p["sharded_elements"] for p in positions) * hw.grad_bytes
    return {
        "busiest_position": d, "matrices_at_busiest": pos["matrices"],
        "step_s": total_s, "newton_schulz_s": ns, "elementwise_s": pos["elementwise_s"],
        "exchange_s": there + back, "exchange_there_s": there, "exchange_back_s": back, "exchange_exposed": True,
        "compute_s_busiest_rank": max(p["elementwise_s"] + max(p["ns_flops"]) / hw.flops_per_s for p in positions),
        "bound_s": (all_ns + all_elementwise) / (T * len(positions)),
        "largest_matrix": {"name": largest.name, "shape": list(largest.shape),
                           "newton_schulz_s": newton_schulz_flops(largest.shape, hw.ns_steps) / hw.flops_per_s},
        "duplicated": {"newton_schulz_s": max(p["duplicated_flops"] for p in positions) / hw.flops_per_s,
                       "all_gather_s": best_cost("all_gather", gather, node, fabric).seconds,
                       "all_gather_bytes_received": gather * (T - 1) // T},
        "blockwise": {"newton_schulz_flops": max(p["blockwise_flops"] for p in positions),
                      "newton_schulz_s": max(p["blockwise_flops"] for p in positions) / hw.flops_per_s},
    }


def project_tp(model: ModelShapes, T: int, dp: int, hw: Hardware, fabric: Fabric, bucket_size: int, tokens: int,
               mfu: float) -> dict:
    """The row of Note [projected tensor parallelism]: ``T`` ranks of a node in each TP group, ``dp`` groups."""
    local = local_model(model, T)
    layout = plan_layout(local.routed_specs(), dp, bucket_size)
    work = workload(model, tokens, hw.peak_tflops, mfu)  # each GPU: 1/T of the flops of T x tokens
    nodes = dp * T // hw.gpus_per_node  # the data-parallel group: one TP position of every TP group
    comm = layerwise_comm(local, layout, dp, dp, work, fabric, hw.grad_bytes, hw.param_bytes,
                          group=Comm(dp, nodes))
    positions = position_work(model, local, layout, T, hw)
    exchange = [e for p in positions for e in p["exchange"]]
    return {
        "model": model.name, "tp": T, "dp": dp, "gpus": T * dp, "nodes": nodes, "tokens_per_gpu": tokens,
        "backward_s": work.backward_s, "forward_s": work.forward_s, "padding": layout.padding_fraction,
        "local_numel": local.numel, "sharded_dims": {s.name.split(".")[-2]: shard_dim(s) for s in model.specs
                                                     if shard_dim(s) is not None},
        "data_parallel": {"comm_s": comm["in_group_s"], "exposed_s": comm["in_group_exposed_s"],
                          "ops": comm["in_group_ops"], "bytes_per_element": comm["bytes_per_element"],
                          "communicator": {"ranks": dp, "nodes": nodes}},
        "exchange_bytes_busiest": {k: _busiest(exchange, k) for k in exchange[0]},
        "exchange_dtype_bytes": {"directions": hw.grad_bytes, "results": NS_BYTES},
        "optimizer": _optimizer(model, positions, T, hw, fabric),
        "memory_bytes": {
            "optimizer_state": max(p["state"] for p in positions),
            "buffers": layout.total_numel * (hw.param_bytes + hw.grad_bytes),
            # The received shards and the joined matrix in the directions' dtype, the result and its send buffer
            # in ns_dtype; Newton-Schulz's own temporaries not counted.
            "exchange_transient": max(max(p["whole_elements"]) for p in positions) * 2 * (hw.grad_bytes + NS_BYTES),
        },
    }


TP_TABLE_START, TP_TABLE_END = "<!-- tp-table:start -->", "<!-- tp-table:end -->"


def tp_table(row: dict) -> str:
    """The row as a table of quantities, each with its formula (``docs/benchmarks/projection.md``)."""
    T, D, o, m = row["tp"], row["dp"], row["optimizer"], row["memory_bytes"]
    dp, x, dt = row["data_parallel"], row["exchange_bytes_busiest"], row["exchange_dtype_bytes"]
    ms = lambda s: f"{1e3 * s:.1f}"  # noqa: E731
    gb = lambda b: f"{b / 1e9:.2f}"  # noqa: E731
    lines = [
        ("configuration", f"{row['model']}, TP {T} (one node) × DP {D} = {row['gpus']} GPUs on {row['nodes']} nodes",
         "local shapes: the sharded dimension ÷ T"),
        ("local parameters per rank", f"{row['local_numel'] / 1e9:.2f}B, padding {100 * row['padding']:.1f}%",
         f"`plan_layout` over the local shapes, each shard costed at its whole matrix's Newton–Schulz, one owner group of {D}"),
        ("backward (forward) ms", f"{ms(row['backward_s'])} ({ms(row['forward_s'])})",
         "as the DP rows: 6 N × tokens per GPU at the MFU (each GPU 1/T of T × the tokens)"),
        ("DP reduce-scatter + all-gather ms (NIC)", ms(dp["comm_s"]),
         f"every local bucket over {D} ranks on {row['nodes']} nodes, 4 + 2 B per element: "
         + ("one NIC each" if D == row["nodes"] else f"{D // row['nodes']} ranks per node")),
        ("DP exposed ms", ms(dp["exposed_s"]), f"the page's overlap model; {dp['ops']} operations"),
        ("TP exchange MB there (sent / received)", f"{x['there_sent'] / 1e6:.0f} / {x['there_received'] / 1e6:.0f}",
         f"busiest rank: shards of its matrices from the other T − 1 ranks, {dt['directions']} B per element"),
        ("TP exchange MB back (sent / received)", f"{x['back_sent'] / 1e6:.0f} / {x['back_received'] / 1e6:.0f}",
         f"the orthogonalized shards, {dt['results']} B per element (bf16 `ns_dtype`)"),
        ("TP exchange ms (there + back), exposed", f"{ms(o['exchange_s'])} ({ms(o['exchange_there_s'])} + "
         f"{ms(o['exchange_back_s'])})", "`all_to_all_seconds` on NVLink, the busiest rank's bytes; inside the step"),
        ("Newton–Schulz ms, busiest rank", ms(o["newton_schulz_s"]),
         f"whole matrices `assign` gives it (position {o['busiest_position']}: {o['matrices_at_busiest']} "
         "matrices over 8 ranks)"),
        ("element-wise ms", ms(o["elementwise_s"]), "its local shards: Muon 26 B, AdamW 30 B per element"),
        ("optimizer step ms (with the exchange)", ms(o["step_s"]), "element-wise + Newton–Schulz + exchange"),
        ("bound: everything ÷ GPUs, ms", ms(o["bound_s"]),
         f"all Newton–Schulz and element-wise work ÷ {row['gpus']}"),
        ("largest matrix ms", ms(o["largest_matrix"]["newton_schulz_s"]),
         f"Newton–Schulz of one {' × '.join(map(str, o['largest_matrix']['shape']))} matrix"),
        ("contrast: duplicated, Newton–Schulz ms", ms(o["duplicated"]["newton_schulz_s"]),
         f"every TP rank orthogonalizes all its position's matrices; plus an all-gather of "
         f"{o['duplicated']['all_gather_bytes_received'] / 1e9:.1f} GB, {ms(o['duplicated']['all_gather_s'])} ms"),
        ("contrast: blockwise, Newton–Schulz ms", ms(o["blockwise"]["newton_schulz_s"]),
         f"each shard alone ({o['blockwise']['newton_schulz_flops'] / 1e12:.1f} TFLOP): a different optimizer"),
        ("optimizer state GB", gb(m["optimizer_state"]), "Muon 8 B, AdamW 12 B per owned local element"),
        ("buffers GB", gb(m["buffers"]), "bf16 parameters + fp32 gradients of the local layout, padding included"),
        ("exchange working set GB", gb(m["exchange_transient"]),
         f"transient: its whole matrices × (2 × {dt['directions']} + 2 × {dt['results']}) B"),
    ]
    from benchmarks import harness

    return harness.markdown_table(["quantity", "value", "formula"], [list(line) for line in lines])
