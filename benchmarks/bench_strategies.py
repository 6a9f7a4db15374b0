"""Data-parallel strategies and optimizers on the example GPT: time, memory, communication, loss.

Run from the repository root. The default runs the CPU matrix (2 model sizes x 1 and 2
ranks on gloo, 9 configurations at 2 ranks and 5 at 1 rank, 3 interleaved repeats: 84
runs, 998 s on 2 CPU cores shared with other work) and writes
``benchmarks/results/strategies_cpu.json``,
``docs/benchmarks/strategies_cpu.md`` and ``docs/benchmarks/strategies_cpu_*.png``::

    .venv/bin/python benchmarks/bench_strategies.py
    .venv/bin/python benchmarks/bench_strategies.py --sizes tiny --devices 2 --configs ddp_adamw,layerwise_adamw
    .venv/bin/python benchmarks/bench_strategies.py --from-json benchmarks/results/strategies_cpu.json  # tables, plots
    python benchmarks/bench_strategies.py --accelerator gpu --sizes gpt2-small,gpt2-medium --devices 1,8

Configurations (peers in the same run: same seed, data order and initial weights):

    ddp_adamw                   Trainer(strategy="ddp"), torch.optim.AdamW
    ddp_muon                    "ddp", llw.Muon replicated: every rank runs Newton-Schulz on every
                                matrix and keeps all the optimizer state
    ddp_torch_muon              "ddp", torch.optim.Muon on the hidden matrices + torch.optim.AdamW on
                                the rest, stepped as one optimizer (:class:`MuonAndAdamW`), replicated
    ddp_zero_muon               "ddp", torch.distributed.optim.ZeroRedundancyOptimizer(llw.Muon):
                                each rank steps its partition, then broadcasts it
    fsdp2_adamw                 Lightning ModelParallelStrategy with FSDP2 ``fully_shard(block,
                                reshard_after_forward=False)`` per block and on the root (ZeRO-2-like
                                peer: gradients and optimizer state sharded), torch.optim.AdamW
    layerwise_adamw             Trainer(strategy=LayerwiseStrategy(overlap_param_gather=True)), AdamW
    layerwise_adamw_no_overlap  the same with overlap_param_gather=False (2+ ranks only)
    layerwise_muon              LayerwiseStrategy(overlap_param_gather=True), llw.Muon
    layerwise_muon_no_overlap   the same with overlap_param_gather=False (2+ ranks only)
    layerwise_sharded_adamw     LayerwiseStrategy(shard_parameters=True): parameters and gradients
                                sharded too (1/group per rank), buckets gathered for each forward and
                                backward, AdamW (2+ ranks only)
    layerwise_sharded_muon      the same with llw.Muon
    fsdp2_adamw_reshard         fsdp2_adamw with reshard_after_forward=True (ZeRO-3-like: parameters
                                freed after each block's forward, gathered again for its backward)
    fsdp2_torch_muon_reshard    the same with torch.optim.Muon + AdamW (:class:`MuonAndAdamW`) on the
                                DTensor shards

    Tensor parallelism (``Config.tp = 2``; run where the rank count is a multiple of 4: data-parallel
    2+ x tensor-parallel 2; the module gets ``tensor_parallel=True``, so its ``configure_model``
    applies the example GPT's plan over ``device_mesh["tensor_parallel"]``; a tensor-parallel group
    reads one batch, so the global batch is devices / 2 per-rank batches.
    ``benchmarks/bench_tensor_parallel.py`` runs these with their report):

    layerwise_tp_muon           LayerwiseStrategy(tensor_parallel_size=2, overlap_param_gather=True),
                                llw.Muon (each TP matrix orthogonalized whole, once: two
                                all_to_all_single per step)
    layerwise_tp_adamw          the same with AdamW
    fsdp2_tp_adamw              ModelParallelStrategy(data_parallel_size=devices/2,
                                tensor_parallel_size=2): the same plan, then fully_shard per block and
                                on the root over device_mesh["data_parallel"], AdamW; clipping per mesh
                                (Note [clipping FSDP2 with TP] in :func:`clip_over_meshes`)
    fsdp2_tp_torch_muon         the same with torch.optim.Muon + AdamW (:class:`MuonAndAdamW`) on its
                                2-D DTensors

AdamW: ``lr=1e-3, betas=(0.9, 0.95), weight_decay=0``. Muon (both implementations):
``lr=0.02``, momentum 0.95, Nesterov, 5 Newton-Schulz steps in ``--ns-dtype`` (bf16;
torch.optim.Muon always uses bf16), ``adjust_lr`` "original", no weight decay; AdamW at
``3e-3`` for embeddings, the tied head, biases and norms. Gradient clipping by norm 1.0.

Sizes (``--sizes``): ``tiny`` is the model and batch of ``examples/configs/cpu.yaml``;
``wide`` is a CPU size where Newton-Schulz is about half of the replicated Muon step
(wide matrices, short sequences, small batch); ``30m`` (31 M parameters) compares sharded
parameters with their peers at 2 and 4 ranks, and ``120m`` (126 M) is its largest size, for a
per-rank memory cap; ``tp10m`` (10.7 M) is the tensor-parallel comparison at 4 ranks;
``gpt2-small`` and ``gpt2-medium`` are GPU sizes.

Each run is a fresh ``python benchmarks/bench_strategies.py --_worker NAME ...`` process;
Lightning's launcher re-runs that command line for ranks 1..N-1, so every rank enters
the same worker; rank 0 writes the result. Repeats are interleaved round-robin over all
runs (the order rotates each repeat), so a change of machine load hits every
configuration alike; tables give medians over repeats.

Measured per run, after the warm-up steps (wall times are the slowest rank's per step,
then the median over steps):

* step: wall time between ``on_train_batch_end`` of consecutive steps; tokens/s is the
  global batch's tokens divided by it; step CPU: the rank's process CPU time;
* fwd+bwd: ``on_train_batch_start`` to ``on_before_optimizer_step``; clip: gradient
  clipping; opt: ``optimizer.step()`` (for ZeRO including its broadcasts);
* NS: wall time inside Newton-Schulz (``llw.optim.muon.orthogonalize`` or
  ``torch.optim._muon._zeropower_via_newtonschulz``), summed per step;
* communication: every ``torch.distributed`` collective called from Python is counted
  (see :class:`CommCounter`): the layer-wise reduce-scatters, all-gathers and norm
  all-reduce, ZeRO's broadcasts, FSDP2's all-gathers and reduce-scatters, the tensor-parallel
  exchange's all_to_all_single; DTensor's functional collectives (the row-wise layers'
  all-reduce, redistributions) under ``dtensor_<name>``; for DDP's reducer see Note [DDP's bytes]. Bytes are the tensors handed to each collective
  (all-reduce, broadcast: the tensor; all-gather: the output; reduce-scatter: the
  input); "ring" bytes are what one rank sends in a ring algorithm (all-reduce
  ``2(n-1)/n`` of the bytes, the others ``(n-1)/n``);
* exposed communication: wall time the training thread was blocked on communication.
  ``layerwise``: the wrapper's own ``grad_sync.waiter.seconds`` (Note [timing communication
  waits] in ``lightning_layerwise/engine/waiter.py``: reduce-scatter and all-gather
  waits, the synchronous norm all-reduce). Others: time in ``Work.wait()`` and in
  synchronous collectives called from Python, plus for DDP the tail of backward after
  the last gradient was accumulated (``on_after_backward`` minus the last
  post-accumulate-grad hook), where the reducer waits for its all-reduces and copies
  the buckets into ``.grad``. With 2+ ranks every such wait also absorbs the other
  rank's lateness (skew), which on a shared machine is part of what is measured;
* memory: optimizer-state bytes per rank (local shards for FSDP2's DTensors, the local
  optimizer for ZeRO), peak RSS per rank on CPU (glibc keeps freed blocks unless told not
  to: run with ``MALLOC_MMAP_THRESHOLD_=65536`` to compare what configurations free, as
  docs/benchmarks/sharded_cpu.md was), ``torch.cuda.max_memory_allocated``
  on GPU;
* the training loss of every step (mean over ranks = the global batch's loss).

Note [overlap in the benchmark]
    The probe callback overrides ``on_train_batch_end``, so with
    ``overlap_param_gather="auto"`` the strategy would complete the all-gather inside
    every step. It only reads the loss and the clock, so the ``layerwise`` rows pass
    ``overlap_param_gather=True`` (or ``False`` for the ``_no_overlap`` rows) explicitly.

Note [one optimizer for torch.optim.Muon]
    Lightning's automatic optimization steps one optimizer per training step (and
    ``strategy="layerwise"`` requires one). :class:`MuonAndAdamW` is a
    ``torch.optim.Optimizer`` whose ``param_groups`` are those of an inner
    ``torch.optim.Muon`` and an inner ``torch.optim.AdamW`` (the same dicts, so clipping,
    LR schedulers and hooks see every parameter) and whose ``step`` steps both; manual
    optimization would also work but changes the training step, which every other row
    shares.

Note [DDP's bytes]
    DDP's reducer calls the process group from C++, so no Python patch sees its
    all-reduce, and a Python comm hook would change what is timed. The timed runs keep
    the built-in reducer and count one all-reduce per step of every reducer bucket, as
    DDP reports them (``_get_ddp_logging_data()["bucket_sizes"]``, read at the end of
    training, after the buckets were rebuilt). ``--ddp-comm-hook`` instead registers
    torch's ``allreduce_hook`` (the same all-reduce, through Python) so that
    :class:`CommCounter` counts what actually runs; both give the same bytes (one
    fp32 copy of every gradient per step).

Note [ZeroRedundancyOptimizer and Muon's groups]
    ZeRO partitions every param group separately over the ranks (whole parameters,
    greedily by size) and gives each rank's local optimizer one group per original
    group, keys copied, so Newton-Schulz still sees whole matrices and ``use_muon``
    survives. The trap is ZeRO's own ``Optimizer.__init__``: it fills missing group
    keys from its constructor kwargs, so an AdamW group without its own ``lr``
    inherits Muon's ``lr=0.02`` before llw.Muon can apply ``adamw_lr``. The benchmark
    therefore writes ``lr`` into both groups (``muon_param_groups(model, lr=..., adamw_lr=...)``).

On CUDA every timestamp is taken after ``torch.cuda.synchronize()``; host wall time in
``wait()`` is then not exposed communication (NCCL waits order streams), so that
column is only meaningful on CPU.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import re
import resource
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import harness  # noqa: E402  (never imports lightning_layerwise: see CommCounter)

DOCS = ROOT / "docs" / "benchmarks"
RESULTS = harness.RESULTS


@dataclass(frozen=True)
class Size:
    """Model shape, per-rank batch and step counts of one benchmark size."""

    n_layer: int
    n_head: int
    n_embd: int
    batch_size: int
    block_size: int
    steps: int
    warmup: int
    bucket_size: int


SIZES: dict[str, Size] = {
    # examples/configs/cpu.yaml: 0.8 M parameters, batch 16 x 128 per rank.
    "tiny": Size(n_layer=4, n_head=4, n_embd=128, batch_size=16, block_size=128, steps=20, warmup=3,
                 bucket_size=200_000),
    # 7.2 M parameters, batch 4 x 64 per rank: Newton-Schulz is ~60 % of a replicated Muon step on CPU.
    "wide": Size(n_layer=4, n_head=6, n_embd=384, batch_size=4, block_size=64, steps=12, warmup=3,
                 bucket_size=1_000_000),
    # 31 M parameters, batch 2 x 64 per rank: the sharded-parameter comparison (docs/benchmarks/sharded_cpu.md).
    "30m": Size(n_layer=10, n_head=8, n_embd=512, batch_size=2, block_size=64, steps=6, warmup=2,
                bucket_size=4_000_000),
    # 126 M parameters: the largest of the sharded comparison, run at 4 ranks under a per-rank memory cap.
    "120m": Size(n_layer=40, n_head=8, n_embd=512, batch_size=2, block_size=64, steps=3, warmup=1,
                 bucket_size=4_000_000),
    # 10.7 M parameters, batch 4 x 64 per data-parallel rank: the tensor-parallel comparison at 4 ranks
    # (docs/benchmarks/tensor_parallel_cpu.md); n_head divisible by the tensor-parallel size 2.
    "tp10m": Size(n_layer=6, n_head=8, n_embd=384, batch_size=4, block_size=64, steps=4, warmup=1,
                  bucket_size=4_000_000),
    "gpt2-small": Size(n_layer=12, n_head=12, n_embd=768, batch_size=16, block_size=1024, steps=50, warmup=10,
                       bucket_size=40_000_000),
    "gpt2-medium": Size(n_layer=24, n_head=16, n_embd=1024, batch_size=8, block_size=1024, steps=50, warmup=10,
                        bucket_size=40_000_000),
}


def size_of(name: str) -> Size:
    """A size of :data:`SIZES`, or ``120m-L<N>``: the 120m row with ``N`` layers (3.15 M parameters each), the
    ladder ``benchmarks/largest_under_cap.py`` searches."""
    match = re.fullmatch(r"120m-L(\d+)", name)
    if match and int(match.group(1)) >= 1:
        return replace(SIZES["120m"], n_layer=int(match.group(1)))
    if name not in SIZES:
        raise ValueError(f"size {name!r}: unknown; choose from {list(SIZES)} or 120m-L<layers>.")
    return SIZES[name]


@dataclass(frozen=True)
class Config:
    strategy: str  # "ddp", "fsdp2" or "layerwise"
    optimizer: str  # "adamw", "muon", "torch_muon" or "zero_muon"
    overlap: bool | None = None  # layerwise overlap_param_gather
    min_devices: int = 1  # the no-overlap rows differ from the others only with an all-gather
    one_rank: bool = True  # also run at 1 rank (single-process cost of the strategy and optimizer)
    shard: bool = False  # layerwise shard_parameters; fsdp2: reshard_after_forward (parameters freed after forward)
    tp: int = 1  # tensor-parallel size: runs where devices is a multiple of 2 * tp (data-parallel 2+ x tp)


CONFIGS: dict[str, Config] = {
    "ddp_adamw": Config("ddp", "adamw"),
    "ddp_muon": Config("ddp", "muon"),
    "ddp_torch_muon": Config("ddp", "torch_muon"),
    "ddp_zero_muon": Config("ddp", "zero_muon", one_rank=False),
    "fsdp2_adamw": Config("fsdp2", "adamw", one_rank=False),
    "fsdp2_adamw_reshard": Config("fsdp2", "adamw", one_rank=False, shard=True),
    "fsdp2_torch_muon_reshard": Config("fsdp2", "torch_muon", one_rank=False, shard=True),
    "layerwise_adamw": Config("layerwise", "adamw", overlap=True),
    "layerwise_adamw_no_overlap": Config("layerwise", "adamw", overlap=False, min_devices=2),
    "layerwise_muon": Config("layerwise", "muon", overlap=True),
    "layerwise_muon_no_overlap": Config("layerwise", "muon", overlap=False, min_devices=2),
    "layerwise_sharded_adamw": Config("layerwise", "adamw", overlap=True, one_rank=False, shard=True),
    "layerwise_sharded_muon": Config("layerwise", "muon", overlap=True, one_rank=False, shard=True),
    "layerwise_tp_muon": Config("layerwise", "muon", overlap=True, one_rank=False, tp=2),
    "layerwise_tp_adamw": Config("layerwise", "adamw", overlap=True, one_rank=False, tp=2),
    "fsdp2_tp_adamw": Config("fsdp2", "adamw", one_rank=False, tp=2),
    "fsdp2_tp_torch_muon": Config("fsdp2", "torch_muon", one_rank=False, tp=2),
}
BASELINE = "ddp_adamw"
# Each row's replicated peer: same optimizer maths, every rank steps everything.
REPLICATED_PEER = {
    "layerwise_adamw": "ddp_adamw", "layerwise_adamw_no_overlap": "ddp_adamw", "fsdp2_adamw": "ddp_adamw",
    "layerwise_muon": "ddp_muon", "layerwise_muon_no_overlap": "ddp_muon", "ddp_zero_muon": "ddp_muon",
    "fsdp2_adamw_reshard": "ddp_adamw", "fsdp2_torch_muon_reshard": "ddp_torch_muon",
    "layerwise_sharded_adamw": "ddp_adamw", "layerwise_sharded_muon": "ddp_muon",
}
# Tensor-parallel rows: the same row without tensor parallelism (same ranks, twice the data-parallel ranks), and
# the peer with Lightning's ModelParallelStrategy (the same TP plan, FSDP2 over data_parallel).
NO_TP_PEER = {"layerwise_tp_muon": "layerwise_muon", "layerwise_tp_adamw": "layerwise_adamw"}
FSDP2_TP_PEER = {"layerwise_tp_muon": "fsdp2_tp_torch_muon", "layerwise_tp_adamw": "fsdp2_tp_adamw"}
LAST_K = 10  # steps averaged for the "late loss" column
# (name, from event, to event, clock). Events: start = on_train_batch_start, grads =
# on_before_optimizer_step, clipped = end of configure_gradient_clipping, stepped = optimizer
# step post-hook, end = on_train_batch_end; ("end", "end") spans from the previous step's end.
INTERVALS = (
    ("step", "end", "end", "wall"),
    ("step_cpu", "end", "end", "process"),
    ("fwd_bwd", "start", "grads", "wall"),
    ("clip", "grads", "clipped", "wall"),
    ("opt", "clipped", "stepped", "wall"),
)
# Per-step counters (deltas between consecutive "end" marks), besides the intervals.


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu", "cuda"])
    parser.add_argument("--sizes", default=None,
                        help=f"comma-separated of {','.join(SIZES)} or 120m-L<layers> (default: tiny,wide on CPU, "
                             "gpt2-small on GPU)")
    parser.add_argument("--devices", default="1,2", help="comma-separated rank counts, e.g. 1,2 or 1,8")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ",".join(CONFIGS))
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration, interleaved")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default: the size's)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed steps before them, >= 1 (default: the size's)")
    parser.add_argument("--adamw-lr", type=float, default=1e-3, help="lr of the AdamW configurations")
    parser.add_argument("--muon-lr", type=float, default=0.02, help="Muon lr of the hidden matrices")
    parser.add_argument("--muon-adamw-lr", type=float, default=3e-3, help="lr of Muon's AdamW groups")
    parser.add_argument("--ns-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--gradient-clip-val", type=float, default=1.0, help="0 disables clipping")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--ddp-comm-hook", action="store_true",
                        help="run DDP's all-reduce through torch's allreduce_hook so Python counts it "
                             "(a cross-check of Note [DDP's bytes]; the timed runs use the built-in reducer)")
    parser.add_argument("--threads", type=int, default=1, help="torch/OMP threads per rank on CPU")
    parser.add_argument("--max-chars", type=int, default=2_000_000, help="corpus size (cpu.yaml)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run before it is killed")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/strategies_<acc>.json)")
    parser.add_argument("--docs-dir", default=str(DOCS), help="where the markdown table and plots go")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--from-json", default=None, help="only rebuild the table and plots from this JSON")
    parser.add_argument("--collectives", default=None, metavar="MIB,...",
                        help="diagnostic: time all-reduce / reduce-scatter / all-gather of these sizes (under torchrun)")
    parser.add_argument("--profile-hooks", default=None, choices=list(SIZES),
                        help="diagnostic: one process, plain GPT vs LayerwiseDataParallel, and a cProfile")
    # Internal: one configuration in this process (and, via Lightning's launcher, its peers).
    parser.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_size", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_result", default=None, help=argparse.SUPPRESS)
    return parser


# ---------------------------------------------------------------------------------------
# Counting communication: patches of torch.distributed, installed before anything imports it
# ---------------------------------------------------------------------------------------

# (name, the argument whose tensor(s) are counted, ring factor: bytes a rank sends per byte counted)
_COLLECTIVES = (
    ("all_reduce", "tensor", lambda n: 2 * (n - 1) / n),
    ("all_reduce_coalesced", "tensors", lambda n: 2 * (n - 1) / n),
    ("broadcast", "tensor", lambda n: (n - 1) / n),
    ("reduce", "tensor", lambda n: (n - 1) / n),  # across owner groups (Note [uneven chunks])
    ("all_gather_single", "output_tensor", lambda n: (n - 1) / n),
    ("all_gather", "tensor_list", lambda n: (n - 1) / n),
    ("reduce_scatter_single", "input", lambda n: (n - 1) / n),
    ("reduce_scatter", "input_list", lambda n: (n - 1) / n),
    ("all_to_all_single", "output", lambda n: (n - 1) / n),
)

# Functional collectives (``torch.distributed._functional_collectives``), DTensor's own communication: the
# row-wise layers' all-reduce, redistributions' all-gathers and reduce-scatters (torch 2.13's
# ``tensor/placement_types.py`` and ``_collective_utils.py`` call ``funcol.all_reduce``, ``all_gather_single``
# and ``reduce_scatter_single`` at call time; the rest are wrapped so that a caller of them is seen too).
# (name, bytes counted from the first argument's and the group's size, ring factor). Counted under
# ``dtensor_<name>``, with the c10d collectives' conventions: all-gather the output, reduce-scatter the input.
_FUNCOL_COLLECTIVES = (
    ("all_reduce", lambda b, n: b, lambda n: 2 * (n - 1) / n),
    ("all_reduce_coalesced", lambda b, n: b, lambda n: 2 * (n - 1) / n),
    ("broadcast", lambda b, n: b, lambda n: (n - 1) / n),
    ("all_gather_single", lambda b, n: b * n, lambda n: (n - 1) / n),
    ("all_gather_tensor", lambda b, n: b * n, lambda n: (n - 1) / n),
    ("all_gather_tensor_autograd", lambda b, n: b * n, lambda n: (n - 1) / n),
    ("all_gather_into_tensor_coalesced", lambda b, n: b * n, lambda n: (n - 1) / n),
    ("reduce_scatter_single", lambda b, n: b, lambda n: (n - 1) / n),
    ("reduce_scatter_tensor", lambda b, n: b, lambda n: (n - 1) / n),
    ("reduce_scatter_tensor_autograd", lambda b, n: b, lambda n: (n - 1) / n),
    ("reduce_scatter_tensor_coalesced", lambda b, n: b, lambda n: (n - 1) / n),
    ("all_to_all_single", lambda b, n: b, lambda n: (n - 1) / n),
    ("all_to_all_single_autograd", lambda b, n: b, lambda n: (n - 1) / n),
)
# The names one kind is reported under (an all_gather_tensor is an all_gather_single in funcol itself).
_FUNCOL_KIND = {"all_gather_tensor": "all_gather_single", "all_gather_tensor_autograd": "all_gather_single",
                "reduce_scatter_tensor": "reduce_scatter_single",
                "reduce_scatter_tensor_autograd": "reduce_scatter_single",
                "all_to_all_single_autograd": "all_to_all_single"}


def funcol_group_size(group) -> int:
    """Ranks in a functional collective's ``group``: ``(mesh, dim)``, a 1-D ``DeviceMesh``, a ``ProcessGroup``,
    a list of ranks (or of rank lists, one per group), or a registered group name; 1 when unknown."""
    try:
        if isinstance(group, tuple) and len(group) == 2:
            mesh, dim = group
            return int(mesh.size(dim)) if isinstance(dim, int) else int(mesh[dim].size())
        if isinstance(group, list):
            return len(group[0]) if group and isinstance(group[0], list) else len(group)
        if isinstance(group, str):
            import torch.distributed.distributed_c10d as c10d

            return int(c10d._get_group_size_by_name(group))
        size = getattr(group, "size", None)
        return int(size()) if callable(size) else 1
    except Exception:  # a form this version of torch has and this function does not know
        return 1


def funcol_bytes(name: str, first, group) -> tuple[str, int, float]:
    """``(key, bytes, ring bytes)`` of one functional collective ``name`` called on ``first`` (a tensor or list)
    over ``group``, as :class:`CommCounter` counts it."""
    size, factor = next((b, f) for n, b, f in _FUNCOL_COLLECTIVES if n == name)
    tensors = [first] if torch.is_tensor(first) else list(first or ())
    n = funcol_group_size(group)
    counted = size(sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t)), n)
    return "dtensor_" + _FUNCOL_KIND.get(name, name), counted, counted * factor(n)


class CommCounter:
    """Bytes handed to ``torch.distributed`` collectives and time blocked in them, per process.

    Wraps the collectives in both ``torch.distributed`` and ``distributed_c10d`` (the
    deprecated aliases such as ``all_gather_into_tensor`` call the latter's globals) and
    ``Work.wait``. A collective called from inside another counted one is not counted
    again. Code that bound a collective before :meth:`install` (``from ... import``) is
    not seen, so install first. The functional collectives DTensor calls (as
    ``funcol.<name>`` at call time) are counted under ``dtensor_<name>`` (see
    :data:`_FUNCOL_COLLECTIVES`), and the time spent in ``funcol.wait_tensor`` (their
    asynchronous results awaited) in :attr:`dtensor_wait_s`; C++ callers are not seen
    (see the module docstring for DDP).
    """

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        self.ring_bytes = 0.0
        self.blocked_s = 0.0
        self.dtensor_wait_s = 0.0
        self._local = threading.local()

    def install(self) -> "CommCounter":
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name, arg, factor in _COLLECTIVES:
            original = getattr(c10d, name, None)
            if original is None:
                continue
            wrapped = self._wrap(name, original, arg, factor)
            setattr(c10d, name, wrapped)
            if getattr(dist, name, None) is original:
                setattr(dist, name, wrapped)
        original_wait = dist.Work.wait
        counter = self

        def wait(work, *args, **kwargs):
            if getattr(counter._local, "depth", 0):  # inside a synchronous collective, timed there
                return original_wait(work, *args, **kwargs)
            t0 = time.perf_counter()
            try:
                return original_wait(work, *args, **kwargs)
            finally:
                counter.blocked_s += time.perf_counter() - t0

        dist.Work.wait = wait
        self._install_funcol()
        return self

    def _install_funcol(self) -> None:
        import torch.distributed._functional_collectives as funcol

        counter = self
        for name, *_ in _FUNCOL_COLLECTIVES:
            original = getattr(funcol, name, None)
            if original is not None:
                setattr(funcol, name, self._wrap_funcol(name, original))
        original_wait = funcol.wait_tensor

        @functools.wraps(original_wait)
        def wait_tensor(tensor):
            t0 = time.perf_counter()
            try:
                return original_wait(tensor)
            finally:
                counter.dtensor_wait_s += time.perf_counter() - t0

        funcol.wait_tensor = wait_tensor

    def _wrap_funcol(self, name, original):
        counter = self

        def count(bound, elapsed):
            key, n, ring = funcol_bytes(name, next(iter(bound.values()), None), bound.get("group"))
            counter.bytes[key] = counter.bytes.get(key, 0) + n
            counter.ring_bytes += ring

        return self._outermost(original, count)

    def _wrap(self, name, original, arg, factor):
        counter = self

        def count(bound, elapsed):
            if not bound.get("async_op", False):
                counter.blocked_s += elapsed
            counter.add(name, bound.get(arg), factor(_world_size(bound.get("group"))))

        return self._outermost(original, count)

    def _outermost(self, original, count):
        """``original``, counted by ``count(bound arguments, seconds)`` when called outside another counted
        collective (one that calls another is counted once)."""
        local, signature = self._local, inspect.signature(original)

        @functools.wraps(original)
        def collective(*args, **kwargs):
            if getattr(local, "depth", 0):
                return original(*args, **kwargs)
            local.depth = 1
            t0 = time.perf_counter()
            try:
                out = original(*args, **kwargs)
            finally:
                local.depth = 0
            count(signature.bind_partial(*args, **kwargs).arguments, time.perf_counter() - t0)
            return out

        return collective

    def add(self, name: str, tensors, ring_factor: float) -> None:
        if torch.is_tensor(tensors):
            tensors = [tensors]
        n = sum(t.numel() * t.element_size() for t in tensors or () if torch.is_tensor(t))
        self.bytes[name] = self.bytes.get(name, 0) + n
        self.ring_bytes += n * ring_factor


def _world_size(group) -> int:
    import torch.distributed as dist

    try:
        return dist.get_world_size(group) if group is not None else dist.get_world_size()
    except Exception:  # not initialized, or a group this rank is not in
        return 1


# ---------------------------------------------------------------------------------------
# Worker: one configuration, every rank
# ---------------------------------------------------------------------------------------


@dataclass
class Worker:
    """One configuration's run on this rank: its settings, and the clocks its pieces below share."""

    args: argparse.Namespace
    comm: CommCounter
    config: Config = field(init=False)
    size: Size = field(init=False)
    cuda: bool = field(init=False)
    ns_seconds: float = 0.0
    """Wall time inside Newton-Schulz so far."""
    last_grad: float = 0.0
    """When the last gradient was accumulated (DDP: see Note [DDP's bytes])."""

    def __post_init__(self) -> None:
        self.config = CONFIGS[self.args._worker]
        self.size = size_of(self.args._size)
        self.cuda = self.args.accelerator == "gpu"

    @property
    def ns_dtype(self) -> torch.dtype:
        return getattr(torch, self.args.ns_dtype)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time_newton_schulz(self) -> None:
        """Wraps both Newton-Schulz implementations so that their wall time adds up in :attr:`ns_seconds`."""
        import torch.optim._muon as torch_muon

        import lightning_layerwise.engine.tp_exchange as llw_tp_exchange
        import lightning_layerwise.optim.muon as llw_muon

        def timed(fn):
            @functools.wraps(fn)
            def wrapper(*a, **k):
                self.sync()
                t0 = time.perf_counter()
                out = fn(*a, **k)
                self.sync()
                self.ns_seconds += time.perf_counter() - t0
                return out
            return wrapper

        llw_muon.orthogonalize = timed(llw_muon.orthogonalize)  # looked up by muon_step at call time
        # Under tensor parallelism the whole matrices go through the exchange's own import (Note [tensor-parallel
        # exchange]), looked up when each step runs: NS time only, not the two all_to_all_single around it.
        llw_tp_exchange.orthogonalize = timed(llw_tp_exchange.orthogonalize)
        torch_muon._zeropower_via_newtonschulz = timed(torch_muon._zeropower_via_newtonschulz)

    def on_grad(self, param) -> None:
        self.last_grad = time.perf_counter()


def make_optimizer(worker: Worker, model: torch.nn.Module):
    import lightning_layerwise as llw

    args = worker.args
    groups = llw.muon_param_groups(model, lr=args.muon_lr, adamw_lr=args.muon_adamw_lr)
    if worker.config.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=args.adamw_lr, betas=(0.9, 0.95), weight_decay=0.0)
    if worker.config.optimizer == "muon":
        return llw.Muon(groups, lr=args.muon_lr, adamw_lr=args.muon_adamw_lr, ns_dtype=worker.ns_dtype)
    if worker.config.optimizer == "torch_muon":
        return MuonAndAdamW(groups, lr=args.muon_lr, adamw_lr=args.muon_adamw_lr)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    # lr written into both groups: see Note [ZeroRedundancyOptimizer and Muon's groups].
    return ZeroRedundancyOptimizer(groups, optimizer_class=llw.Muon, lr=args.muon_lr,
                                   adamw_lr=args.muon_adamw_lr, ns_dtype=worker.ns_dtype)


