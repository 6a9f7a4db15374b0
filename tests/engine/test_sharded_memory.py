"""What a rank holds with sharded parameters, counted in bytes of storage, at 4 gloo ranks.

At the end of a forward, during and at the end of its backward and after the optimizer step, every storage that
holds parameters, gradients, pieces or optimizer state on a rank is counted once (by storage, so views
of one buffer are not counted twice; a freed buffer counts zero). The bound, with ``P`` the parameter
bytes and ``G`` the gradient bytes of the whole model, ``g`` the ranks per owner group, ``S`` the rank's
optimizer state and ``B`` the largest bucket::

    held <= 1.05 (P + G) / g + S + working set

where the working set is at most ``prefetch_depth + 1`` full buckets of parameters, plus as many of
gradients during the backward, and nothing after the step. The optimizer state is counted as it is
(each rank's AdamW state of what it steps: the layout balances it within a few percent of ``1/g``,
which is checked too). A mutation that never frees a bucket after its use fails the bound.

A model built on the meta device is materialized at set-up with a peak of its shards and one bucket
(measured by the profiler's record of every allocation), its values rank 0's and equal to a plain build; built
under the recording of ``init_module(empty_init=True)``, also when it initializes itself nanoGPT's way
(``apply(_init_weights)``, then a re-init by name at the end), each parameter published as soon as it is final.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_layerwise as llw
from _dist import LATE_MS, reference_threads, run_distributed
from benchmarks.bench_backward_memory import _peak_during  # the CPU allocator's record, as measured there
from _init_styles import NanoGPT
from helpers import nothing_full, rel_err
from lightning_layerwise.engine import buffers, sharded
from lightning_layerwise.engine.buffers import BucketGradient, is_allocated
from lightning_layerwise.engine.grad_sync import GradientSync
from lightning_layerwise.engine.init_record import record_init, recordings_of
from lightning_layerwise.engine.init_replay import plan_replay
from lightning_layerwise.engine.sharded_init import ParameterPublisher

WORLD = 4
DEPTH = 2


class Stack(nn.Module):
    def __init__(self, width: int = 48, layers: int = 10):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(40, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.head = nn.Linear(width, 40)

    def forward(self, idx):
        h = self.emb(idx)
        for layer in self.layers:
            h = h + layer(h).tanh()
        return self.head(h)


def held_bytes(model: nn.Module, wrapper, optimizer) -> int:
    """Bytes of every distinct storage holding parameters, gradients, pieces, shards or optimizer state."""
    tensors = []
    with torch._C.DisableTorchFunctionSubclass():
        for p in model.parameters():
            tensors += [p, p.grad]
        for piece in wrapper.records.pieces.values():
            tensors += [piece, piece.grad]
        for b in wrapper.buckets:
            tensors += [b.param.data, b.grad.data, b.grad.taken, b.param.shard, b.grad.shard]
        for state in optimizer.state.values():
            tensors += [v for v in state.values() if torch.is_tensor(v)]
        storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                    for t in tensors if t is not None and not isinstance(t, llw.SplitGradient)}
    return sum(storages.values())


def optimizer_bytes(optimizer) -> int:
    return sum(v.untyped_storage().nbytes() for s in optimizer.state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim() > 0)


def _memory_worker(rank, world, mutation):
    if mutation == "never-free":
        sharded.ShardedParameterSync._free_outside = lambda self, keep, first, last: None
        sharded.ShardedParameterSync.grads_done = lambda self, bucket: None
    session = llw.LayerwiseSession(llw.LayerwiseConfig(shard_parameters=True, bucket_size=3000,
                                                       prefetch_depth=DEPTH))
    model = Stack()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    wrapped = session.wrap(model, optimizer)
    g = torch.Generator().manual_seed(rank)
    counts, during = [], []
    for layer in (model.layers[2], model.layers[6]):  # in the middle of the backward
        layer.weight.register_post_accumulate_grad_hook(
            lambda p: during.append(held_bytes(model, wrapped, optimizer)))
    for _ in range(3):
        idx = torch.randint(0, 40, (8, 4), generator=g)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(wrapped(idx).reshape(-1, 40), idx.reshape(-1))
        forward = held_bytes(model, wrapped, optimizer)
        session.backward(loss)
        backward = held_bytes(model, wrapped, optimizer)
        session.step(optimizer)
        step = held_bytes(model, wrapped, optimizer)
        counts.append((forward, max(during[-2:] + [backward]), step, optimizer_bytes(optimizer)))
    numel = sum(p.numel() for p in model.parameters())
    bucket = max(b.param.data.numel() for b in wrapped.buckets) * 4
    return counts, numel * 4, bucket, len(wrapped.buckets)


@pytest.mark.parametrize("mutation", [None, "never-free"])
def test_each_rank_holds_its_shard_and_a_bounded_working_set(mutation):
    results = run_distributed(_memory_worker, WORLD, mutation)
    over = []
    for rank, (counts, P, bucket, n_buckets) in enumerate(results):
        assert n_buckets >= 6, "several buckets, so the working set is a part of the model"
        for step, (forward, backward, after_step, state) in enumerate(counts):
            shards = 1.05 * 2 * P / WORLD
            limits = {"forward": shards + state + (DEPTH + 1) * bucket,
                      "backward": shards + state + 2 * (DEPTH + 1) * bucket,
                      "step": shards + state}
            for when, held in (("forward", forward), ("backward", backward), ("step", after_step)):
                if held > limits[when]:
                    over.append((rank, step, when, held, int(limits[when])))
        total_state = sum(c[-1][3] for c, *_ in results)
        assert counts[-1][3] <= 1.1 * total_state / WORLD, "the optimizer state is spread evenly"
    if mutation is None:
        assert not over, over
    else:
        assert over, "a wrapper that never frees a bucket stayed within the bound: the test cannot fail"


# --- a model built on the meta device (Note [meta-device models] in engine/materialize.py) -------------------------

def _setup_worker(rank, world, meta, shard=True):
    torch.manual_seed(rank)  # each rank's own random state: the values must still be rank 0's
    with torch.device("meta" if meta else "cpu"):
        model = Stack(width=96, layers=12)
    session = llw.LayerwiseSession(llw.LayerwiseConfig(shard_parameters=shard, bucket_size=12000))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    box = []
    peak, _ = _peak_during(lambda: box.append(session.wrap(model, optimizer)))
    wrapped = box[0]
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    in_optimizer = all(id(p) in stepped or id(wrapped.records.piece_of(p)) in stepped for p in model.parameters())
    with llw.full_parameters(model):
        values = {n: p.detach().clone() for n, p in model.named_parameters()}
    numel = sum(p.numel() for p in model.parameters())
    bucket, n_buckets = max(b.param.data.numel() for b in wrapped.buckets), len(wrapped.buckets)
    shard = sum(b.param.shard.numel() + b.grad.shard.numel() for b in wrapped.buckets if b.param.shard is not None)
    session.release()
    return peak, numel * 4, shard * 4, bucket * 4, n_buckets, values, in_optimizer


def test_a_meta_device_model_is_materialized_bucket_by_bucket():
    """Built under ``torch.device("meta")`` (what ``init_module(empty_init=True)`` does with sharded parameters),
    a 12-layer stack is materialized at 4 ranks with a set-up peak (every allocation recorded by the profiler) of
    at most the rank's shards (parameters and gradients) and one bucket: each module's parameters are initialized
    in memory of their own and published into the shards once final (Note [publishing parameters one by one] in
    engine/sharded_init.py). Built on the CPU, it is sharded within the same bound beyond the model as
    built (buckets filled, broadcast and cut one at a time); without sharding the wrapper's full buffers take
    several times that. Values: rank 0's, equal to building the model on the CPU with rank 0's seed; the
    optimizer holds the parameters that replaced the meta ones."""
    meta = run_distributed(_setup_worker, WORLD, True)
    device = run_distributed(_setup_worker, WORLD, False)
    unsharded = run_distributed(_setup_worker, WORLD, False, False)
    torch.manual_seed(0)
    plain = {n: p.detach() for n, p in Stack(width=96, layers=12).named_parameters()}
    for rank, (peak, P, shard, bucket, n_buckets, values, in_optimizer) in enumerate(meta):
        assert n_buckets >= 6 and shard <= 1.05 * 2 * P / WORLD
        bound = shard + bucket + 1024  # + the allocator's rounding and a few small tensors of the set-up
        assert peak <= bound, f"rank {rank}: set-up peak {peak} B above the shard {shard} B + one bucket {bucket} B"
        assert device[rank][0] <= bound, f"rank {rank}: built on the CPU, set-up peak {device[rank][0]} B"
        assert unsharded[rank][0] > 2 * bound, "the unsharded wrapper's full buffers peak far higher: it can fail"
        assert in_optimizer
        for name, value in values.items():
            assert torch.equal(value, plain[name]), (rank, name)


def in_flight_bound(model: nn.Module) -> int:
    """The most parameter bytes whose values have started but are not final at once, by the replay's plan: from
    the first op that writes a lasting value to the last op that touches it (Note [meta-device models])."""
    ops = [op for r in recordings_of(model) for op in r.ops]
    sizes = {p.untyped_storage()._cdata: p.numel() * 4 for p in model.parameters()}
    plan = plan_replay(ops, set(sizes), torch.device("cpu"))
    first = {}
    for i, op in enumerate(ops):
        if plan.live[i] and not op.uninitialized:
            for key in op.writes & sizes.keys():
                first.setdefault(key, i)
    return max(sum(size for key, size in sizes.items() if first[key] <= i <= plan.last[key]) for i in range(len(ops)))


def _recorded_setup_worker(rank, world, name, mutation):
    if mutation == "keep-values":  # a publisher that keeps every parameter's own memory
        kept, final = [], ParameterPublisher.final
        ParameterPublisher.final = lambda self, old, new: (kept.append(new.detach().clone()), final(self, old, new))
    build = (lambda: Stack(width=96, layers=12)) if name == "stack" else (lambda: NanoGPT(n_layer=4, n_embd=32))
    torch.manual_seed(rank)  # each rank's own random state: the values must still be rank 0's
    with torch.device("meta"), record_init("cpu"):
        model = build()
    with torch.device("meta"), record_init("cpu"):  # the same build again, for its plan
        in_flight = in_flight_bound(build())
    session = llw.LayerwiseSession(llw.LayerwiseConfig(shard_parameters=True,
                                                       bucket_size=12000 if name == "stack" else 6000))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    box = []
    peak, _ = _peak_during(lambda: box.append(session.wrap(model, optimizer)))
    wrapped = box[0]
    with llw.full_parameters(model):
        values = {n: p.detach().clone() for n, p in model.state_dict().items()}
    bucket = max(b.param.data.numel() for b in wrapped.buckets) * 4
    shard = sum(b.param.shard.numel() + b.grad.shard.numel() for b in wrapped.buckets if b.param.shard is not None)
    largest = max(p.numel() for p in model.parameters()) * 4
    session.release()
    return peak, shard * 4, bucket, in_flight, largest, values


@pytest.mark.parametrize("name, mutation", [("stack", None), ("nanogpt", None), ("nanogpt", "keep-values")])
def test_a_recorded_build_is_published_parameter_by_parameter(name, mutation):
    """Built under the recording of ``init_module(empty_init=True)`` (Note [publishing parameters one by one] in
    engine/sharded_init.py): the set-up peak is at most the rank's shards, the larger of one bucket and the
    parameters in flight (plus one), one scratch tensor (an overwritten init's draws) and the generator's saved
    state. Here that is the shards and one bucket: the stack initializes each layer in its constructor;
    nanoGPT's ``apply(_init_weights)`` and its re-init by name at the end leave no bucket waiting, full, for a
    weight re-initialized at the end. Values: rank 0's, equal to an eager build with rank 0's seed, bitwise. A
    publisher that keeps every value fails the bound."""
    torch.manual_seed(0)
    want = (Stack(width=96, layers=12) if name == "stack" else NanoGPT(n_layer=4, n_embd=32)).state_dict()
    over = []
    for rank, (peak, shard, bucket, in_flight, largest, values) in enumerate(
            run_distributed(_recorded_setup_worker, WORLD, name, mutation)):
        assert all(torch.equal(values[k], want[k]) for k in want), rank
        state = torch.get_rng_state().numel()  # the generator's state, saved while the replay moves it (5 KiB)
        bound = shard + max(bucket, in_flight + largest) + largest + state + 1024
        print(f"{name} rank {rank}: set-up peak {peak} B; shards {shard} B, one bucket {bucket} B, in flight "
              f"{in_flight} B, largest parameter {largest} B")
        if peak > bound or peak > shard + bucket + state + 1024:
            over.append((rank, peak, bound, shard + bucket + state + 1024))
    if mutation is None:
        assert not over, over
    else:
        assert over, "a publisher that keeps every value stayed within the bound: the test cannot fail"


# --- which buckets are full during a forward (Note [when a bucket is full] in engine/sharded.py) -------------------

def _window_worker(rank, world, model_name, depth, mutation):
    if mutation == "never-free":
        sharded.ShardedParameterSync._free_outside = lambda self, keep, first, last: None
    if model_name == "gpt":
        from gpt import GPT, GPTConfig  # examples/gpt.py: output layer tied to the embedding, nn.MultiheadAttention

        model = GPT(GPTConfig(vocab_size=40, block_size=8, n_layer=4, n_head=2, n_embd=32))
    else:
        model = Stack()
    session = llw.LayerwiseSession(llw.LayerwiseConfig(shard_parameters=True, bucket_size=3000, prefetch_depth=depth))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    wrapped = session.wrap(model, optimizer)
    order = wrapped.param_sync.gather_order
    index = {id(b): i for i, b in enumerate(order)}
    bucket_of = {id(p): b for b in order for p in b.params}
    # The modules holding parameters directly, in registration order (what the wrapper hooks), and their buckets.
    holders = [(m, sorted({index[id(bucket_of[id(p)])] for p in m.parameters(recurse=False)}))
               for m in model.modules() if any(id(p) in bucket_of for p in m.parameters(recurse=False))]
    first = {i: min(k for k, (_, own) in enumerate(holders) if i in own) for i in range(len(order))}
    last = {i: max(k for k, (_, own) in enumerate(holders) if i in own) for i in range(len(order))}
    seen = []
    for position, (module, own) in enumerate(holders):
        # What may be full while this module runs: its own buckets, the next `depth` in forward order, and those
        # an earlier module used that a later one holds too (an embedding paired with, or tied to, the output).
        window = set(own) | set(range(own[-1] + 1, own[-1] + 1 + depth))
        spanning = {i for i in range(len(order)) if first[i] < position < last[i]}

        def check(_module, _args, position=position, allowed=window | spanning, spanning=spanning):
            full = {i for i, b in enumerate(order) if is_allocated(b.param.data)}
            seen.append((position, sorted(full), sorted(allowed), len(spanning)))
        module.register_forward_pre_hook(check)  # after the wrapper's own pre-hook
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        seen.clear()
        idx = torch.randint(0, 40, (4, 8), generator=g)
        logits = wrapped(idx)
        logits = logits[0] if isinstance(logits, tuple) else logits
        session.backward(nn.functional.cross_entropy(logits.reshape(-1, 40), idx.reshape(-1)))
        session.step(optimizer)
        optimizer.zero_grad()
    return seen, len(order)


@pytest.mark.parametrize("model_name, depth, mutation", [
    ("stack", 1, None), ("stack", 2, None), ("gpt", 1, None), ("gpt", 2, None), ("gpt", 1, "never-free")])
def test_a_forward_holds_its_window_and_the_buckets_a_later_module_holds(model_name, depth, mutation):
    """At every module's forward pre-hook the full buckets are the module's own, the next ``prefetch_depth`` in
    forward order, and those a module already run shares with one still to run: with one bucket per module and no
    such sharing (the stack) at most ``prefetch_depth + 1``; the example GPT's tied output layer keeps the
    embedding's bucket full through the forward. A wrapper that never frees fails."""
    over = []
    for rank, (seen, n_buckets) in enumerate(run_distributed(_window_worker, WORLD, model_name, depth, mutation)):
        assert n_buckets >= 6 and len(seen) >= 10
        for position, full, allowed, n_spanning in seen:
            if not set(full) <= set(allowed):
                over.append((rank, position, full, allowed))
            if model_name == "stack":
                assert n_spanning == 0
                if len(full) > depth + 1:
                    over.append((rank, position, full, f"more than prefetch_depth + 1 = {depth + 1}"))
        if model_name == "gpt":
            assert any(n for *_, n in seen), "the tied embedding's bucket is shared with the last module"
    if mutation is None:
        assert not over, over[:4]
    else:
        assert over, "a wrapper that never frees kept within the window: the test cannot fail"


# --- the end of a run (Note [sharded release] in engine/sharded.py) ------------------------------------------------

def _release_worker(rank, world, mutation):
    if mutation == "free-at-the-end":
        def gather_each(self, use):
            for bucket in self.gather_order:
                self.ensure_gathered(bucket)
            for bucket in self.gather_order:
                use(bucket)
            for bucket in self.gather_order:
                bucket.param.reshard()
        sharded.ShardedParameterSync.gather_each = gather_each
    session = llw.LayerwiseSession(llw.LayerwiseConfig(shard_parameters=True, bucket_size=3000))
    model = Stack()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    wrapped = session.wrap(model, optimizer)
    idx = torch.randint(0, 40, (8, 4), generator=torch.Generator().manual_seed(rank))
    session.backward(nn.functional.cross_entropy(wrapped(idx).reshape(-1, 40), idx.reshape(-1)))
    session.step(optimizer)
    with llw.full_parameters(model):
        want = {n: p.detach().clone() for n, p in model.named_parameters()}
    bucket = max(b.param.data.numel() for b in wrapped.buckets) * 4
    peak, _ = _peak_during(session.release)
    got = {n: p.detach().clone() for n, p in model.named_parameters()}
    P = sum(p.numel() for p in model.parameters()) * 4
    return peak, P, bucket, all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.parametrize("mutation", [None, "free-at-the-end"])
def test_a_released_module_is_gathered_one_bucket_at_a_time(mutation):
    """After a run the module holds every parameter in its own storage; getting there takes at most the model's
    parameters plus two buckets (the one being copied out and the next one's all-gather) above what the rank
    held, not the model twice (every bucket gathered and copied, then the buckets freed)."""
    for rank, (peak, P, bucket, equal) in enumerate(run_distributed(_release_worker, WORLD, mutation)):
        assert equal, f"rank {rank}: the released parameters are not the trained ones"
        within = peak <= P + 2 * bucket + 1024
        assert within if mutation is None else not within, (rank, peak, P, bucket)


# --- at default settings: bytes held at every module's pre-hook and after the step ---------------------------------

class WideStack(nn.Module):
    """24 layers of 1024 x 1024 (25 M parameters): six buckets at the default sharded bucket size."""

    def __init__(self, layers: int = 24, width: int = 1024):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x).tanh()
        return x


