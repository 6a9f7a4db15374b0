"""Optimizer step, communication and memory per rank, projected from counts to many GPUs.

Run (under a minute, most of it planning DeepSeek-V3's layouts; no GPU needed, nothing is timed):

    .venv/bin/python benchmarks/project.py
    .venv/bin/python benchmarks/project.py --models llama3-8b --dp 64 1024 --no-write
    .venv/bin/python benchmarks/project.py --tokens-per-gpu 8192 --mfu 0.35 --nic-gbps 25
    .venv/bin/python benchmarks/project.py --models llama3-8b --dp 64 --tp 8 --tp-dp 64 --no-write

Nothing here is measured. Each number is a count (flops, bytes, operations) put
through a rate or a latency that is a named constant below, with its source, and
a flag. The defaults describe H100 SXM nodes of 8 GPUs with one 400 Gb/s NIC per
GPU. ``docs/benchmarks/projection.md`` lists every assumption and the formulas.

Optimizer step and memory (the second table): Newton–Schulz flops at
``--peak-tflops`` x ``--efficiency``, element-wise updates at ``--hbm-tbps`` x
``--hbm-efficiency``, for what the busiest rank steps in the real layout
(``choose_owner_group_size`` with this page's per-parameter time as cost);
optimizer state and buffers per rank.

Communication per optimizer step and rank (the first table), for

* ``ddp``: torch ``DistributedDataParallel``'s buckets (25 MiB of fp32
  gradients, the first 1 MiB) all-reduced over the whole world as NCCL would
  run them: ring and tree, each at its best protocol, and the one NCCL's tuner
  picks per bucket (Note [alpha-beta model]);
* ``layerwise`` after the change (Note [replica sharing] in
  ``layout/sharing.py``): inside the owner group of ``g`` ranks on NVLink a
  reduce-scatter (fp32) and an all-gather (bf16) of every bucket, padding
  included; across the ``R = dp / g`` groups, per bucket and position, one
  rooted reduce to the replica that steps a shard of whole matrices, issued
  during the backward, and one broadcast from it after the step, or, for a shard
  cut among replicas (element-wise parameters), an equal-chunk reduce-scatter
  and all-gather;
* ``layerwise`` before the change (the previous release): the list-form uneven
  reduce-scatter and all-gather across the groups, which ProcessGroupNCCL runs as
  one ``ncclReduce`` / ``ncclBroadcast`` per rank of the replica group, empty
  chunks included (``2 R`` operations per bucket), the reduces issued after the
  whole backward and the gathers awaited by the compute stream before the forward;
* ``all-to-all``: a torchtitan-style Muon over FSDP: per transformer block a
  reduce-scatter of fp32 gradients and an all-gather of bf16 parameters over the
  whole world, and two all-to-alls of the block's Muon matrices (fp32, to the rank
  that orthogonalizes each matrix and back) in the optimizer step.

Tensor parallelism (the third table, ``benchmarks/project_tp.py``, Note [projected tensor parallelism]):
one row, ``--tp-model`` (Llama-3 70B) at ``--tp`` (8, one node) x ``--tp-dp`` (64): the data-parallel
collectives of the local buckets, the tensor-parallel exchange of Muon's matrices and the optimizer step of
the busiest rank; ``--tp 0`` leaves it out.

Expert parameters are planned and communicated like dense ones over the whole
data-parallel group (no expert parallelism; Note [experts] in
``benchmarks/model_shapes.py``); only the flops count the active experts.

What overlaps is Note [what overlaps]; rooted operations back to back are
Note [rooted chains].

Note [alpha-beta model]
    An operation of ``n`` bytes takes ``alpha + n / beta``. For ring, tree and PAT
    collectives alpha and beta are NCCL's own estimate (``ncclTopoTuneModel`` and
    ``ncclTopoGetAlgoTime`` in ``src/graph/tuning.cc``): a base latency per
    algorithm and protocol, a latency per step over NVLink or the network, the bus
    bandwidth of the channels with NCCL's refinements (protocol caps, tree
    efficiency, the tree correction by message size, the ring plateau factor), and
    the ring's ``nRanks / nsteps`` conversion from bus to algorithm bandwidth. The
    bus bandwidth of a communicator is what its GPUs can push: NVLink within a node;
    across nodes the NICs its GPUs own (one per GPU), at most NVLink. So ``ddp``'s
    ring over 8 GPUs per node runs a channel per NIC, each NIC carrying
    ``2 (n - 1) / n`` of its channels' share of the bytes: ``8 x 50 = 400`` GB/s of
    bus bandwidth. A replica group (one GPU per node) has one NIC: 50 GB/s. NCCL
    runs Reduce and Broadcast as a ring pipeline only, a chain from the root (or to
    it) of ``R - 1`` hops: ``alpha = base + (R - 1) hop``, with NCCL's per-hop
    network latency of a chunk, ``beta`` the NIC. Every choice of algorithm and
    protocol takes the fastest under this model, as NCCL's tuner does.

Note [what overlaps]
    The backward takes ``2/3`` of ``6 N`` flops per token (``N`` the parameters a
    token uses: all of a dense model, the active experts of a mixture) at
    ``--mfu`` of the peak, the forward the other third. A parameter's gradient is
    ready when the backward has gone through every parameter registered after it
    (flops in proportion to elements); the forward needs a parameter when it has
    gone through every one registered before it. Gradient collectives run in
    order on their stream, each starting when issued and when the one before it
    ends: what ends after the backward is exposed. Parameter collectives after the
    step run ahead of the next forward, which waits (exposed) where a bucket is
    not there when its first parameter is needed. ``exposed`` is the sum: the time
    per step the GPU waits for communication. The optimizer step itself is in the
    second table, not here.

Note [rooted chains]
    A rooted reduce or broadcast alone costs ``base + (R - 1) hop + S / beta``: the
    chain fills, then streams. Back to back on one stream each rank's next kernel
    starts when its own previous one ends, so a rank early in one chain starts the
    next while the tail drains: if every rank ends operation ``j`` at
    ``C_j + position x hop``, operation ``j + 1`` (whose chain begins ``d`` hops
    further along the ring) ends at its head at
    ``C_{j+1} = max(C_j + d hop, issued) + base + S / beta``, and the last rank
    ``(R - 1) hop`` later. So the fill is paid once per stream of operations whose
    roots move forward along the ring, up to once per operation where they jump
    back. Both views are in the JSON; the table shows them as ``isolated / stream``,
    and the page's headline numbers use isolated: NCCL's own model charges each
    operation its latency, and it is the upper bound.
    A stream never runs faster than its host issues operations:
    ``HOST_SECONDS_PER_OP`` each, empty ones included (NCCL drops an empty
    collective on the device, ``src/enqueue.cc``, but the call is made).
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping, NamedTuple, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import harness  # noqa: E402
from benchmarks.model_shapes import MODELS, ModelShapes, model_shapes  # noqa: E402
from lightning_layerwise.layout import (  # noqa: E402
    DEFAULT_BUCKET_SIZE,
    BucketPlan,
    Layout,
    ParamSpec,
    choose_owner_group_size,
    share_among_replicas,
)

# --- compute -----------------------------------------------------------------------------------------------------

H100_BF16_TFLOPS = 989.0


"""Dense bf16 tensor-core peak of an H100 SXM (NVIDIA H100 datasheet: 1,979 TFLOP/s is with sparsity)."""


H100_HBM_TBPS = 3.35


"""HBM3 bandwidth of an H100 SXM 80 GB (NVIDIA H100 datasheet)."""


MFU = 0.4


"""Model flops utilization of forward and backward: Llama 3's pre-training reports 38-43% bf16 MFU on H100s
("The Llama 3 Herd of Models", 2024, Table 4)."""


TOKENS_PER_GPU = 16384


"""Tokens per GPU per optimizer step: two sequences of 8192. At dp 1024 that is a global batch of 16.8M tokens,
the 16M Llama 3 pre-training reached (same paper, section 3.4.1)."""


ROUTED_EXPERT_SHARE = {"deepseek-v3": 8 / 256, "mixtral-8x7b": 2 / 8}


"""Share of the routed experts a token goes through: DeepSeek-V3 routes each token to 8 of 256 (its report; the
shared expert is dense here), Mixtral to 2 of 8. Gives the flops (DeepSeek-V3: 37.6B of 671B parameters
active, the report says 37B); every expert still gets a gradient, so all are communicated."""


ADAMW_BYTES_PER_ELEMENT = 30
MUON_BYTES_PER_ELEMENT = 26
ADAMW_STATE_BYTES = 12
MUON_STATE_BYTES = 8
CONFIGS = ("layerwise_muon", "ddp_muon", "ddp_adamw")

# --- the network ---------------------------------------------------------------------------------------------------

NVLINK_GBPS = 450.0


"""NVLink bandwidth of an H100 SXM per direction: 18 NVLink 4 links of 25 GB/s (datasheet: 900 GB/s both ways).
NCCL's topology model counts 20.6 GB/s per link on sm90 (``SM90_NVLINK_BW``, ``src/graph/topo.h``): 371 GB/s."""