class ProbeHooks:
    """Clock readings at five points of every step, counters, and memory, on this rank.

    The hooks of a ``lightning.Callback``; :func:`run_worker` makes the callback class (Lightning is imported
    only after the :class:`CommCounter` is installed)."""

    def __init__(self, worker: Worker) -> None:
        super().__init__()
        self.worker = worker
        self.marks: dict[str, list[dict[str, float]]] = {
            e: [] for e in ("start", "grads", "clipped", "stepped", "end")}
        self.counters: list[dict[str, float]] = []
        self.losses: list[float] = []
        self.ddp_exposed_s = 0.0
        self.ddp_bucket_bytes = 0
        self.state_bytes_peak = 0
        self.param_bytes = 0
        self.train_peak_rss_bytes = 0
        self.wrapper = None

    def mark(self, event: str) -> None:
        self.worker.sync()
        self.marks[event].append({"wall": time.perf_counter(), "process": time.process_time()})

    def on_train_start(self, trainer, pl_module) -> None:
        if self.worker.cuda:  # here the rank's device is set; earlier would touch GPU 0 from every rank
            torch.cuda.reset_peak_memory_stats()
        self.param_bytes = _storage_bytes(_local(p) for p in pl_module.parameters())
        trainer.optimizers[0].register_step_post_hook(self._after_optimizer_step)
        if self.worker.config.strategy == "ddp":
            for p in pl_module.parameters():
                p.register_post_accumulate_grad_hook(self.worker.on_grad)
        wrapper = getattr(trainer.strategy, "wrapper", None)
        if wrapper is not None:
            wrapper.grad_sync.waiter.seconds = {}
            self.wrapper = wrapper
        self.snapshot()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.mark("start")

    def on_train_end(self, trainer, pl_module) -> None:
        # Before the strategy's teardown: the run without its end (a sharded module is gathered whole then).
        self.train_peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if self.worker.config.strategy == "ddp":  # buckets are rebuilt after the first step; read them at the end
            self.ddp_bucket_bytes = _ddp_bucket_bytes(trainer.strategy.model) or 0

    def on_after_backward(self, trainer, pl_module) -> None:
        if self.worker.config.strategy == "ddp":
            # DDP's reducer waits for its all-reduces inside backward, after the last
            # gradient was accumulated: that tail is its exposed communication.
            self.worker.sync()
            self.ddp_exposed_s += max(0.0, time.perf_counter() - self.worker.last_grad)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.mark("grads")

    def _after_optimizer_step(self, optimizer, args_, kwargs_) -> None:
        self.mark("stepped")
        self.state_bytes_peak = max(self.state_bytes_peak, _optimizer_state_bytes(optimizer))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.mark("end")
        self.snapshot()
        self.losses.append(float(outputs["loss"].detach()))

    def snapshot(self) -> None:
        comm = self.worker.comm
        waits = self.wrapper.grad_sync.waiter.seconds if self.wrapper is not None else {}
        self.counters.append({
            "ns_ms": 1e3 * self.worker.ns_seconds,
            "comm_blocked_ms": 1e3 * comm.blocked_s,
            "dtensor_wait_ms": 1e3 * comm.dtensor_wait_s,
            "ddp_exposed_ms": 1e3 * self.ddp_exposed_s,
            "wrapper_wait_ms": 1e3 * sum(waits.values()),
            "comm_bytes": float(sum(comm.bytes.values())),
            "ring_bytes": comm.ring_bytes,
            **{f"bytes_{k}": float(v) for k, v in comm.bytes.items()},
            **{f"wait_ms_{k}": 1e3 * v for k, v in waits.items()},
        })