def _default_bytes_worker(rank, world, mutation):
    if mutation == "never-free":
        sharded.ShardedParameterSync._free_outside = lambda self, keep, first, last: None
    if mutation == "keep-gradient-shards":
        BucketGradient.drop_shard = lambda self: None
    options = {"bucket_size": llw.layout.DEFAULT_BUCKET_SIZE} if mutation == "unsharded-bucket-size" else {}
    session = llw.LayerwiseSession(llw.LayerwiseConfig(shard_parameters=True, **options))  # defaults otherwise
    model = WideStack()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    wrapped = session.wrap(model, optimizer)
    order = wrapped.param_sync.gather_order
    depth = wrapped.param_sync.prefetch_depth
    index = {id(b): i for i, b in enumerate(order)}
    bucket_of = {id(p): b for b in order for p in b.params}
    nbytes = [b.param.data.numel() * b.param.data.element_size() for b in order]
    holders = [(m, sorted({index[id(bucket_of[id(p)])] for p in m.parameters(recurse=False)}))
               for m in model.modules() if any(id(p) in bucket_of for p in m.parameters(recurse=False))]
    seen = []
    for position, (module, own) in enumerate(holders):
        # The running module's buckets and the prefetched ones after them.
        window = set(own) | set(range(own[-1] + 1, min(own[-1] + 1 + depth, len(order))))

        def check(_module, _args, position=position, window=window):
            full = [i for i, b in enumerate(order) if is_allocated(b.param.data)]
            outside = [i for i in full if i not in window]
            seen.append((position, sum(nbytes[i] for i in full), sum(nbytes[i] for i in window), outside))
        module.register_forward_pre_hook(check)  # after the wrapper's own pre-hook
    shards_held = []  # gradient shards allocated when the middle layer's gradient arrives (Note [sharded gradients])
    model.layers[12].weight.register_post_accumulate_grad_hook(lambda p: shards_held.append(
        sum(is_allocated(b.grad.shard) for b in order)))
    g = torch.Generator().manual_seed(rank)
    after_step = []
    for _ in range(2):
        x = torch.randn(4, 1024, generator=g)
        optimizer.zero_grad()
        session.backward(wrapped(x).square().mean())
        session.step(optimizer)
        after_step.append((sum(nbytes[i] for i, b in enumerate(order) if is_allocated(b.param.data)),
                           held_bytes(model, wrapped, optimizer), optimizer_bytes(optimizer)))
    P = sum(p.numel() for p in model.parameters()) * 4
    largest = max(p.numel() for p in model.parameters()) * 4
    return seen, after_step, P, largest, len(order), depth, shards_held


