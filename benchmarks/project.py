"""Optimizer-step time, communication time and memory per rank, projected from counts to many GPUs.

Run (a few seconds; no GPU needed, nothing is timed):

    .venv/bin/python benchmarks/project.py
    .venv/bin/python benchmarks/project.py --models llama3-70b --efficiency 0.35 --inter-node-gbps 25

Nothing here is measured. Each number is a count (flops, bytes) divided by a
rate given as a flag; the defaults describe H100 SXM nodes of 8 GPUs:

* Newton–Schulz: the flops of ``newton_schulz`` (``lightning_layerwise.optim.muon``):
  an ``m x n`` matrix with ``m <= n`` (tall ones are transposed) costs per step
  ``X @ X.T`` (2 m^2 n), ``A @ A`` (2 m^3) and ``B @ X`` (2 m^2 n), times
  ``--ns-steps``; run at ``--peak-tflops`` (989, bf16 dense) x ``--efficiency`` (0.5).
* Element-wise updates are memory-bound at ``--hbm-tbps`` (3.35) x
  ``--hbm-efficiency`` (0.8). AdamW moves 30 bytes per element (fp32 gradient
  read, fp32 master weight, exp_avg and exp_avg_sq read and written, bf16
  weight written); Muon's element-wise part moves 26 (fp32 gradient read,
  fp32 momentum and master weight read and written, bf16 Newton–Schulz input
  written and output read, bf16 weight written).
* Collectives are NCCL rings: reduce-scatter and all-gather move
  ``(dp - 1) / dp`` of the buffer's bytes through every GPU, all-reduce twice
  that, at the bus bandwidth of the slowest link: ``--nvlink-gbps`` (450) within
  a node of ``--gpus-per-node`` (8), ``--inter-node-gbps`` (50 per GPU) beyond.
  Gradients are reduced in fp32 (``--grad-bytes 4``), parameters gathered in
  bf16 (``--param-bytes 2``).

Configurations: ``layerwise_muon`` (each rank runs Newton–Schulz only on the
matrices it owns and AdamW on its pieces of the rest; the layout is the real
one of ``LayerwiseStrategy``'s defaults: element-wise fill and the owner group
size ``g`` of ``choose_owner_group_size``, planned with this projection's
per-parameter time as cost; the busiest rank sets the step; gradients
reduce-scattered and parameters all-gathered inside the owner group over the
whole buffer, padding included, and each shard's chunks reduce-scattered and
all-gathered across the ``dp / g`` groups that share its stepping), ``ddp_muon`` (every
rank orthogonalizes every matrix; gradients all-reduced) and ``ddp_adamw``.
Optimizer state per rank: fp32 master weight + exp_avg + exp_avg_sq (12 bytes)
per AdamW element, fp32 master weight + momentum (8 bytes) per Muon element,
for what the rank steps. Buffers per rank: bf16 parameters + fp32 gradients,
padding included; with ``shard_parameters=True`` (``layerwise_sharded_muon``, the same step and
state) 1/g of them plus a working set of ``SHARDED_WORKING_BUCKETS`` full buckets of both.
Activations are not counted.

Writes ``benchmarks/results/projection.json``, the table into
``docs/benchmarks/projection.md`` (between its table markers) and
``docs/benchmarks/projection.png``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import harness  # noqa: E402
from benchmarks.model_shapes import MODELS, ModelShapes, model_shapes  # noqa: E402
from lightning_layerwise.layout import DEFAULT_BUCKET_SIZE, ParamSpec, choose_owner_group_size  # noqa: E402

ADAMW_BYTES_PER_ELEMENT = 30
MUON_BYTES_PER_ELEMENT = 26
ADAMW_STATE_BYTES = 12
MUON_STATE_BYTES = 8
CONFIGS = ("layerwise_muon", "ddp_muon", "ddp_adamw")


@dataclass(frozen=True)
class Hardware:
    """The rates every count is divided by (see the module docstring)."""

    peak_tflops: float
    efficiency: float
    hbm_tbps: float
    hbm_efficiency: float
    nvlink_gbps: float
    inter_node_gbps: float
    gpus_per_node: int
    grad_bytes: int
    param_bytes: int
    ns_steps: int

    @property
    def flops_per_s(self) -> float:
        return self.peak_tflops * 1e12 * self.efficiency

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_tbps * 1e12 * self.hbm_efficiency

    def bus_bytes_per_s(self, dp: int) -> float:
        """Ring bus bandwidth: the slowest link a ring over ``dp`` GPUs crosses."""
        return (self.nvlink_gbps if dp <= self.gpus_per_node else self.inter_node_gbps) * 1e9


def newton_schulz_flops(shape: tuple[int, ...], steps: int) -> float:
    """Matmul flops of ``newton_schulz`` on one matrix (higher-dim kernels as ``out x rest``)."""
    rows = shape[0]
    cols = 1
    for d in shape[1:]:
        cols *= d
    m, n = min(rows, cols), max(rows, cols)
    return steps * (2 * m * m * n + 2 * m ** 3 + 2 * m * m * n)


def update_seconds(model: ModelShapes, spec: ParamSpec, hw: Hardware) -> float:
    """Optimizer time of one parameter on its owner: Newton–Schulz + element-wise for Muon, AdamW otherwise."""
    if model.uses_muon(spec):
        return (newton_schulz_flops(spec.shape, hw.ns_steps) / hw.flops_per_s
                + spec.numel * MUON_BYTES_PER_ELEMENT / hw.hbm_bytes_per_s)
    return spec.numel * ADAMW_BYTES_PER_ELEMENT / hw.hbm_bytes_per_s


def state_bytes(model: ModelShapes, spec: ParamSpec, muon: bool) -> int:
    return spec.numel * (MUON_STATE_BYTES if muon and model.uses_muon(spec) else ADAMW_STATE_BYTES)


def ring_seconds(numel: int, bytes_per_element: int, dp: int, hw: Hardware, passes: float) -> float:
    """One ring collective over ``numel`` elements: ``passes`` = 1 for reduce-scatter/all-gather, 2 for all-reduce."""
    if dp == 1:
        return 0.0
    return passes * (dp - 1) / dp * numel * bytes_per_element / hw.bus_bytes_per_s(dp)


SHARDED_WORKING_BUCKETS = 6
"""Full buckets a rank holds at once with ``shard_parameters=True``, estimated: ``prefetch_depth + 1`` (3) of
parameters and as many of gradients (docs/design.md, "Sharded parameters", measures one step)."""


def project(model: ModelShapes, dp: int, hw: Hardware, bucket_size: int) -> dict:
    """Per-rank time and memory of the three configurations at ``dp`` ranks."""
    seconds = {s.name: update_seconds(model, s, hw) for s in model.specs}
    by_name = {s.name: s for s in model.specs}
    g, layout = choose_owner_group_size(model.routed_specs(), dp, bucket_size, cost=lambda s: seconds[s.name],
                                        ranks_per_node=hw.gpus_per_node, grad_bytes=hw.grad_bytes)
    owned_s, owned_state = [0.0] * layout.ranks, [0.0] * layout.ranks
    for name, slot in layout.params.items():
        for piece in slot.pieces:  # AdamW parameters are split across ranks (element-wise fill)
            share = piece.numel / slot.numel
            owned_s[piece.owner] += seconds[name] * share
            owned_state[piece.owner] += state_bytes(model, by_name[name], muon=True) * share
    numel = model.numel
    ns_all = sum(seconds[s.name] for s in model.specs)
    adamw_all = numel * ADAMW_BYTES_PER_ELEMENT / hw.hbm_bytes_per_s
    all_reduce = ring_seconds(numel, hw.grad_bytes, dp, hw, 2)
    # Inside the owner group of g ranks: reduce-scatter and all-gather; across the dp/g groups (Note [replica
    # sharing]): the uneven reduce-scatter of the shard's gradient into chunks and all-gather of the chunks'
    # parameters, (R-1)/R of the shard each in a ring (over links as slow as the whole world's).
    replicas = dp // g
    rs_ag = (ring_seconds(layout.total_numel, hw.grad_bytes, g, hw, 1)
             + ring_seconds(layout.total_numel, hw.param_bytes, g, hw, 1))
    if replicas > 1:
        rs_ag += ((replicas - 1) / replicas * layout.total_numel / g * (hw.grad_bytes + hw.param_bytes)
                  / hw.bus_bytes_per_s(dp))
    return {
        "model": model.name, "dp": dp, "g": g, "padding": layout.padding_fraction,
        "optimizer_s": {"layerwise_muon": max(owned_s), "ddp_muon": ns_all, "ddp_adamw": adamw_all},
        "optimizer_s_mean_rank_layerwise": sum(owned_s) / layout.ranks,
        "comm_s": {"layerwise_muon": rs_ag, "ddp_muon": all_reduce, "ddp_adamw": all_reduce},
        "optimizer_state_bytes": {
            "layerwise_muon": max(owned_state),
            "ddp_muon": sum(state_bytes(model, s, muon=True) for s in model.specs),
            "ddp_adamw": numel * ADAMW_STATE_BYTES,
        },
        "buffer_bytes": {"layerwise_muon": layout.total_numel * (hw.param_bytes + hw.grad_bytes),
                         "layerwise_sharded_muon": layout.total_numel / g * (hw.param_bytes + hw.grad_bytes)
                         + SHARDED_WORKING_BUCKETS * bucket_size * (hw.param_bytes + hw.grad_bytes),
                         "ddp_muon": numel * (hw.param_bytes + hw.grad_bytes),
                         "ddp_adamw": numel * (hw.param_bytes + hw.grad_bytes)},
    }


def table(rows: list[dict]) -> str:
    head = ["model", "dp", "g", "padding", "opt ms layerwise_muon", "opt ms ddp_muon", "opt ms ddp_adamw",
            "comm ms layerwise (RS+AG)", "comm ms ddp (AR)", "opt state GB layerwise_muon",
            "opt state GB ddp_muon", "opt state GB ddp_adamw", "buffers GB layerwise", "buffers GB layerwise sharded",
            "buffers GB ddp", "state+buffers GB ddp_adamw / layerwise / sharded"]
    body = []
    for r in rows:
        o, c, m, b = r["optimizer_s"], r["comm_s"], r["optimizer_state_bytes"], r["buffer_bytes"]
        cells = [r["model"], str(r["dp"]), str(r["g"]), f"{100 * r['padding']:.1f}%"]
        cells += [f"{1e3 * o[k]:.2f}" for k in CONFIGS]
        cells += [f"{1e3 * c['layerwise_muon']:.0f}", f"{1e3 * c['ddp_adamw']:.0f}"]
        cells += [f"{m[k] / 1e9:.2f}" for k in CONFIGS]
        cells += [f"{b['layerwise_muon'] / 1e9:.1f}", f"{b['layerwise_sharded_muon'] / 1e9:.1f}",
                  f"{b['ddp_adamw'] / 1e9:.1f}"]
        totals = (m["ddp_adamw"] + b["ddp_adamw"], m["layerwise_muon"] + b["layerwise_muon"],
                  m["layerwise_muon"] + b["layerwise_sharded_muon"])
        cells.append(" / ".join(f"{t / 1e9:.1f}" for t in totals))
        body.append(cells)
    return harness.markdown_table(head, body)


def plot(rows: list[dict], path: Path) -> None:
    plt = harness.pyplot()
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(len(models), 3, figsize=(16, 4.2 * len(models)), squeeze=False)
    colors = {"layerwise_muon": "C0", "ddp_muon": "C3", "ddp_adamw": "C2"}
    for i, name in enumerate(models):
        mine = [r for r in rows if r["model"] == name]
        dps = [r["dp"] for r in mine]
        for k in CONFIGS:
            axes[i][0].plot(dps, [1e3 * r["optimizer_s"][k] for r in mine], marker="o", color=colors[k], label=k)
            axes[i][2].plot(dps, [r["optimizer_state_bytes"][k] / 1e9 for r in mine], marker="o", color=colors[k],
                            label=k)
        axes[i][1].plot(dps, [1e3 * r["comm_s"]["layerwise_muon"] for r in mine], marker="o", color="C0",
                        label="layerwise: reduce-scatter + all-gather (padding included)")
        axes[i][1].plot(dps, [1e3 * r["comm_s"]["ddp_adamw"] for r in mine], marker="o", color="C2",
                        label="ddp: all-reduce")
        axes[i][0].set(title=f"{name}: optimizer step (busiest rank)", ylabel="ms")
        axes[i][1].set(title=f"{name}: gradient + parameter communication", ylabel="ms")
        axes[i][2].set(title=f"{name}: optimizer state per rank", ylabel="GB")
        for ax in axes[i]:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(dps, [str(d) for d in dps])
            ax.set_xlabel("dp (GPUs)")
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=8)
    fig.suptitle("Projected from flop and byte counts (not measured): H100 rates as in docs/benchmarks/projection.md")
    fig.tight_layout()
    harness.save_figure(fig, path, dpi=100)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["llama3-8b", "llama3-70b"], choices=MODELS)
    p.add_argument("--dp", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512, 1024])
    p.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense matmul peak (H100 SXM: 989)")
    p.add_argument("--efficiency", type=float, default=0.5, help="share of the peak Newton–Schulz achieves")
    p.add_argument("--hbm-tbps", type=float, default=3.35, help="HBM bandwidth, TB/s (H100 SXM: 3.35)")
    p.add_argument("--hbm-efficiency", type=float, default=0.8, help="share of HBM bandwidth element-wise kernels get")
    p.add_argument("--nvlink-gbps", type=float, default=450.0, help="ring bus bandwidth within a node, GB/s")
    p.add_argument("--inter-node-gbps", type=float, default=50.0, help="ring bus bandwidth across nodes, GB/s per GPU")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--grad-bytes", type=int, default=4, help="bytes per gradient element reduced (fp32: 4)")
    p.add_argument("--param-bytes", type=int, default=2, help="bytes per parameter element gathered (bf16: 2)")
    p.add_argument("--ns-steps", type=int, default=5)
    p.add_argument("--bucket-size", type=int, default=DEFAULT_BUCKET_SIZE)
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/projection.json")
    p.add_argument("--markdown", type=Path, default=ROOT / "docs/benchmarks/projection.md")
    p.add_argument("--png", type=Path, default=ROOT / "docs/benchmarks/projection.png")
    p.add_argument("--no-write", action="store_true", help="print the table only")
    args = p.parse_args(argv)
    for flag in ("peak_tflops", "efficiency", "hbm_tbps", "hbm_efficiency", "nvlink_gbps", "inter_node_gbps"):
        if getattr(args, flag) <= 0:
            p.error(f"--{flag.replace('_', '-')}={getattr(args, flag)} must be positive")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    hw = Hardware(args.peak_tflops, args.efficiency, args.hbm_tbps, args.hbm_efficiency, args.nvlink_gbps,
                  args.inter_node_gbps, args.gpus_per_node, args.grad_bytes, args.param_bytes, args.ns_steps)
    rows = [project(model_shapes(name), dp, hw, args.bucket_size) for name in args.models for dp in args.dp]
    text = table(rows)
    print(text)
    if args.no_write:
        return
    harness.write_json(args.json, {"hardware": asdict(hw), "bucket_size": args.bucket_size,
                                   "bytes_per_element": {"adamw_update": ADAMW_BYTES_PER_ELEMENT,
                                                         "muon_update": MUON_BYTES_PER_ELEMENT,
                                                         "adamw_state": ADAMW_STATE_BYTES,
                                                         "muon_state": MUON_STATE_BYTES},
                                   "rows": rows})
    harness.write_between_markers(args.markdown, text, title="Projection to many GPUs (computed, not measured)")
    plot(rows, args.png)
    print(f"wrote {args.json}, {args.markdown}, {args.png}", file=sys.stderr)


if __name__ == "__main__":
    main()