def bench_module_class(worker: Worker, probe: ProbeHooks) -> type:
    """The example GPT's LightningModule as every row trains it."""
    from examples.module import GPTLightningModule

    class BenchGPT(GPTLightningModule):
        def configure_model(self) -> None:
            super().configure_model()  # with tensor_parallel=True: the TP plan over device_mesh["tensor_parallel"]
            if worker.config.strategy == "fsdp2":
                from torch.distributed.fsdp import fully_shard

                mesh = self.device_mesh["data_parallel"]
                reshard = worker.config.shard
                for block in self.model.transformer.h:
                    fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
                fully_shard(self.model, mesh=mesh, reshard_after_forward=reshard)

        def configure_optimizers(self):
            return make_optimizer(worker, self.model)

        def training_step(self, batch, batch_idx):
            # No logging, metrics or sync_dist: the steps differ only by strategy and optimizer.
            x, y = batch
            _, loss = self.model(x, y)
            return loss

        # Lightning calls this hook every step, with or without clipping: its end
        # separates clipping from the optimizer's own step.
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            if worker.config.strategy == "fsdp2" and worker.config.tp > 1 and gradient_clip_val:
                clip_over_meshes(self.parameters(), gradient_clip_val)  # Note [clipping FSDP2 with TP]
            else:
                super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
            probe.mark("clipped")

    return BenchGPT