@pytest.mark.parametrize("mutation", [None, "never-free", "unsharded-bucket-size", "keep-gradient-shards"])
def test_default_settings_hold_the_running_module_and_the_prefetch(mutation):
    """``shard_parameters=True`` and nothing else: at every module's forward pre-hook the bytes of full buckets are
    those of the running module's buckets and the prefetched one, each of about ``SHARDED_BUCKET_SIZE`` elements
    (one parameter more at most), and after the step a rank holds its shards and its optimizer state only. Half way
    through a backward after ``zero_grad`` only the gradient shards of the buckets reduced so far exist. A wrapper
    that never frees, the unsharded default bucket size (one bucket holding the model), or gradient shards kept
    across ``zero_grad`` fail."""
    over = []
    for rank, (seen, after_step, P, largest, n_buckets, depth, shards_held) in enumerate(
            run_distributed(_default_bytes_worker, WORLD, mutation)):
        assert depth == 1 and len(seen) == 2 * 24
        if shards_held[-1] > n_buckets // 2 + 1:  # the second backward: dropped at its start, half reduced so far
            over.append((rank, "mid-backward", f"{shards_held[-1]} of {n_buckets} gradient shards held"))
        bound = (depth + 1) * (llw.layout.SHARDED_BUCKET_SIZE * 4 + largest)
        for position, full, window, outside in seen:
            if outside or full > window:
                over.append((rank, position, "outside the window", outside))
            if full > bound:
                over.append((rank, position, f"{full} B full, more than {bound} B of the model's {P} B"))
        for full, held, state in after_step:
            if full or held > 1.05 * 2 * P / WORLD + state:
                over.append((rank, "after the step", full, held))
    if mutation is None:
        assert n_buckets >= 6, "the default sharded bucket size splits this model"
        assert not over, over[:4]
    else:
        assert over, f"{mutation}: stayed within the bound: the test cannot fail"