NIC_GBPS = 50.0


"""One 400 Gb/s InfiniBand NIC (ConnectX-7) per direction."""


NICS_PER_NODE = 8


"""Compute-fabric NICs per node of 8 H100s: one per GPU (DGX H100 and HGX H100 reference designs)."""


GPUS_PER_NODE = 8


NCCL_CHANNELS = 16


"""Channels NCCL runs across nodes, two per NIC. Only NCCL's per-channel caps depend on it; none binds at 11 or
more."""


HOST_SECONDS_PER_OP = 10e-6


"""Host time to issue one NCCL operation through ProcessGroupNCCL: the kernel launch and the proxy thread's
work for it, about 10 us. The upper end for an operation coalesced with others (one launch serves the group)."""


DDP_BUCKET_BYTES = 25 * 2 ** 20
DDP_FIRST_BUCKET_BYTES = 2 ** 20


"""``DistributedDataParallel(bucket_cap_mb=25)`` and its smaller first bucket
(``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``), filled in reverse registration order, a bucket closed
once it reaches its cap (``_compute_bucket_assignment_by_size``)."""


PROTOCOLS = ("LL", "LL128", "Simple")
LL, LL128, SIMPLE = range(3)

NCCL_BASE_LATENCY_US = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4), "pat": (8.0, 8.0, 8.0)}


"""NCCL's latency per operation by algorithm, for LL, LL128 and Simple (``baseLatencies`` in
``ncclTunerConstantsDefaults``, ``src/graph/tuning.cc``)."""


NCCL_HW_LATENCY_US = {
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4), "pat": (0.0, 0.0, 4.0)},
    "net": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0), "pat": (0.0, 0.0, 14.0)},
}


"""NCCL's latency per step over NVLink and over the network, by algorithm, for LL, LL128 and Simple
(``hwLatencies``, same place). A tree/Simple step is a chunk's latency: NCCL uses it for the steps of Reduce and
Broadcast and, with one GPU per node, for every network step."""


NCCL_LL_MAX_GBPS = (141.0, 39.0, 20.4)


"""LL's bandwidth cap on one node (Hopper), two nodes, more (Intel hosts) (``llMaxBws``)."""


NCCL_RING_LL128_CHANNEL_GBPS = 36.7
NCCL_TREE_CHANNEL_GBPS = (38.7, 41.4, 36.0)
NCCL_TREE_LL128_CHANNEL_GBPS = (36.7, 36.7, 29.0)


"""Per-channel caps on Hopper for ring/LL128, tree and tree/LL128 on one node, two, more
(``perChMaxRingLL128Bws``, ``perChMaxTreeBws``, ``perChMaxTreeLL128Bws``)."""


NCCL_TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9),
)


"""NCCL's tree all-reduce bandwidth factor by ``log2(bytes / 64)`` (64 B to 256 MB), per protocol
(``treeCorrectionFactor``, same file)."""


NCCL_RING_PLATEAU = 1.4
NCCL_NET_OVERHEAD_US = 1.0


"""NCCL's ring all-reduce latency factor across nodes on sm80 and later ("plateau effect of ring"), and the
network post overhead per step on an Intel host (``getNetOverhead``; three times that for Simple)."""


SHARDED_WORKING_BUCKETS = 6


"""Full buckets a rank holds at once with ``shard_parameters=True``, estimated: ``prefetch_depth + 1`` (3) of
parameters and as many of gradients (docs/design.md, "Sharded parameters", measures one step)."""


# --- rates ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Hardware:
    """The compute rates every flop and byte count of the optimizer step is divided by (module docstring)."""

    peak_tflops: float
    efficiency: float
    hbm_tbps: float
    hbm_efficiency: float
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


@dataclass(frozen=True)
class Fabric:
    """The links and the per-operation costs of Note [alpha-beta model]."""

    nvlink_gbps: float
    nic_gbps: float
    nics_per_node: int
    gpus_per_node: int
    channels: int
    host_s_per_op: float