def clip_over_meshes(parameters, max_norm: float) -> float:
    """Clips gradients by their total 2-norm when they are DTensors on different meshes; returns the norm.

    Note [clipping FSDP2 with TP]
        With the TP plan applied and then ``fully_shard`` over ``data_parallel``, the planned
        matrices are DTensors on the 2-D mesh and the rest (embeddings, norms, the tied head) on
        the 1-D ``data_parallel`` mesh; ``torch.nn.utils.clip_grad_norm_`` stacks their norms
        and DTensor refuses operands on different meshes ("All operands in aten.stack.default
        must have the same mesh"). So the ``fsdp2_tp_*`` rows take the norm per mesh
        (``get_total_norm``, then ``full_tensor()``), add the squares, and scale every gradient
        by ``min(1, max_norm / (norm + 1e-6))``, which is what ``clip_grad_norm_`` computes.
    """
    from torch.nn.utils import get_total_norm

    groups: dict[Any, list] = {}
    for p in parameters:
        if p.grad is not None:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p.grad)
    squares = []
    for grads in groups.values():
        norm = get_total_norm(grads, 2.0)
        squares.append(float(_full(norm)) ** 2)
    total = sum(squares) ** 0.5
    coef = min(1.0, max_norm / (total + 1e-6))
    if coef < 1.0:
        for grads in groups.values():
            for g in grads:
                g.mul_(coef)
    return total


def _full(t):
    """A DTensor's whole value, else ``t``."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def make_strategy(worker: Worker, devices: int):
    import lightning_layerwise as llw

    if worker.config.strategy == "layerwise":
        # Sharded parameters at their default settings (bucket_size="auto"): what a user who sets nothing gets.
        options = {} if worker.config.shard else {"bucket_size": worker.size.bucket_size}
        if worker.config.tp > 1:
            options["tensor_parallel_size"] = worker.config.tp
        return llw.LayerwiseStrategy(overlap_param_gather=worker.config.overlap, shard_parameters=worker.config.shard,
                                     **options)
    if worker.config.strategy == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        tp = worker.config.tp
        return ModelParallelStrategy(data_parallel_size=devices // tp, tensor_parallel_size=tp)
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    class HookedDDPStrategy(DDPStrategy):
        # Lightning registers comm hooks on CUDA only; gloo runs them as well.
        def _register_ddp_hooks(self) -> None:
            self.model.register_comm_hook(state=None, hook=default_hooks.allreduce_hook)

    return HookedDDPStrategy() if worker.args.ddp_comm_hook else DDPStrategy()


def rank_result(worker: Worker, probe: ProbeHooks, rank: int, warmup: int, steps: int, devices: int) -> dict:
    """This rank's per-step intervals and counters after the warm-up, its memory and losses."""
    local: dict[str, Any] = {"rank": rank, "losses": probe.losses}
    for name, a, b, clock in INTERVALS:
        # Step k (k >= warmup) spans end[k-1] .. end[k]; the other intervals lie inside step k.
        begin = probe.marks[a][warmup - 1:-1] if (a, b) == ("end", "end") else probe.marks[a][warmup:]
        local[name + "_ms"] = [1e3 * (y[clock] - x[clock]) for x, y in zip(begin, probe.marks[b][warmup:])]
    # counters[0] is at train start, counters[k + 1] at the end of step k.
    snaps = probe.counters[warmup:]
    keys = sorted({k for s in snaps for k in s})
    local["counters"] = counters = {k: [b.get(k, 0.0) - a.get(k, 0.0) for a, b in zip(snaps[:-1], snaps[1:])]
                                    for k in keys}
    if worker.config.strategy == "ddp" and not worker.args.ddp_comm_hook:
        # Note [DDP's bytes]: one all-reduce of every reducer bucket per step.
        bucket_bytes = probe.ddp_bucket_bytes
        ring = bucket_bytes * 2 * (devices - 1) / devices
        counters["bytes_all_reduce_ddp_buckets"] = [float(bucket_bytes)] * steps
        counters["comm_bytes"] = [v + bucket_bytes for v in counters.get("comm_bytes", [0.0] * steps)]
        counters["ring_bytes"] = [v + ring for v in counters.get("ring_bytes", [0.0] * steps)]
    local.update(
        optimizer_state_bytes_peak=probe.state_bytes_peak,
        param_bytes=probe.param_bytes,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        train_peak_rss_bytes=probe.train_peak_rss_bytes,
        cuda_max_allocated_bytes=torch.cuda.max_memory_allocated() if worker.cuda else None,
    )
    return local