# --- a bucket that is one parameter (Note [sharded gradients] in engine/grad_sync.py) ---------------------------------

def _taken_model() -> nn.Module:
    torch.manual_seed(0)  # with 4096-element buckets: bias-free matrices in buckets of their own, and one that holds three
    return nn.Sequential(nn.Linear(16, 64, bias=False), nn.Tanh(), nn.Linear(64, 64, bias=False), nn.Tanh(),
                         nn.Linear(64, 64, bias=False), nn.Tanh(), nn.Linear(64, 10))


def _taken_batches():
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(3)]


# per step: micro-batches, and whether the earlier ones accumulate inside no_sync (their sums stay in the buffer)
TAKEN_STEPS = [(1, False), (2, False), (2, True)]


def _taken_reference() -> dict[str, torch.Tensor]:
    model = _taken_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with reference_threads():
        for (x, y), (micro, _) in zip(_taken_batches(), TAKEN_STEPS):
            optimizer.zero_grad()
            for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
                (nn.functional.cross_entropy(model(xs), ys) / micro).backward()
            optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _taken_worker(rank, world, mutation):
    if mutation == "copy":
        BucketGradient.take = lambda self, grad: False
    allocated = []  # storages of full gradient buffers allocated, by step
    real_allocate = buffers.allocate
    buffers.allocate = lambda t: (allocated[-1].add(t.untyped_storage()._cdata), real_allocate(t))
    session = llw.LayerwiseSession(llw.LayerwiseConfig(shard_parameters=True, bucket_size=4096))
    model = _taken_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    wrapped = session.wrap(model, optimizer)
    single = [b for b in wrapped.buckets if len(b.params) == 1 and b.params[0].numel() == b.grad.data.numel()]
    shapes = [[tuple(p.shape) for p in b.params] for b in wrapped.buckets]
    emptied = True
    for (x, y), (micro, quiet) in zip(_taken_batches(), TAKEN_STEPS):
        allocated.append(set())
        optimizer.zero_grad()
        xs, ys = x.chunk(world)[rank].chunk(micro), y.chunk(world)[rank].chunk(micro)
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            with wrapped.no_sync() if quiet and i < micro - 1 else torch.enable_grad():
                session.backward(nn.functional.cross_entropy(wrapped(xm), ym) / micro)
            emptied &= (quiet and i < micro - 1) or nothing_full(wrapped)
        session.step(optimizer)
    session.sync_parameters()
    buffers.allocate = real_allocate
    with llw.full_parameters(model):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    session.release()
    own = [[any(b.grad.data.untyped_storage()._cdata in step for b in single)] for step in allocated]
    return params, len(single), shapes, [o[0] for o in own], emptied