class Comm(NamedTuple):
    """A communicator: its ranks and the nodes they are on (as many on each)."""

    ranks: int
    nodes: int

    @property
    def per_node(self) -> int:
        return self.ranks // self.nodes


def comm_of(ranks: int, ranks_per_node: int) -> Comm:
    """A communicator of ``ranks`` that fills nodes ``ranks_per_node`` at a time."""
    return Comm(ranks, max(1, -(-ranks // ranks_per_node)))


class Cost(NamedTuple):
    """One operation's time under the model, what ran it, and for a rooted chain its latency per hop (Note
    [rooted chains])."""

    seconds: float
    algorithm: str
    protocol: str
    hop_s: float = 0.0


NO_COST = Cost(0.0, "-", "-")


# --- NCCL's model (Note [alpha-beta model]) -------------------------------------------------------------------------

def _size_class(comm: Comm) -> int:
    """NCCL's index into its per-node-count tables: one node, two, more."""
    return 0 if comm.nodes == 1 else 1 if comm.nodes == 2 else 2


def bus_gbps(comm: Comm, fabric: Fabric) -> float:
    """What the communicator's channels can push per GPU: NVLink on one node; across nodes the NICs its GPUs own
    on each node (one per GPU), at most NVLink."""
    if comm.nodes == 1:
        return fabric.nvlink_gbps
    nics = comm.per_node * fabric.nics_per_node / fabric.gpus_per_node * fabric.nic_gbps
    return nics if comm.per_node == 1 else min(fabric.nvlink_gbps, nics)


def _steps(collective: str, comm: Comm) -> tuple[int, int]:
    """Ring steps in all and across nodes (``nsteps``, ``nInterSteps``)."""
    if collective == "all_reduce":
        return 2 * (comm.ranks - 1), 2 * (comm.nodes - 1)
    return comm.ranks - 1, comm.nodes - 1


def _latency_us(collective: str, algorithm: str, p: int, comm: Comm) -> float:
    base = NCCL_BASE_LATENCY_US[algorithm][p]
    intra = NCCL_HW_LATENCY_US["nvlink"][algorithm][p]
    inter = NCCL_HW_LATENCY_US["net"]["tree" if comm.per_node == 1 else algorithm][p]
    log_nodes = comm.nodes.bit_length() - 1
    if algorithm == "ring":
        steps, inter_steps = _steps(collective, comm)
        if comm.nodes == 1:
            return base + steps * intra
        intra = max(intra, NCCL_NET_OVERHEAD_US * (3 if p == SIMPLE else 1))
        return base + (steps - inter_steps) * intra + inter_steps * inter
    if algorithm == "tree":
        return base + 2 * ((comm.per_node - 1) * intra + log_nodes * inter)
    return base + log_nodes * inter / 3.5 + comm.ranks * 2.8  # pat


def _bus_after_caps(algorithm: str, p: int, comm: Comm, fabric: Fabric) -> float:
    bus, size, channels = bus_gbps(comm, fabric), _size_class(comm), fabric.channels
    if algorithm == "ring":
        if p == LL:
            return min(NCCL_LL_MAX_GBPS[size], bus * 0.5)
        if p == LL128:
            return min(bus * 0.92, channels * NCCL_RING_LL128_CHANNEL_GBPS)
        return bus
    if algorithm == "tree":
        bus = min(bus * 0.92, channels * NCCL_TREE_CHANNEL_GBPS[size])
        if p == LL:
            return min(bus / 3.8, NCCL_LL_MAX_GBPS[size])
        if p == LL128:
            return min(bus * (7 / 9 if comm.nodes == 1 else 120 / 128), channels * NCCL_TREE_LL128_CHANNEL_GBPS[size])
        return bus
    return bus * 0.75  # pat


def nccl_seconds(collective: str, algorithm: str, p: int, nbytes: int, comm: Comm, fabric: Fabric) -> float:
    """NCCL's estimate of one ring, tree or PAT collective over ``nbytes`` (the whole buffer: what is all-reduced,
    reduce-scattered or all-gathered)."""
    latency = _latency_us(collective, algorithm, p, comm)
    bw = _bus_after_caps(algorithm, p, comm, fabric)
    if algorithm == "ring":
        steps, _ = _steps(collective, comm)
        bw *= comm.ranks / steps
    elif algorithm == "tree":
        bw *= 0.5
        log_size = max(0, (nbytes >> 6).bit_length() - 1)
        if log_size < 23:  # NCCL corrects up to 256 MB
            bw *= NCCL_TREE_CORRECTION[p][log_size]
    if (algorithm == "ring" and p == SIMPLE and collective == "all_reduce" and comm.nodes > 1
            and nbytes / (fabric.channels * comm.ranks) >= 64):
        latency *= NCCL_RING_PLATEAU
    return (latency + nbytes / (1e3 * bw)) * 1e-6


def chain_cost(p: int, nbytes: int, comm: Comm, fabric: Fabric) -> Cost:
    """A rooted Reduce or Broadcast alone: a pipeline along the ring from (or to) the root, ``R - 1`` hops
    (Note [alpha-beta model]); a hop is NCCL's chunk latency for the link it crosses."""
    simple_or = "tree" if p == SIMPLE else "ring"
    intra = NCCL_HW_LATENCY_US["nvlink"][simple_or][p]
    inter = NCCL_HW_LATENCY_US["net"]["tree" if comm.per_node == 1 else simple_or][p]
    hops = (comm.ranks - comm.nodes) * intra + (comm.nodes - 1) * inter
    hop = hops / max(1, comm.ranks - 1)
    base = NCCL_BASE_LATENCY_US["ring"][p]
    return Cost((base + hops) * 1e-6 + nbytes / (1e9 * _bus_after_caps("ring", p, comm, fabric)), "chain",
                PROTOCOLS[p], hop * 1e-6)


@functools.lru_cache(maxsize=None)
def best_cost(collective: str, nbytes: int, comm: Comm, fabric: Fabric, algorithms: tuple[str, ...] = ()) -> Cost:
    """The fastest algorithm and protocol for one operation under the model (what NCCL's tuner picks), among
    ``algorithms`` if given."""
    if nbytes == 0 or comm.ranks == 1:
        return NO_COST
    if collective in ("reduce", "broadcast"):
        return min((chain_cost(p, nbytes, comm, fabric) for p in range(3)), key=lambda c: c.seconds)
    if collective == "all_reduce":
        options = ["ring", "tree"]
    else:  # PAT: reduce-scatter and all-gather with one GPU per node
        options = ["ring"] + (["pat"] if comm.per_node == 1 and comm.nodes > 1 else [])
    if algorithms:
        options = [a for a in options if a in algorithms]
    costs = [Cost(nccl_seconds(collective, a, p, nbytes, comm, fabric), a, PROTOCOLS[p])
             for a in options for p in range(3) if a != "pat" or p == SIMPLE]
    return min(costs, key=lambda c: c.seconds)


def all_to_all_seconds(nbytes: int, comm: Comm, fabric: Fabric) -> float:
    """An all-to-all in which each rank sends ``nbytes`` spread evenly over all ranks (itself included): the part
    for other nodes through the rank's NIC and the part for its own node over NVLink, at once. NCCL has no model
    for it (grouped sends and receives); alpha is one operation's base and one network hop, a lower bound."""
    if comm.ranks == 1 or nbytes == 0:
        return 0.0
    off_node = nbytes * (comm.ranks - comm.per_node) / comm.ranks
    on_node = nbytes * (comm.per_node - 1) / comm.ranks
    nic = fabric.nic_gbps * fabric.nics_per_node / fabric.gpus_per_node
    hop = NCCL_HW_LATENCY_US["net" if comm.nodes > 1 else "nvlink"]["tree"][SIMPLE]
    return (NCCL_BASE_LATENCY_US["ring"][SIMPLE] + hop) * 1e-6 + max(off_node / (nic * 1e9),
                                                                      on_node / (fabric.nvlink_gbps * 1e9))


# --- forward and backward (Note [what overlaps]) -------------------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    """When the backward produces each gradient and the forward needs each parameter, from the step's flops."""

    backward_s: float
    forward_s: float
    ready: Mapping[str, float]
    needed: Mapping[str, float]


def workload(model: ModelShapes, tokens: int, peak_tflops: float, mfu: float) -> Workload:
    share = ROUTED_EXPERT_SHARE.get(model.name, 1.0)
    weights = [s.numel * (share if s.kind == "expert" else 1.0) for s in model.specs]
    total = sum(weights)
    step = 6 * total * tokens / (peak_tflops * 1e12 * mfu)
    backward, forward = step * 2 / 3, step / 3
    ready, needed = {}, {}
    before = 0.0
    for spec, w in zip(model.specs, weights):
        needed[spec.name] = forward * before / total
        before += w
        ready[spec.name] = backward * (total - before + w) / total
    return Workload(backward, forward, ready, needed)


def run_in_order(ops: Sequence[tuple[float, float]]) -> list[float]:
    """End times of ``(issued, seconds)`` operations run one after another on one stream."""
    ends, t = [], 0.0
    for issued, seconds in ops:
        t = max(t, issued) + seconds
        ends.append(t)
    return ends


def forward_stall(needed: Sequence[float], available: Sequence[float]) -> float:
    """Time the forward waits when it needs bucket ``i`` ``needed[i]`` seconds into its own compute and the
    bucket arrives at ``available[i]`` (both in forward order)."""
    stall = 0.0
    for need, there in zip(needed, available):
        stall += max(0.0, there - (need + stall))
    return stall


class CrossOp(NamedTuple):
    """One operation on a replica group's stream: issued at ``issued`` (seconds), ``host_ops`` calls to make
    first; ``cost`` ``None`` for calls that send nothing."""

    issued: float
    kind: str  # "reduce", "broadcast" (rooted) or "ring"
    root: int
    cost: Cost | None
    host_ops: int = 1


def run_cross(ops: Sequence[CrossOp], replicas: int, view: str, host_s: float,
              at_once: bool = False) -> tuple[list[float], float]:
    """Completion time of each operation (NaN for host-only entries) and of the stream, in the ``view``
    ``"isolated"`` (each operation alone, after the one before it has ended on every rank) or ``"stream"``
    (Note [rooted chains]); ``at_once``: every operation issued at 0."""
    host, done = 0.0, []
    head_done, head, hop, flat = None, 0, 0.0, True  # the chain head's end, where it sits on the ring
    for op in ops:
        host = max(host, 0.0 if at_once else op.issued) + op.host_ops * host_s
        if op.cost is None:
            done.append(float("nan"))
            continue
        tail = 0.0 if head_done is None else head_done if flat else head_done + (replicas - 1) * hop
        if view == "isolated" or op.kind == "ring":
            head_done, flat = max(tail, host) + op.cost.seconds, True
            done.append(head_done)
            continue
        start = op.root if op.kind == "broadcast" else (op.root + 1) % replicas
        c = op.cost
        if head_done is None:
            begin = host
        elif flat:
            begin = max(head_done, host)
        else:
            begin = max(head_done + (start - head) % replicas * c.hop_s, host)
        head_done = begin + c.seconds - (replicas - 1) * c.hop_s  # base + S / beta after the head starts
        head, hop, flat = start, c.hop_s, False
        done.append(head_done + (replicas - 1) * hop)
    end = 0.0 if head_done is None else head_done if flat else head_done + (replicas - 1) * hop
    return done, end


# --- ddp -------------------------------------------------------------------------------------------------------------

def ddp_buckets(model: ModelShapes, grad_bytes: int) -> list[tuple[int, str]]:
    """DistributedDataParallel's buckets: (bytes, the parameter whose gradient completes it)."""
    buckets, size, cap = [], 0, DDP_FIRST_BUCKET_BYTES
    for spec in reversed(model.specs):
        size += spec.numel * grad_bytes
        if size >= cap:
            buckets.append((size, spec.name))
            size, cap = 0, DDP_BUCKET_BYTES
    if size:
        buckets.append((size, model.specs[0].name))
    return buckets


def ddp_comm(model: ModelShapes, dp: int, work: Workload, fabric: Fabric, grad_bytes: int) -> dict:
    world = comm_of(dp, fabric.gpus_per_node)
    buckets = ddp_buckets(model, grad_bytes)
    ring = [best_cost("all_reduce", b, world, fabric, ("ring",)) for b, _ in buckets]
    tree = [best_cost("all_reduce", b, world, fabric, ("tree",)) for b, _ in buckets]
    picked = [min(r, t, key=lambda c: c.seconds) for r, t in zip(ring, tree)]
    ends = run_in_order([(work.ready[name], c.seconds) for (_, name), c in zip(buckets, picked)])
    return {"ring_s": sum(c.seconds for c in ring), "tree_s": sum(c.seconds for c in tree),
            "nccl_s": sum(c.seconds for c in picked), "exposed_s": max(0.0, ends[-1] - work.backward_s),
            "ops": len(buckets), "host_s": len(buckets) * fabric.host_s_per_op,
            "tree_buckets": sum(c.algorithm == "tree" for c in picked),
            "protocols": sorted({f"{c.algorithm}/{c.protocol}" for c in picked}),
            "bytes_per_element": 2 * grad_bytes}


# --- layerwise ----------------------------------------------------------------------------------------------------

def _occupied_positions(bucket: BucketPlan, layout: Layout) -> set[int]:
    """Positions whose shard of ``bucket`` holds at least one parameter element."""
    size, taken = bucket.shard_size, set()
    for name in bucket.params:
        slot = layout.params[name]
        first = (slot.offset - bucket.start) // size
        last = (slot.offset + slot.numel - 1 - bucket.start) // size
        taken.update(range(first, last + 1))
    return taken


def _cross_ops(bucket: BucketPlan, position: int, occupied: bool, replica_comm: Comm, fabric: Fabric, nbytes: int,
               gradient: bool, before: bool, issued: float) -> list[CrossOp]:
    """One bucket's operations across the owner groups at one position: the reduce (``gradient``) or the
    gather, as the design ``before`` or after the change runs them."""
    replicas = replica_comm.ranks
    rooted = "reduce" if gradient else "broadcast"
    chunks = bucket.chunks[position]
    if before:  # one rooted operation per replica in replica order, empty chunks included
        sizes = {k: (chunks[i + 1][1] if i + 1 < len(chunks) else bucket.shard_size) - offset
                 for i, (k, offset) in enumerate(chunks)}
        ops, last = [], -1
        for k in sorted(sizes) + [replicas]:
            if k - last > 1:
                ops.append(CrossOp(issued, rooted, k - 1, None, k - last - 1))
            if k < replicas:
                ops.append(CrossOp(issued, rooted, k, best_cost(rooted, sizes[k] * nbytes, replica_comm, fabric)))
            last = k
        return ops
    if not occupied:
        return []
    shard = bucket.shard_size * nbytes
    if len(chunks) == 1:  # one replica steps the whole shard
        return [CrossOp(issued, rooted, chunks[0][0], best_cost(rooted, shard, replica_comm, fabric))]
    ring = "reduce_scatter" if gradient else "all_gather"
    return [CrossOp(issued, "ring", 0, best_cost(ring, shard, replica_comm, fabric))]


class CrossStream(NamedTuple):
    """One position's operations across the owner groups in one step: the reduces (backward order) and, per
    bucket in forward order, its gathers."""

    grads: list[CrossOp]
    gathers: list[list[CrossOp]]

    @property
    def ops(self) -> int:
        return sum(op.host_ops for op in self.grads + [op for ops in self.gathers for op in ops])


def _cross_timeline(streams: Sequence[CrossStream], replicas: int, view: str, host_s: float) -> dict:
    """When the slowest position ends its reduces and its gathers, when each bucket's gather has reached every
    position (forward order), and the cross-node time with nothing else in the way (every operation issued
    at once; reduces and gathers are apart in the step)."""
    grads_end, gathers_end, alone, arrivals = 0.0, 0.0, 0.0, None
    for stream in streams:
        _, end = run_cross(stream.grads, replicas, view, host_s)
        gathers = [op for ops in stream.gathers for op in ops]
        done, gathered = run_cross(gathers, replicas, view, host_s)
        _, grads_alone = run_cross(stream.grads, replicas, view, host_s, at_once=True)
        here, k = [], 0
        for ops in stream.gathers:
            here.append(max((d for d in done[k:k + len(ops)] if d == d), default=0.0))  # d == d: not NaN
            k += len(ops)
        arrivals = here if arrivals is None else [max(x, y) for x, y in zip(arrivals, here)]
        grads_end, gathers_end = max(grads_end, end), max(gathers_end, gathered)
        alone = max(alone, grads_alone + gathered)
    return {"grads_end": grads_end, "gathers_end": gathers_end, "arrivals": arrivals, "cross_s": alone}


def layerwise_comm(model: ModelShapes, layout: Layout, g: int, dp: int, work: Workload, fabric: Fabric,
                   grad_bytes: int, param_bytes: int, group: Comm | None = None) -> dict:
    """In-group and cross-group communication of ``layout`` before and after the change (module docstring);
    ``group``: the owner group's communicator where its ranks do not fill nodes in order (one per node under
    tensor parallelism, ``benchmarks/project_tp.py``)."""
    replicas = dp // g
    if replicas > 1 and layout.replicas != replicas:
        layout = share_among_replicas(layout, model.routed_specs(), replicas)
    order = {s.name: i for i, s in enumerate(model.specs)}
    forward = sorted((b for buf in layout.buffers for b in buf.buckets if b.params),
                     key=lambda b: min(order[n] for n in b.params))  # Note [bucket order] in engine/data_parallel.py
    backward = forward[::-1]
    group = group or comm_of(g, fabric.gpus_per_node)
    replica_comm = Comm(replicas, replicas if g >= fabric.gpus_per_node else
                        max(1, -(-replicas // (fabric.gpus_per_node // g))))
    rs = [best_cost("reduce_scatter", b.numel * grad_bytes, group, fabric).seconds for b in backward]
    ag = [best_cost("all_gather", b.numel * param_bytes, group, fabric).seconds for b in forward]
    # Inside the group: each bucket's reduce-scatter dispatched in order once its gradients are ready; its
    # all-gather before the forward reaches its first parameter.
    dispatched, t = [], 0.0
    for b in backward:
        t = max(t, max(work.ready[n] for n in b.params))
        dispatched.append(t)
    rs_end = run_in_order(list(zip(dispatched, rs)))
    needed = [work.needed[min(b.params, key=order.__getitem__)] for b in forward]
    in_group_exposed = (max(0.0, rs_end[-1] - work.backward_s)
                        + forward_stall(needed, run_in_order([(0.0, s) for s in ag])))
    result = {"g": g, "replicas": replicas, "in_group_s": sum(rs) + sum(ag), "in_group_ops": 2 * len(forward),
              "in_group_exposed_s": in_group_exposed, "bytes_per_element": grad_bytes + param_bytes}
    occupied = {id(b): _occupied_positions(b, layout) for b in forward} if replicas > 1 else {}
    for design in ("before", "after"):
        before = design == "before"
        # After the change a bucket's cross-group reduce is issued behind its own reduce-scatter once the next
        # bucket is dispatched (the last at the end of the backward); before it, all after the backward.
        issued = [max(rs_end[i], work.backward_s if before or i + 1 == len(backward) else dispatched[i + 1])
                  for i in range(len(backward))]
        streams = []
        for p in range(g if replicas > 1 else 0):
            grads = [op for b, at in zip(backward, issued)
                     for op in _cross_ops(b, p, p in occupied[id(b)], replica_comm, fabric, grad_bytes, True, before,
                                          at)]
            gathers = [_cross_ops(b, p, p in occupied[id(b)], replica_comm, fabric, param_bytes, False, before, 0.0)
                       for b in forward]
            streams.append(CrossStream(grads, gathers))
        entry = {"cross_ops": max((s.ops for s in streams), default=0)}
        entry["ops"] = entry["cross_ops"] + result["in_group_ops"]
        entry["host_s"] = entry["ops"] * fabric.host_s_per_op
        for view in ("isolated", "stream"):
            exposed, cross = in_group_exposed, 0.0
            if streams:
                line = _cross_timeline(streams, replicas, view, fabric.host_s_per_op)
                backward_end = max(rs_end[-1], line["grads_end"])
                if before:  # every gather awaited before the forward starts, then the in-group all-gathers
                    start = line["gathers_end"]
                    stall = start + forward_stall(needed, run_in_order([(start, s) for s in ag]))
                else:
                    stall = forward_stall(needed, run_in_order(list(zip(line["arrivals"], ag))))
                exposed = max(0.0, backward_end - work.backward_s) + stall
                cross = line["cross_s"]
            entry[f"cross_s_{view}"] = cross
            entry[f"exposed_s_{view}"] = exposed
            entry[f"cross_exposed_s_{view}"] = max(0.0, exposed - in_group_exposed)
        result[design] = entry
    return result


# --- all-to-all (torchtitan-style Muon over FSDP) -------------------------------------------------------------------

_BLOCK = re.compile(r"\.(?:layers|h)\.(\d+)\.")


def all_to_all_comm(model: ModelShapes, dp: int, work: Workload, fabric: Fabric, grad_bytes: int,
                    param_bytes: int) -> dict:
    """FSDP over the whole world, one unit per transformer block (the rest in the root unit), with Muon's
    matrices moved whole to the rank that orthogonalizes them and back by two all-to-alls per block."""
    world = comm_of(dp, fabric.gpus_per_node)
    order = {s.name: i for i, s in enumerate(model.specs)}
    units: dict[int, list[ParamSpec]] = {}
    for spec in model.specs:
        m = _BLOCK.search(spec.name)
        units.setdefault(int(m.group(1)) if m else -1, []).append(spec)
    forward = sorted(units.values(), key=lambda specs: min(order[s.name] for s in specs))
    numel = [sum(s.numel for s in specs) for specs in forward]
    muon = [sum(s.numel for s in specs if model.uses_muon(s)) for specs in forward]
    rs = [best_cost("reduce_scatter", n * grad_bytes, world, fabric).seconds for n in numel]
    ag = [best_cost("all_gather", n * param_bytes, world, fabric).seconds for n in numel]
    a2a = [2 * all_to_all_seconds(m * grad_bytes // dp, world, fabric) for m in muon if m]
    ready = [max(work.ready[s.name] for s in specs) for specs in forward]
    needed = [work.needed[specs[0].name] for specs in forward]
    rs_end = run_in_order(list(zip(ready[::-1], rs[::-1])))
    exposed = (max(0.0, rs_end[-1] - work.backward_s) + forward_stall(needed, run_in_order([(0.0, t) for t in ag]))
               + sum(a2a))
    ops = 2 * len(forward) + 2 * len(a2a)
    return {"comm_s": sum(rs) + sum(ag) + sum(a2a), "all_to_all_s": sum(a2a), "exposed_s": exposed, "ops": ops,
            "host_s": ops * fabric.host_s_per_op, "units": len(forward),
            "bytes_per_element": grad_bytes + param_bytes + 2 * grad_bytes * sum(muon) / max(1, sum(numel)) / dp}


# --- optimizer step and memory -------------------------------------------------------------------------------------

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


def project_step(model: ModelShapes, layout: Layout, hw: Hardware, bucket_size: int, g: int,
                 seconds: Mapping[str, float]) -> dict:
    """Per-rank optimizer time and memory of the three configurations."""
    by_name = {s.name: s for s in model.specs}
    owned_s, owned_state = [0.0] * layout.ranks, [0.0] * layout.ranks
    for name, slot in layout.params.items():
        for piece in slot.pieces:  # AdamW parameters are split across ranks (element-wise fill)
            share = piece.numel / slot.numel
            owned_s[piece.owner] += seconds[name] * share
            owned_state[piece.owner] += state_bytes(model, by_name[name], muon=True) * share
    numel = model.numel
    per_element = hw.param_bytes + hw.grad_bytes
    return {
        "padding": layout.padding_fraction,
        "optimizer_s": {"layerwise_muon": max(owned_s), "ddp_muon": sum(seconds.values()),
                        "ddp_adamw": numel * ADAMW_BYTES_PER_ELEMENT / hw.hbm_bytes_per_s},
        "optimizer_s_mean_rank_layerwise": sum(owned_s) / layout.ranks,
        "optimizer_state_bytes": {
            "layerwise_muon": max(owned_state),
            "ddp_muon": sum(state_bytes(model, s, muon=True) for s in model.specs),
            "ddp_adamw": numel * ADAMW_STATE_BYTES,
        },
        "buffer_bytes": {"layerwise_muon": layout.total_numel * per_element,
                         "layerwise_sharded_muon": layout.total_numel / g * per_element
                         + SHARDED_WORKING_BUCKETS * bucket_size * per_element,
                         "ddp_muon": numel * per_element, "ddp_adamw": numel * per_element},
    }


def project(model: ModelShapes, dp: int, hw: Hardware, fabric: Fabric, bucket_size: int, tokens: int,
            mfu: float) -> dict:
    """One row: the layout ``LayerwiseStrategy`` plans at ``dp``, its optimizer step, memory and communication."""
    seconds = {s.name: update_seconds(model, s, hw) for s in model.specs}
    g, layout = choose_owner_group_size(model.routed_specs(), dp, bucket_size, cost=lambda s: seconds[s.name],
                                        ranks_per_node=hw.gpus_per_node, grad_bytes=hw.grad_bytes)
    work = workload(model, tokens, hw.peak_tflops, mfu)
    row = {"model": model.name, "dp": dp, "g": g, "replicas": dp // g,
           "backward_s": work.backward_s, "forward_s": work.forward_s}
    row.update(project_step(model, layout, hw, bucket_size, g, seconds))
    row["comm"] = {
        "ddp": ddp_comm(model, dp, work, fabric, hw.grad_bytes),
        "layerwise": layerwise_comm(model, layout, g, dp, work, fabric, hw.grad_bytes, hw.param_bytes),
        "all_to_all": all_to_all_comm(model, dp, work, fabric, hw.grad_bytes, hw.param_bytes),
    }
    return row


# --- output --------------------------------------------------------------------------------------------------------

STEP_TABLE_START, STEP_TABLE_END = "<!-- step-table:start -->", "<!-- step-table:end -->"
TITLE = "Projection to many GPUs (computed, not measured)"


def _ms(seconds: float) -> str:
    ms = 1e3 * seconds
    return f"{ms:.0f}" if ms >= 10 else f"{ms:.1f}"


def comm_table(rows: list[dict]) -> str:
    head = ["model", "dp", "g × R", "backward ms", "ddp ring ms", "ddp tree ms", "ddp NCCL ms", "ddp exposed ms",
            "ddp ops", "ours NVLink ms", "before: cross-node ms", "before ops", "before exposed ms",
            "after: cross-node ms (isolated / stream)", "after ops", "after exposed ms (isolated / stream)",
            "FSDP + all-to-all ms", "its ops", "its exposed ms"]
    body = []
    for r in rows:
        d, lw, a2a = r["comm"]["ddp"], r["comm"]["layerwise"], r["comm"]["all_to_all"]
        b, a = lw["before"], lw["after"]
        body.append([
            r["model"], r["dp"], f"{r['g']} × {r['replicas']}", _ms(r["backward_s"]), _ms(d["ring_s"]),
            _ms(d["tree_s"]), _ms(d["nccl_s"]), _ms(d["exposed_s"]), d["ops"], _ms(lw["in_group_s"]),
            _ms(b["cross_s_isolated"]), b["ops"], _ms(b["exposed_s_isolated"]),
            f"{_ms(a['cross_s_isolated'])} / {_ms(a['cross_s_stream'])}", a["ops"],
            f"{_ms(a['exposed_s_isolated'])} / {_ms(a['exposed_s_stream'])}",
            _ms(a2a["comm_s"]), a2a["ops"], _ms(a2a["exposed_s"]),
        ])
    return harness.markdown_table(head, body)


def step_table(rows: list[dict]) -> str:
    head = ["model", "dp", "g", "padding", "opt ms layerwise_muon", "opt ms ddp_muon", "opt ms ddp_adamw",
            "opt state GB layerwise_muon", "opt state GB ddp_muon", "opt state GB ddp_adamw", "buffers GB layerwise",
            "buffers GB layerwise sharded", "buffers GB ddp", "state+buffers GB ddp_adamw / layerwise / sharded"]
    body = []
    for r in rows:
        o, m, b = r["optimizer_s"], r["optimizer_state_bytes"], r["buffer_bytes"]
        cells = [r["model"], str(r["dp"]), str(r["g"]), f"{100 * r['padding']:.1f}%"]
        cells += [f"{1e3 * o[k]:.2f}" for k in CONFIGS]
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
    fig, axes = plt.subplots(len(models), 4, figsize=(21, 4.4 * len(models)), squeeze=False)
    colors = {"layerwise_muon": "C0", "ddp_muon": "C3", "ddp_adamw": "C2"}
    for i, name in enumerate(models):
        mine = [r for r in rows if r["model"] == name]
        dps = [r["dp"] for r in mine]
        for k in CONFIGS:
            axes[i][0].plot(dps, [1e3 * r["optimizer_s"][k] for r in mine], marker="o", color=colors[k], label=k)
            axes[i][3].plot(dps, [r["optimizer_state_bytes"][k] / 1e9 for r in mine], marker="o", color=colors[k],
                            label=k)
        ddp = [r["comm"]["ddp"] for r in mine]
        lw = [r["comm"]["layerwise"] for r in mine]
        a2a = [r["comm"]["all_to_all"] for r in mine]
        total = axes[i][1]

        def positive(values: list[float]) -> list[float]:  # nothing to draw on a log scale at 0
            return [1e3 * v if v > 0 else float("nan") for v in values]

        total.plot(dps, positive([d["ring_s"] for d in ddp]), marker="o", color="C2", ls=":",
                   label="ddp: ring all-reduce")
        total.plot(dps, positive([d["tree_s"] for d in ddp]), marker="o", color="C2", ls="--",
                   label="ddp: tree all-reduce")
        total.plot(dps, positive([d["nccl_s"] for d in ddp]), marker="o", color="C2", label="ddp: NCCL's pick")
        total.plot(dps, positive([x["before"]["cross_s_isolated"] for x in lw]), marker="o", color="C1",
                   label="layerwise before: cross-node")
        total.plot(dps, positive([x["after"]["cross_s_isolated"] for x in lw]), marker="o", color="C0",
                   label="layerwise after: cross-node (isolated)")
        total.plot(dps, positive([x["after"]["cross_s_stream"] for x in lw]), marker="o", color="C0", ls="--",
                   label="layerwise after: cross-node (stream)")
        total.plot(dps, positive([x["in_group_s"] for x in lw]), marker=".", color="0.5", ls=":",
                   label="layerwise: in-group, on NVLink alongside")
        total.plot(dps, positive([x["comm_s"] for x in a2a]), marker="o", color="C4", label="FSDP + all-to-all Muon")
        exposed = axes[i][2]
        exposed.plot(dps, [1e3 * d["exposed_s"] for d in ddp], marker="o", color="C2", label="ddp (NCCL's pick)")
        exposed.plot(dps, [1e3 * x["before"]["exposed_s_isolated"] for x in lw], marker="o", color="C1",
                     label="layerwise before")
        exposed.plot(dps, [1e3 * x["after"]["exposed_s_isolated"] for x in lw], marker="o", color="C0",
                     label="layerwise after (isolated)")
        exposed.plot(dps, [1e3 * x["after"]["exposed_s_stream"] for x in lw], marker="o", color="C0", ls="--",
                     label="layerwise after (stream)")
        exposed.plot(dps, [1e3 * x["exposed_s"] for x in a2a], marker="o", color="C4", label="FSDP + all-to-all Muon")
        axes[i][0].set(title=f"{name}: optimizer step (busiest rank)", ylabel="ms")
        total.set(title=f"{name}: communication per step (busiest link)", ylabel="ms")
        exposed.set(title=f"{name}: exposed communication (backward {1e3 * mine[0]['backward_s']:.0f} ms)",
                    ylabel="ms")
        axes[i][3].set(title=f"{name}: optimizer state per rank", ylabel="GB")
        for ax in axes[i]:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(dps, [str(d) for d in dps])
            ax.set_xlabel("dp (GPUs)")
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7)
    fig.suptitle("Projected from flop, byte and operation counts (not measured): H100 rates and NCCL's latency "
                 "model as in docs/benchmarks/projection.md")
    fig.tight_layout()
    harness.save_figure(fig, path, dpi=90)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["llama3-8b", "llama3-70b", "deepseek-v3"], choices=MODELS)
    p.add_argument("--dp", type=int, nargs="+", default=[8, 16, 64, 256, 1024])
    p.add_argument("--peak-tflops", type=float, default=H100_BF16_TFLOPS, help="bf16 dense matmul peak, TFLOP/s")
    p.add_argument("--efficiency", type=float, default=0.5, help="share of the peak Newton–Schulz achieves")
    p.add_argument("--mfu", type=float, default=MFU, help="share of the peak forward and backward achieve")
    p.add_argument("--tokens-per-gpu", type=int, default=TOKENS_PER_GPU, help="tokens per GPU per optimizer step")
    p.add_argument("--hbm-tbps", type=float, default=H100_HBM_TBPS, help="HBM bandwidth, TB/s")
    p.add_argument("--hbm-efficiency", type=float, default=0.8, help="share of HBM bandwidth element-wise kernels get")
    p.add_argument("--nvlink-gbps", type=float, default=NVLINK_GBPS, help="NVLink per GPU and direction, GB/s")
    p.add_argument("--nic-gbps", type=float, default=NIC_GBPS, help="one NIC per direction, GB/s")
    p.add_argument("--nics-per-node", type=int, default=NICS_PER_NODE)
    p.add_argument("--gpus-per-node", type=int, default=GPUS_PER_NODE)
    p.add_argument("--channels", type=int, default=NCCL_CHANNELS, help="NCCL channels (per-channel caps only)")
    p.add_argument("--host-us-per-op", type=float, default=HOST_SECONDS_PER_OP * 1e6,
                   help="host time to issue one NCCL operation, us")
    p.add_argument("--grad-bytes", type=int, default=4, help="bytes per gradient element reduced (fp32: 4)")
    p.add_argument("--param-bytes", type=int, default=2, help="bytes per parameter element gathered (bf16: 2)")
    p.add_argument("--ns-steps", type=int, default=5)
    p.add_argument("--bucket-size", type=int, default=DEFAULT_BUCKET_SIZE)
    p.add_argument("--tp", type=int, default=8, help="tensor-parallel size of the TP row (0: no TP row)")
    p.add_argument("--tp-dp", type=int, default=64, help="data-parallel size of the TP row (TP groups)")
    p.add_argument("--tp-model", default="llama3-70b", choices=MODELS, help="model of the TP row (a Llama)")
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/projection.json")
    p.add_argument("--markdown", type=Path, default=ROOT / "docs/benchmarks/projection.md")
    p.add_argument("--png", type=Path, default=ROOT / "docs/benchmarks/projection.png")
    p.add_argument("--no-write", action="store_true", help="print the tables only")
    args = p.parse_args(argv)
    for flag in ("peak_tflops", "efficiency", "mfu", "hbm_tbps", "hbm_efficiency", "nvlink_gbps", "nic_gbps"):
        if getattr(args, flag) <= 0:
            p.error(f"--{flag.replace('_', '-')}={getattr(args, flag)} must be positive")
    if args.tp and (args.tp < 2 or args.gpus_per_node % args.tp or args.tp_dp < 2
                    or args.tp * args.tp_dp % args.gpus_per_node):
        p.error(f"--tp {args.tp} --tp-dp {args.tp_dp}: pass a TP size > 1 dividing --gpus-per-node "
                f"({args.gpus_per_node}) and a data-parallel size > 1 filling whole nodes, or --tp 0")
    for flag in ("tokens_per_gpu", "nics_per_node", "gpus_per_node", "channels"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')}={getattr(args, flag)} must be >= 1")
    for dp in args.dp:
        if dp > args.gpus_per_node and dp % args.gpus_per_node:
            p.error(f"--dp {dp}: beyond one node, pass a multiple of --gpus-per-node ({args.gpus_per_node})")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    hw = Hardware(args.peak_tflops, args.efficiency, args.hbm_tbps, args.hbm_efficiency, args.gpus_per_node,
                  args.grad_bytes, args.param_bytes, args.ns_steps)
    fabric = Fabric(args.nvlink_gbps, args.nic_gbps, args.nics_per_node, args.gpus_per_node, args.channels,
                    args.host_us_per_op * 1e-6)
    rows = []
    for name in args.models:
        model = model_shapes(name)
        for dp in args.dp:
            rows.append(project(model, dp, hw, fabric, args.bucket_size, args.tokens_per_gpu, args.mfu))
            print(f"{name} dp={dp}", file=sys.stderr, flush=True)
    comm, step = comm_table(rows), step_table(rows)
    print(comm)
    print()
    print(step)
    tp_row, tp_text = None, None
    if args.tp:
        from benchmarks.project_tp import TP_TABLE_END, TP_TABLE_START, project_tp, tp_table

        tp_row = project_tp(model_shapes(args.tp_model), args.tp, args.tp_dp, hw, fabric, args.bucket_size,
                            args.tokens_per_gpu, args.mfu)
        tp_text = tp_table(tp_row)
        print()
        print(tp_text)
    if args.no_write:
        return
    harness.write_json(args.json, {
        "hardware": asdict(hw), "fabric": asdict(fabric), "bucket_size": args.bucket_size,
        "tokens_per_gpu": args.tokens_per_gpu, "mfu": args.mfu,
        "bytes_per_element": {"adamw_update": ADAMW_BYTES_PER_ELEMENT, "muon_update": MUON_BYTES_PER_ELEMENT,
                              "adamw_state": ADAMW_STATE_BYTES, "muon_state": MUON_STATE_BYTES},
        "rows": rows, **({"tensor_parallel": tp_row} if tp_row else {})})
    harness.write_between_markers(args.markdown, comm, title=TITLE)
    harness.write_between_markers(args.markdown, step, STEP_TABLE_START, STEP_TABLE_END, title=TITLE)
    if tp_text:
        harness.write_between_markers(args.markdown, tp_text, TP_TABLE_START, TP_TABLE_END, title=TITLE)
    plot(rows, args.png)
    print(f"wrote {args.json}, {args.markdown}, {args.png}", file=sys.stderr)


if __name__ == "__main__":
    main()