def run_worker(args: argparse.Namespace) -> None:
    """One configuration on this rank (every rank of the run enters here); rank 0 writes every rank's result."""
    if args.accelerator == "cpu":
        # Before torch creates its thread pool; the env vars also reach the launched ranks.
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
    worker = Worker(args, CommCounter().install())  # before lightning_layerwise binds its collectives
    import lightning as L
    import torch.distributed as dist

    from examples.data import CharDataModule

    if args.accelerator == "cpu":
        torch.set_num_threads(args.threads)
    worker.time_newton_schulz()
    size, devices = worker.size, int(args.devices)
    steps, warmup = args.steps or size.steps, args.warmup or size.warmup
    L.seed_everything(args.seed, verbose=False)
    dm = CharDataModule(block_size=size.block_size, batch_size=size.batch_size, max_chars=args.max_chars,
                        seed=args.seed)
    probe = type("Probe", (ProbeHooks, L.Callback), {})(worker)
    model = bench_module_class(worker, probe)(vocab_size=dm.vocab_size, n_layer=size.n_layer, n_head=size.n_head,
                                              n_embd=size.n_embd, block_size=size.block_size,
                                              tensor_parallel=worker.config.tp > 1)
    trainer = L.Trainer(
        accelerator="gpu" if worker.cuda else "cpu", devices=devices, strategy=make_strategy(worker, devices),
        precision=args.precision, max_steps=warmup + steps, gradient_clip_val=args.gradient_clip_val or None,
        limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[probe],
    )
    try:
        trainer.fit(model, datamodule=dm)
    except Exception as error:  # the row's result is the error (e.g. an optimizer refusing DTensors)
        if trainer.global_rank == 0 and args._result:
            import traceback

            Path(args._result).write_text(json.dumps({"config": args._worker, "size": args._size,
                                                      "error": f"{type(error).__name__}: {error}",
                                                      "traceback": traceback.format_exc()[-4000:]}))
        raise
    local = rank_result(worker, probe, trainer.global_rank, warmup, steps, devices)
    ranks = [local]
    if dist.is_available() and dist.is_initialized():
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, local)
    if trainer.global_rank == 0 and args._result:
        Path(args._result).write_text(json.dumps({"config": args._worker, "size": args._size, "ranks": ranks}))
    if dist.is_available() and dist.is_initialized():
        # Lightning leaves the process group to interpreter exit, where gloo's threads
        # occasionally abort the process ("terminate called without an active exception").
        dist.barrier()
        dist.destroy_process_group()


class MuonAndAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` on ``use_muon`` groups and ``torch.optim.AdamW`` on the others, as one optimizer.

    See Note [one optimizer for torch.optim.Muon]. ``param_groups`` are the inner
    optimizers' own group dicts; ``state`` stays empty (each inner optimizer keeps its own).
    """

    def __init__(self, groups: list[dict], lr: float, adamw_lr: float) -> None:
        muon = [{"params": g["params"]} for g in groups if g.get("use_muon")]
        adamw = [{"params": g["params"]} for g in groups if not g.get("use_muon")]
        self.optimizers = [
            torch.optim.Muon(muon, lr=lr, weight_decay=0.0, momentum=0.95, nesterov=True),
            torch.optim.AdamW(adamw, lr=adamw_lr, betas=(0.9, 0.95), weight_decay=0.0),
        ]
        super().__init__([p for g in groups for p in g["params"]], {})
        self.param_groups = [g for opt in self.optimizers for g in opt.param_groups]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers:
            opt.step()
        return loss


def _local(t):
    """The local shard of a DTensor, else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


def _optimizer_state_bytes(optimizer) -> int:
    """Bytes of tensors in this rank's optimizer state (ZeRO: its local optimizer; DTensors: local shards)."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
    inner = getattr(optimizer, "optim", None)  # ZeroRedundancyOptimizer
    parts = getattr(optimizer, "optimizers", None) or [inner if inner is not None else optimizer]
    total = 0
    for opt in parts:
        for state in opt.state.values():
            for t in state.values():
                if torch.is_tensor(t):
                    t = _local(t)
                    total += t.numel() * t.element_size()
    return total


def _ddp_bucket_bytes(model) -> int | None:
    """Bytes of DistributedDataParallel's gradient buckets, as the reducer reports them."""
    get = getattr(model, "_get_ddp_logging_data", None)
    if get is None:
        return None
    try:
        sizes = get().get("bucket_sizes")
    except Exception:  # a private API: absent or different in other torch versions
        return None
    if isinstance(sizes, str):
        sizes = [int(s) for s in sizes.split(",") if s.strip()]
    return sum(sizes) if sizes else None


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a flat buffer counts once)."""
    seen: dict[int, int] = {}
    with torch._C.DisableTorchFunctionSubclass():  # a sharded parameter's storage, not a gather (llw's read guard)
        for t in tensors:
            storage = t.untyped_storage()
            seen[storage._cdata] = storage.nbytes()  # a freed buffer (sharded parameters) holds 0 bytes
    return sum(seen.values())


# ---------------------------------------------------------------------------------------
# Driver: fresh processes per run, round-robin repeats
# ---------------------------------------------------------------------------------------


def worker_command(args: argparse.Namespace, name: str, size: str, devices: int, result: str) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_worker", name, "--_size", size, "--_result", result,
           "--accelerator", args.accelerator, "--devices", str(devices)]
    for key in ("steps", "warmup", "adamw_lr", "muon_lr", "muon_adamw_lr", "ns_dtype", "gradient_clip_val",
                "precision", "threads", "max_chars", "seed", "ddp_comm_hook"):
        value = getattr(args, key)
        if value is True:
            cmd.append(f"--{key.replace('_', '-')}")
        elif value is not None and value is not False:
            cmd += [f"--{key.replace('_', '-')}", str(value)]
    return cmd


def run_one(args: argparse.Namespace, name: str, size: str, devices: int, attempts: int = 2) -> dict:
    """One configuration in fresh processes; a run that leaves no result is tried once more."""
    done = harness.run_script(lambda result: worker_command(args, name, size, devices, result),
                              label=f"{name} ({size}, {devices} ranks)", env={"PYTHONWARNINGS": "ignore"},
                              threads=args.threads if args.accelerator == "cpu" else None,
                              timeout_s=args.timeout, attempts=attempts)
    return {**done.result, "process_wall_s": done.wall_s, "exit_code": done.exit_code}


def summarize_run(run: dict) -> dict:
    """One run: per-step maxima over ranks, medians over steps; memory per rank; losses."""
    ranks = run["ranks"]
    out: dict[str, Any] = {"world": len(ranks), "process_wall_s": run["process_wall_s"],
                           "exit_code": run["exit_code"]}
    for name, *_ in INTERVALS:
        # A step ends when the slowest rank ends it: the maximum over ranks, step by step.
        per_step = [max(values) for values in zip(*(r[name + "_ms"] for r in ranks))]
        out[name + "_ms"] = harness.median_of(per_step)
        out[name + "_ms_steps"] = per_step
    keys = sorted({k for r in ranks for k in r["counters"]})
    for key in keys:
        per_rank = [harness.median_of(r["counters"][key]) if r["counters"].get(key) else 0.0 for r in ranks]
        out[key] = max(per_rank)  # bytes are the same on every rank; times: the slowest rank
        out[key + "_per_rank"] = per_rank
    losses = [statistics.fmean(values) for values in zip(*(r["losses"] for r in ranks))]
    cuda_bytes = [r["cuda_max_allocated_bytes"] for r in ranks]
    out.update(
        state_bytes_per_rank=[r["optimizer_state_bytes_peak"] for r in ranks],
        param_bytes_per_rank=max(r["param_bytes"] for r in ranks),
        peak_rss_bytes_per_rank=max(r["peak_rss_bytes"] for r in ranks),
        train_peak_rss_bytes_per_rank=max(r.get("train_peak_rss_bytes", 0) for r in ranks),
        cuda_max_allocated_bytes_per_rank=max(cuda_bytes) if None not in cuda_bytes else None,
        losses=losses,
        final_loss=losses[-1],
        late_loss=statistics.fmean(losses[-LAST_K:]),
    )
    return out


def exposed_comm_ms(run: dict, strategy: str) -> float:
    """Blocked time per step: the wrapper's waits (layerwise) or Python waits + DDP's estimate."""
    if strategy == "layerwise":
        return run.get("wrapper_wait_ms", 0.0)
    return run.get("comm_blocked_ms", 0.0) + run.get("ddp_exposed_ms", 0.0)


def aggregate(runs: dict[str, list[dict]], tokens_per_step: int) -> dict[str, dict]:
    """Medians over repeats per configuration, and ratios to the baseline and the replicated peer."""
    table: dict[str, dict] = {}
    for name, rs in runs.items():
        if not rs:
            continue
        strategy = CONFIGS[name].strategy if name in CONFIGS else ""
        row: dict[str, Any] = {}
        for key, *_ in INTERVALS:
            values = [r[key + "_ms"] for r in rs]
            row[key + "_ms_median"] = harness.median_of(values)
            row[key + "_ms_runs"] = values
        for key in ("ns_ms", "comm_bytes", "ring_bytes", "comm_blocked_ms", "ddp_exposed_ms", "wrapper_wait_ms"):
            row[key + "_median"] = harness.median_of(r.get(key, 0.0) for r in rs)
        row["exposed_comm_ms_median"] = harness.median_of(exposed_comm_ms(r, strategy) for r in rs)
        row["dtensor_wait_ms_median"] = harness.median_of(r.get("dtensor_wait_ms", 0.0) for r in rs)
        row["comm_bytes_by_kind"] = {k[len("bytes_"):]: v for k, v in rs[0].items()
                                     if k.startswith("bytes_") and not k.endswith("_per_rank")}
        row["wrapper_wait_ms_by_kind"] = {k[len("wait_ms_"):]: harness.median_of(r.get(k, 0.0) for r in rs)
                                          for k in rs[0] if k.startswith("wait_ms_") and not k.endswith("_per_rank")}
        # A tensor-parallel group reads one batch: the global batch is devices / tp per-rank batches.
        tp = CONFIGS[name].tp if name in CONFIGS else 1
        row["tokens_per_step"] = tokens_per_step // tp
        row["tokens_per_s_median"] = row["tokens_per_step"] / (row["step_ms_median"] / 1e3)
        row["ns_share"] = row["ns_ms_median"] / row["step_ms_median"]
        first = rs[0]
        state = first["state_bytes_per_rank"]
        row.update(
            step_ms_steps_runs=[r["step_ms_steps"] for r in rs],
            state_bytes_per_rank=state,
            state_bytes_max_per_rank=max(state),
            state_bytes_sum=sum(state),
            param_bytes_per_rank=first["param_bytes_per_rank"],
            peak_rss_bytes_per_rank_median=harness.median_of(r["peak_rss_bytes_per_rank"] for r in rs),
            train_peak_rss_bytes_per_rank_median=harness.median_of(r["train_peak_rss_bytes_per_rank"] for r in rs),
            cuda_max_allocated_bytes_per_rank=first["cuda_max_allocated_bytes_per_rank"],
            final_loss_median=harness.median_of(r["final_loss"] for r in rs),
            final_loss_runs=[r["final_loss"] for r in rs],
            late_loss_median=harness.median_of(r["late_loss"] for r in rs),
            losses_run0=first["losses"],
            process_wall_s_runs=[r["process_wall_s"] for r in rs],
            exit_codes=[r["exit_code"] for r in rs],
        )
        table[name] = row
    for name, row in table.items():
        for suffix, ref_name in (("baseline", BASELINE), ("replicated", REPLICATED_PEER.get(name)),
                                 ("no_tp", NO_TP_PEER.get(name)), ("fsdp2_tp", FSDP2_TP_PEER.get(name)),
                                 ("fsdp2_tp_adamw", "fsdp2_tp_adamw" if name in FSDP2_TP_PEER else None)):
            ref = table.get(ref_name) if ref_name else None
            if ref is None:
                continue
            for key in ("step", "step_cpu", "fwd_bwd", "opt"):
                row[f"{key}_ratio_{suffix}"] = row[key + "_ms_median"] / ref[key + "_ms_median"]
            row[f"tokens_per_s_ratio_{suffix}"] = row["tokens_per_s_median"] / ref["tokens_per_s_median"]
            if ref["state_bytes_max_per_rank"]:
                row[f"state_ratio_{suffix}"] = row["state_bytes_max_per_rank"] / ref["state_bytes_max_per_rank"]
            row[f"max_abs_loss_diff_{suffix}"] = max(
                abs(a - b) for a, b in zip(row["losses_run0"], ref["losses_run0"]))
    return table


def check_targets(cell: dict) -> list[dict]:
    """The project's targets at 2+ ranks, measured: each with its value, limit and verdict."""
    t, world = cell["results"], cell["devices"]
    if world < 2:
        return []
    out = []

    def target(name: str, value: float | None, limit: float, note: str = "", applies: bool = True) -> None:
        if value is not None:
            out.append({"target": name, "value": value, "limit": limit, "met": value <= limit, "note": note,
                        "applies": applies})

    def ratio(a: str, b: str, key: str = "step_ms_median") -> float | None:
        return t[a][key] / t[b][key] if a in t and b in t else None

    target("layerwise_adamw step / ddp_adamw step", ratio("layerwise_adamw", "ddp_adamw"), 1.05)
    share = t["ddp_muon"]["ns_share"] if "ddp_muon" in t else 0.0
    # The target is set for steps where Newton-Schulz is at least a third of the replicated step.
    target("layerwise_muon step / ddp_muon step", ratio("layerwise_muon", "ddp_muon"), 0.75,
           f"Newton-Schulz share of the replicated step {share:.2f}", applies=share >= 1 / 3)
    target("layerwise_muon step / ddp_zero_muon step", ratio("layerwise_muon", "ddp_zero_muon"), 1.0)
    for name in ("layerwise_adamw", "layerwise_muon"):
        peer = REPLICATED_PEER[name]
        if name in t and peer in t:
            limit = t[peer]["state_bytes_max_per_rank"] / world * 1.02
            target(f"{name} optimizer state per rank (bytes), limit (1/{world}) x {peer} + 2 %",
                   t[name]["state_bytes_max_per_rank"], limit)
    return out


# ---------------------------------------------------------------------------------------
# Report: markdown tables and plots (pure functions of the JSON)
# ---------------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str) -> str:
    return harness.fmt(value, spec, empty="–")


def cell_title(cell: dict) -> str:
    m = cell["model"]
    return (f"{cell['size']}, {cell['devices']} rank{'s' if cell['devices'] > 1 else ''}: GPT n_layer={m['n_layer']} "
            f"n_embd={m['n_embd']} ({m['n_params'] / 1e6:.2f} M params), batch {m['batch_size']} x "
            f"{m['block_size']} per rank, {m['steps']} timed steps after {m['warmup']}")


def _target_cells(x: dict) -> list[str]:
    big = x["value"] > 100
    value = f"{x['value'] / 1024:.0f} KiB" if big else f"{x['value']:.3f}"
    limit = f"{x['limit'] / 1024:.0f} KiB" if big else f"{x['limit']:.2f}"
    note = f" ({x['note']})" if x["note"] else ""
    met = ("yes" if x["met"] else "**no**") if x.get("applies", True) else "n/a (NS share < 1/3)"
    return [x["cell"], f"{x['target']}{note}", value, limit, met]


TIME_HEADER = ["configuration", "step", "×ddp_adamw", "×replicated", "tokens/s", "step CPU", "fwd+bwd", "clip", "opt",
               "NS", "NS share", "exposed comm"]


def _time_cells(name: str, r: dict) -> list[str]:
    return [f"`{name}`", f"{r['step_ms_median']:.1f}", _fmt(r.get("step_ratio_baseline"), ".2f"),
            _fmt(r.get("step_ratio_replicated"), ".2f"), f"{r['tokens_per_s_median']:,.0f}",
            f"{r['step_cpu_ms_median']:.1f}", f"{r['fwd_bwd_ms_median']:.1f}", f"{r['clip_ms_median']:.2f}",
            f"{r['opt_ms_median']:.2f}", f"{r['ns_ms_median']:.1f}", f"{r['ns_share']:.2f}",
            f"{r['exposed_comm_ms_median']:.2f}"]


def _memory_header(accelerator: str) -> list[str]:
    return ["configuration", "optimizer state KiB/rank (per rank)", "×replicated", "params KiB/rank",
            "peak CUDA MiB/rank" if accelerator == "gpu" else "peak RSS MiB/rank (before the run's end)",
            "communicated KiB/step", "ring KiB/step",
            "final loss", "mean of last 10", "max \\|Δloss\\| vs replicated"]


def _memory_cells(name: str, r: dict) -> list[str]:
    per_rank = " / ".join(f"{b / 1024:.0f}" for b in r["state_bytes_per_rank"])
    kinds = ", ".join(f"{k} {v / 1024:.0f}" for k, v in sorted(r["comm_bytes_by_kind"].items()) if v)
    mem = r["cuda_max_allocated_bytes_per_rank"] or r["peak_rss_bytes_per_rank_median"]
    before_end = r.get("train_peak_rss_bytes_per_rank_median") if not r["cuda_max_allocated_bytes_per_rank"] else None
    return [f"`{name}`", f"{r['state_bytes_max_per_rank'] / 1024:.0f} ({per_rank})",
            _fmt(r.get("state_ratio_replicated"), ".3f"), f"{r['param_bytes_per_rank'] / 1024:.0f}",
            f"{mem / 2**20:.0f}" + (f" ({before_end / 2**20:.0f})" if before_end else ""), f"{r['comm_bytes_median'] / 1024:.0f}{f' ({kinds})' if kinds else ''}",
            f"{r['ring_bytes_median'] / 1024:.0f}", f"{r['final_loss_median']:.4f}", f"{r['late_loss_median']:.4f}",
            _fmt(r.get("max_abs_loss_diff_replicated"), ".1e")]


def markdown_report(data: dict) -> str:
    meta = data["meta"]
    lines = [
        f"# Strategies on {meta['accelerator'].upper()}: measured tables",
        "",
        f"Generated by `{meta['command']}` from `{meta['json']}`.",
        f"Machine: {meta['device_name']}, {meta['cpu_count']} CPU cores, torch {meta['torch']}, backend "
        f"{meta['backend']}; {meta['threads_per_rank'] or '-'} thread(s) per rank on CPU. Load average "
        f"(1/5/15 min) at start {'/'.join(f'{x:.2f}' for x in meta['load_avg_start'])}, at end "
        f"{'/'.join(f'{x:.2f}' for x in meta['load_avg_end'])}; {meta['total_wall_s']:.0f} s in all. "
        f"Medians of {meta['repeats']} interleaved runs; within a run, the slower rank per step and the "
        "median over steps.",
        "",
    ]
    targets = [dict(x, cell=f"{c['size']}, {c['devices']} ranks") for c in data["cells"] for x in c.get("targets", [])]
    if targets:
        lines += ["## Targets", "", harness.markdown_table(["size, ranks", "target", "measured", "limit", "met"],
                                                           map(_target_cells, targets)), ""]
    for cell in data["cells"]:
        t = cell["results"]
        lines += [f"## {cell_title(cell)}", "",
                  "Time in ms per optimizer step. ×ddp_adamw and ×replicated: step time divided by that of "
                  "`ddp_adamw` and of the row's replicated peer (`ddp_adamw` for AdamW rows, `ddp_muon` for "
                  "Muon rows). NS: Newton-Schulz inside the optimizer step. Exposed comm: time blocked "
                  "waiting for communication.", "",
                  harness.markdown_table(TIME_HEADER, [_time_cells(name, r) for name, r in t.items()]), "",
                  "Memory per rank, communication per step and loss. Optimizer state: the largest rank's "
                  "(×replicated: divided by the peer's). Communicated: bytes handed to collectives per rank "
                  "per step, by collective; ring: what one rank sends with ring algorithms.", "",
                  harness.markdown_table(_memory_header(meta["accelerator"]),
                                         [_memory_cells(name, r) for name, r in t.items()]), ""]
        lines += [f"`{name}` raised: `{error}`" for name, error in cell.get("errors", {}).items()]
    plots = data.get("plots") or []
    if plots:
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    return "\n".join(lines)


def report_stem(data: dict) -> str:
    """Name of the markdown and PNG files: the JSON's (``strategies_cpu`` for the default run)."""
    return Path(data["meta"].get("json") or f"strategies_{data['meta']['accelerator']}.json").stem


def _grid(plt, n: int, height: float):
    cols = 2 if n > 1 else 1
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(7.5 * cols, height * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.axis("off")
    return fig, list(axes.flat)


def _plot_time(plt, cells: list[dict], accelerator: str, path: Path) -> str:
    """Step time, stacked by phase, with tokens/s and the ratios."""
    phases = (("fwd+bwd", "fwd_bwd_ms_median", "#4c72b0"), ("clip", "clip_ms_median", "#dd8452"),
              ("optimizer", "opt_ms_median", "#55a868"))
    fig, axes = _grid(plt, len(cells), 0.42 * max(len(c["results"]) for c in cells) + 1.6)
    for ax, cell in zip(axes, cells):
        names = list(cell["results"])[::-1]
        rows = [cell["results"][n] for n in names]
        left = [0.0] * len(rows)
        for label, key, color in phases:
            widths = [r[key] for r in rows]
            ax.barh(names, widths, left=left, color=color, label=label)
            left = [a + b for a, b in zip(left, widths)]
        rest = [r["step_ms_median"] - l for r, l in zip(rows, left)]
        ax.barh(names, rest, left=left, color="#c7c7c7", label="rest (data, hooks, between steps)")
        top = max(r["step_ms_median"] for r in rows)
        for i, r in enumerate(rows):
            text = f"{r['step_ms_median']:.0f} ms  {r['tokens_per_s_median']:,.0f} tok/s"
            if "step_ratio_replicated" in r:
                text += f"  ×{r['step_ratio_replicated']:.2f} vs {REPLICATED_PEER[names[i]]}"
            elif "step_ratio_baseline" in r and names[i] != BASELINE:
                text += f"  ×{r['step_ratio_baseline']:.2f} vs {BASELINE}"
            ax.text(r["step_ms_median"] + top * 0.01, i, text, va="center", fontsize=8)
        ax.set_xlim(0, top * 1.9)
        ax.set_xlabel("ms per optimizer step (median)")
        ax.set_title(f"{cell['size']}, {cell['devices']} rank{'s' if cell['devices'] > 1 else ''}", fontsize=10)
        ax.tick_params(axis="y", labelsize=8)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=4)
    fig.suptitle(f"Step time on {accelerator.upper()}, median (×: step time divided by the named row's)", fontsize=11)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return str(harness.save_figure(fig, path))


def _plot_memory(ax, cell: dict, accelerator: str) -> None:
    names = list(cell["results"])[::-1]
    rows = [cell["results"][n] for n in names]
    state = [r["state_bytes_max_per_rank"] / 2**20 for r in rows]
    params = [r["param_bytes_per_rank"] / 2**20 for r in rows]
    ax.barh(names, params, color="#8172b3", label="parameters")
    ax.barh(names, state, left=params, color="#55a868", label="optimizer state")
    top = max(a + b for a, b in zip(state, params))
    for i, r in enumerate(rows):
        mem = r["cuda_max_allocated_bytes_per_rank"] or r["peak_rss_bytes_per_rank_median"]
        text = f"state {state[i]:.2f} MiB"
        if "state_ratio_replicated" in r:
            text += f" (×{r['state_ratio_replicated']:.2f})"
        text += f"; peak {'CUDA' if accelerator == 'gpu' else 'RSS'} {mem / 2**20:.0f} MiB"
        ax.text(state[i] + params[i] + top * 0.01, i, text, va="center", fontsize=8)
    ax.set_xlim(0, top * 2.1)
    ax.set_xlabel("MiB per rank (largest rank)")
    ax.set_title(f"memory: {cell['size']}, {cell['devices']} ranks", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")


def _plot_comm(ax, cell: dict) -> None:
    names = list(cell["results"])[::-1]
    rows = [cell["results"][n] for n in names]
    kinds = sorted({k for r in rows for k, v in r["comm_bytes_by_kind"].items() if v})
    left = [0.0] * len(rows)
    for kind, color in zip(kinds, ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860")):
        widths = [r["comm_bytes_by_kind"].get(kind, 0) / 2**20 for r in rows]
        ax.barh(names, widths, left=left, color=color, label=kind)
        left = [a + b for a, b in zip(left, widths)]
    top = max(left) or 1.0
    for i, r in enumerate(rows):
        ax.text(left[i] + top * 0.01, i, f"{left[i]:.1f} MiB, exposed {r['exposed_comm_ms_median']:.1f} ms",
                va="center", fontsize=8)
    ax.set_xlim(0, top * 1.7)
    ax.set_xlabel("MiB handed to collectives per rank per step")
    ax.set_title(f"communication: {cell['size']}, {cell['devices']} ranks", fontsize=10)
    ax.legend(fontsize=7, loc="upper right")


def _plot_loss(plt, multi: list[dict], path: Path) -> str:
    """Loss per step (run 0 of each configuration)."""
    fig, axes = _grid(plt, len(multi), 3.6)
    for ax, cell in zip(axes, multi):
        names = list(cell["results"])
        for name, r in cell["results"].items():
            # AdamW rows in blues, Muon rows in reds; layer-wise solid, the others dashed.
            family = ("#08519c", "#3182bd", "#6baed6", "#9ecae1") if "adamw" in name else (
                "#a50f15", "#de2d26", "#fb6a4a", "#fc9272", "#fcbba1")
            index = sum(1 for n in names[:names.index(name)] if ("adamw" in n) == ("adamw" in name))
            style = "-" if name.startswith("layerwise") else "--"
            ax.plot(range(1, len(r["losses_run0"]) + 1), r["losses_run0"], style, lw=1.2,
                    color=family[index % len(family)], label=name)
        ax.set_xlabel("optimizer step (warm-up included)")
        ax.set_ylabel("training loss (global batch)")
        ax.set_title(f"{cell['size']}, {cell['devices']} ranks (first run of each configuration)", fontsize=10)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return str(harness.save_figure(fig, path))


def make_plots(data: dict, docs_dir: Path) -> list[str]:
    """Step time (with tokens/s and ratios), memory and communication, loss curves: one PNG each."""
    plt = harness.pyplot()
    acc = data["meta"]["accelerator"]
    stem = report_stem(data)
    cells = data["cells"]
    paths = [_plot_time(plt, cells, acc, docs_dir / f"{stem}_time.png")]
    # Memory and communication per rank.
    multi = [c for c in cells if c["devices"] > 1] or cells
    fig, axes = plt.subplots(len(multi), 2, figsize=(15, (0.42 * max(len(c["results"]) for c in multi) + 1.6)
                                                    * len(multi)), squeeze=False)
    for (ax_mem, ax_comm), cell in zip(axes, multi):
        _plot_memory(ax_mem, cell, acc)
        _plot_comm(ax_comm, cell)
        for ax in (ax_mem, ax_comm):
            ax.tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    paths.append(str(harness.save_figure(fig, docs_dir / f"{stem}_memory_comm.png")))
    paths.append(_plot_loss(plt, multi, docs_dir / f"{stem}_loss.png"))
    plt.close("all")
    return paths


def write_report(data: dict, docs_dir: Path, plots: bool = True) -> Path:
    docs_dir.mkdir(parents=True, exist_ok=True)
    if plots:
        data["plots"] = [os.path.relpath(p, ROOT) for p in make_plots(data, docs_dir)]
    md = docs_dir / f"{report_stem(data)}.md"
    md.write_text(markdown_report(data))
    return md


SUMMARY_COLUMNS = (
    harness.Column("config", 27, align="<"), harness.Column("step ms", 8, ".1f"), harness.Column("×base", 6, ".2f"),
    harness.Column("×repl", 6, ".2f"), harness.Column("tok/s", 8, ".0f"), harness.Column("fwd+bwd", 8, ".1f"),
    harness.Column("opt", 7, ".2f"), harness.Column("NS", 6, ".1f"), harness.Column("exposed", 7, ".2f"),
    harness.Column("KiB/step", 9, ".0f"), harness.Column("state KiB", 9, ".0f"), harness.Column("loss", 7, ".4f"),
)


def print_summary(data: dict) -> None:
    for cell in data["cells"]:
        print(f"\n{cell_title(cell)}")
        print(harness.fixed_width(SUMMARY_COLUMNS, [
            [name, r["step_ms_median"], r.get("step_ratio_baseline"), r.get("step_ratio_replicated"),
             r["tokens_per_s_median"], r["fwd_bwd_ms_median"], r["opt_ms_median"], r["ns_ms_median"],
             r["exposed_comm_ms_median"], r["comm_bytes_median"] / 1024, r["state_bytes_max_per_rank"] / 1024,
             r["final_loss_median"]] for name, r in cell["results"].items()], empty="–"))
        for x in cell.get("targets", []):
            verdict = ("met" if x["met"] else "MISSED") if x.get("applies", True) else "does not apply"
            print(f"  target {x['target']}: {x['value']:.3f} (limit {x['limit']:.3f}) {verdict} {x['note']}")


def count_params(size: Size, vocab_size: int) -> int:
    from examples.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=vocab_size, block_size=size.block_size, n_layer=size.n_layer, n_head=size.n_head,
                    n_embd=size.n_embd)
    return sum(p.numel() for p in GPT(cfg).parameters())


def parse_list(text: str, choices, what: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in items if x not in choices]
    if unknown or not items:
        raise ValueError(f"--{what} {text!r}: unknown {unknown}; choose from {list(choices)}.")
    return items


# ---------------------------------------------------------------------------------------
# Two diagnostics behind the findings: collective timings, and the wrapper's hook cost
# ---------------------------------------------------------------------------------------


def time_collectives(sizes_mib: list[float], repeats: int = 15) -> None:
    """All-reduce vs reduce-scatter vs all-gather of fp32 buffers, median ms (run under torchrun).

    ``torchrun --nproc-per-node 2 benchmarks/bench_strategies.py --collectives 3.1,27.3``
    """
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if torch.cuda.is_available() else None
    for mib in sizes_mib:
        numel = int(mib * 2**20 / 4) // world * world
        full = torch.randn(numel, device=device)
        shard = torch.empty(numel // world, device=device)
        ops = {"all_reduce": lambda: dist.all_reduce(full),
               "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full),
               "all_gather": lambda: dist.all_gather_into_tensor(full, shard)}
        medians = {}
        for name, op in ops.items():
            times = []
            for i in range(repeats + 3):
                dist.barrier()
                t0 = time.perf_counter()
                op()
                if device is not None:
                    torch.cuda.synchronize()
                if i >= 3:
                    times.append(time.perf_counter() - t0)
            medians[name] = 1e3 * statistics.median(times)
        if rank == 0:
            print(f"{mib:.1f} MiB fp32, {world} ranks: " + ", ".join(f"{k} {v:.2f} ms" for k, v in medians.items()),
                  flush=True)
    dist.destroy_process_group()


def profile_hooks(size_name: str, steps: int = 15) -> None:
    """One process: forward+backward of the plain GPT vs the same GPT in LayerwiseDataParallel, then cProfile.

    No process group (``ProcessGroups.single()``), so the difference is the wrapper's own
    Python work: the per-parameter gradient hook, forward pre-hooks, buffer zeroing.
    """
    import cProfile
    import pstats

    torch.set_num_threads(1)
    import lightning_layerwise as llw
    from examples.gpt import GPT, GPTConfig

    size = size_of(size_name)
    x = torch.randint(0, 96, (size.batch_size, size.block_size))

    def build(wrap: bool):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=96, n_layer=size.n_layer, n_head=size.n_head, n_embd=size.n_embd,
                              block_size=size.block_size))
        if wrap:
            model = llw.LayerwiseDataParallel(model, process_groups=llw.ProcessGroups.single(),
                                              bucket_size=size.bucket_size)
        return model

    def step(model, wrap: bool) -> None:
        _, loss = model(x, x)
        loss.backward()
        if wrap:
            model.finish_grad_sync()
            model.start_param_sync()
        model.zero_grad(set_to_none=True)

    models = {False: build(False), True: build(True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(steps + 3):
        for wrap in (False, True):  # interleaved, so load changes hit both
            t0 = time.perf_counter()
            step(models[wrap], wrap)
            if i >= 3:
                times[wrap].append(time.perf_counter() - t0)
    print(f"{size_name}: forward+backward, median of {steps} interleaved steps: plain GPT "
          f"{1e3 * statistics.median(times[False]):.1f} ms, in LayerwiseDataParallel "
          f"{1e3 * statistics.median(times[True]):.1f} ms")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(10):
        step(models[True], True)
    profiler.disable()
    print("cProfile of 10 wrapped steps (tottime):")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(12)


def plan_cells(args: argparse.Namespace) -> list[dict]:
    """The (size, rank count) cells of the matrix, each with the configurations that run in it."""
    sizes = [x.strip() for x in (args.sizes or ("tiny,wide" if args.accelerator == "cpu" else "gpt2-small")).split(",")
             if x.strip()]
    for name in sizes:
        size_of(name)
    names = parse_list(args.configs, CONFIGS, "configs")
    try:
        device_counts = [int(d) for d in args.devices.split(",") if d.strip()]
    except ValueError:
        device_counts = []
    if not device_counts or min(device_counts) < 1:
        raise ValueError(f"--devices {args.devices!r}: pass rank counts >= 1, e.g. --devices 1,2.")
    if (args.warmup is not None and args.warmup < 1) or (args.steps is not None and args.steps < 2):
        raise ValueError(f"--warmup {args.warmup} --steps {args.steps}: need warmup >= 1 and steps >= 2.")

    def runs_at(name: str, devices: int) -> bool:
        config = CONFIGS[name]
        if config.tp > 1 and devices % (2 * config.tp):  # data-parallel 2+ x tensor-parallel tp
            return False
        return devices >= config.min_devices and (devices > 1 or config.one_rank)

    return [{"size": s, "devices": d, "configs": [n for n in names if runs_at(n, d)]}
            for s in sizes for d in device_counts]


def run_matrix(args: argparse.Namespace, cells: list[dict],
               errors: dict[tuple[str, int], dict[str, str]] | None = None) -> dict[tuple[str, int], dict[str, list[dict]]]:
    """Every run of every cell, ``--repeats`` times, interleaved round-robin (the order rotates every repeat).

    A configuration whose training raised (rank 0 writes the error as its result) is recorded in ``errors``
    (cell -> name -> error text) and not run again; without ``errors`` the error is raised."""
    runs = {(c["size"], c["devices"]): {n: [] for n in c["configs"]} for c in cells}
    total = sum(len(c["configs"]) for c in cells) * args.repeats
    done = 0
    for rep in range(args.repeats):
        for cell in cells:
            for name in harness.rotated(cell["configs"], rep):
                key = (cell["size"], cell["devices"])
                if errors is not None and name in errors.get(key, {}):
                    continue
                result = run_one(args, name, cell["size"], cell["devices"])
                done += 1
                if "error" in result:
                    print(f"[{done}/{total}] {cell['size']:5} x{cell['devices']} {name:27} raised: {result['error']}\n"
                          f"{result.get('traceback', '')}", flush=True)
                    if errors is None:
                        raise RuntimeError(f"{name}: {result['error']}")
                    errors.setdefault(key, {})[name] = result["error"]
                    continue
                run = summarize_run(result)
                runs[key][name].append(run)
                print(f"[{done}/{total}] {cell['size']:5} x{cell['devices']} {name:27} step {run['step_ms']:7.1f} ms "
                      f"fwd+bwd {run['fwd_bwd_ms']:7.1f} opt {run['opt_ms']:7.2f} NS {run.get('ns_ms', 0):6.1f} "
                      f"loss {run['final_loss']:.4f} [{run['process_wall_s']:.0f} s, load "
                      f"{os.getloadavg()[0]:.1f}]", flush=True)
    return runs


def result_cells(args: argparse.Namespace, cells: list[dict], runs: dict, errors: dict | None = None) -> list[dict]:
    """Each cell's model, aggregated results and targets (and the error of each configuration that raised)."""
    from examples.data import CharDataModule

    vocab = CharDataModule(max_chars=args.max_chars).vocab_size
    out_cells = []
    for cell in cells:
        size = size_of(cell["size"])
        model = dict(asdict(size), n_params=count_params(size, vocab), vocab_size=vocab)
        model["steps"] = args.steps or size.steps
        model["warmup"] = args.warmup or size.warmup
        tokens = cell["devices"] * size.batch_size * size.block_size
        out = {"size": cell["size"], "devices": cell["devices"], "model": model,
               "results": aggregate(runs[(cell["size"], cell["devices"])], tokens)}
        out["targets"] = check_targets(out)
        out["errors"] = dict((errors or {}).get((cell["size"], cell["devices"]), {}))
        out_cells.append(out)
    return out_cells


def run_meta(args: argparse.Namespace, argv: list[str] | None, clock: harness.Clock, out_path: Path) -> dict:
    """The machine, the command and the settings of a matrix run."""
    return {
        "accelerator": args.accelerator,
        "backend": "gloo" if args.accelerator == "cpu" else "nccl",
        "device_name": (torch.cuda.get_device_name() if args.accelerator == "gpu" and torch.cuda.is_available()
                        else harness.cpu_model()),
        "cpu_count": os.cpu_count(),
        "threads_per_rank": args.threads if args.accelerator == "cpu" else None,
        "load_avg_start": clock.load_at_start,
        "load_avg_end": list(os.getloadavg()),
        "torch": torch.__version__,
        "total_wall_s": clock.elapsed_s(),
        "command": "python benchmarks/bench_strategies.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "json": os.path.relpath(out_path.resolve(), ROOT) if out_path.resolve().is_relative_to(ROOT) else str(out_path),
        **{k: v for k, v in vars(args).items() if not k.startswith("_")},
    }


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.accelerator == "cuda":
        args.accelerator = "gpu"
    if args._worker is not None:
        run_worker(args)
        return
    if args.collectives:
        time_collectives([float(x) for x in args.collectives.split(",")])
        return
    if args.profile_hooks:
        profile_hooks(args.profile_hooks)
        return
    docs_dir = Path(args.docs_dir)
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        print(f"wrote {write_report(data, docs_dir, plots=not args.no_plots)}")
        return
    cells = plan_cells(args)
    clock = harness.Clock()
    errors: dict = {}
    runs = run_matrix(args, cells, errors)
    out_cells = result_cells(args, cells, runs, errors)
    out_path = Path(args.out) if args.out else RESULTS / f"strategies_{args.accelerator}.json"
    data = {"meta": run_meta(args, argv, clock, out_path), "cells": out_cells}
    print_summary(data)
    md = write_report(data, docs_dir, plots=not args.no_plots)
    harness.write_json(out_path, data)
    print(f"wrote {out_path} and {md} ({data['meta']['total_wall_s']:.0f} s in all)")


if __name__ == "__main__":
    main()