@pytest.mark.parametrize("late", [None, LATE_MS], ids=["now", "late"])
@pytest.mark.parametrize("mutation", [None, "copy"])
def test_a_bucket_that_is_one_parameter_reduces_autograds_gradient_in_place(mutation, late):
    """A bucket that is exactly one parameter allocates no full gradient buffer in a reducing backward: autograd's
    gradient is reduced in place, also when micro-batches each reduce; after micro-batches accumulated inside
    ``no_sync`` the local sums in the buffer are used. Values equal one process (AdamW, 2 ranks, fp32), also with
    collectives late. A wrapper that copies every gradient into an allocated buffer fails."""
    expected = _taken_reference()
    for rank, (params, n_single, shapes, own_buffer, emptied) in enumerate(
            run_distributed(_taken_worker, 2, mutation, late_ms=late)):
        assert n_single >= 2 and any(len(params) > 1 for params in shapes), shapes  # both paths run
        assert emptied, f"rank {rank}: a full gradient buffer or a taken gradient outlived its backward"
        for n, ref in expected.items():
            assert rel_err(params[n], ref) <= 1e-5, (rank, n, rel_err(params[n], ref))
        assert own_buffer[2], "the no_sync step accumulates its local sums in the bucket's own buffer"
        if mutation is None:
            assert own_buffer[:2] == [False, False], f"rank {rank}: a reducing backward allocated a full buffer"
        else:
            assert own_buffer[:2] == [True, True], "the copy path went unnoticed: the test cannot fail"


def _full_grads_worker(rank, world, mutation):
    if mutation == "fold-at-dispatch":  # a new buffer no longer waits for the reduce-scatter in flight
        dispatch, fold_beyond = GradientSync._dispatch_reduce, GradientSync._fold_beyond

        def dispatching(self, bucket):
            self.dispatching = True
            dispatch(self, bucket)
            self.dispatching = False
        GradientSync._dispatch_reduce = dispatching
        GradientSync._fold_beyond = lambda self, limit: fold_beyond(self, limit) if self.dispatching else None
        GradientSync.dispatching = False
    session = llw.LayerwiseSession(llw.LayerwiseConfig(shard_parameters=True))  # defaults: prefetch_depth 1
    model = WideStack()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    wrapped = session.wrap(model, optimizer)
    held = []
    for p in model.parameters():  # after the wrapper's own hook, which took the gradient or added it in
        p.register_post_accumulate_grad_hook(lambda p: held.append(sum(b.grad.full_held for b in wrapped.buckets)))
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        optimizer.zero_grad()
        session.backward(wrapped(torch.randn(4, 1024, generator=g)).square().mean())
        session.step(optimizer)
    return max(held), wrapped.param_sync.prefetch_depth, len(wrapped.buckets)


@pytest.mark.parametrize("mutation", [None, "fold-at-dispatch"])
def test_a_backward_holds_at_most_prefetch_depth_full_gradient_buffers(mutation):
    """At default settings, at every gradient's arrival, at most ``prefetch_depth`` full gradient buffers exist,
    the one filling included: a bucket's buffer is allocated only after the oldest reduce-scatter in flight was
    folded in. A wrapper that limits only what is in flight at dispatch holds one more."""
    results = run_distributed(_full_grads_worker, WORLD, mutation)
    most = max(r[0] for r in results)
    depth, n_buckets = results[0][1], results[0][2]
    assert depth == 1 and n_buckets >= 6
    if mutation is None:
        assert most <= depth, f"{most} full gradient buffers held at once"
    else:
        assert most > depth, "the old limit held no more: the test cannot fail"
