"""The wrapper on 1-4 gloo ranks, each result compared with a single-process run of the same global batch."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _dist import LATE_MS, reference_threads, run_distributed
from lightning_layerwise import LayerwiseDataParallel, ProcessGroups
from lightning_layerwise import collectives

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4


class Net(nn.Module):
    """Awkward on purpose: tied weights, a layer used twice, a frozen and an unused layer, odd shapes."""

    def __init__(self, vocab: int = 23, d: int = 16, h: int = 33):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, h)
        self.frozen = nn.Linear(h, h)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(5, 7)
        self.proj = nn.Linear(h, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.fc1(self.emb(idx)).relu()
        h = self.fc2(self.fc2(h).tanh())  # used twice
        return self.head(self.proj(self.frozen(h).tanh()))


def make_model(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def batches(steps: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, 23, (GLOBAL_BATCH,), generator=g)
        yield idx, (idx * 7 + 3) % 23


def local(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return t.chunk(world)[rank]


def loss_fn(model, idx, target):
    return nn.functional.cross_entropy(model(idx), target)


def make_optimizer(name: str, params):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    raise ValueError(name)


@functools.cache
def reference_run(opt_name: str, steps: int) -> dict[str, torch.Tensor]:
    model = make_model()
    opt = make_optimizer(opt_name, model.parameters())
    with reference_threads():
        for idx, target in batches(steps):
            opt.zero_grad()
            loss_fn(model, idx, target).backward()
            opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()


# --- workers -------------------------------------------------------------------------------

U = 2.0 ** -24  # float32's unit roundoff


def rank_gradients(world: int, micro: int = 1) -> dict[str, list[torch.Tensor]]:
    """Each rank's float32 gradient of the first batch, computed here as that rank computes it.

    Rank ``r``'s rows, in ``micro`` micro-batches (each loss divided by ``micro``), each
    backward on a fresh model and the micro-batch gradients added in order, as the wrapper's
    buffer adds them: the same kernels on the same rows, so the same bits as on rank ``r``.
    """
    idx, target = next(batches(1))
    grads: dict[str, list[torch.Tensor]] = {}
    with reference_threads():
        for r in range(world):
            total: dict[str, torch.Tensor] = {}
            for x, y in zip(local(idx, r, world).chunk(micro), local(target, r, world).chunk(micro)):
                ref = make_model()
                (loss_fn(ref, x, y) / micro if micro > 1 else loss_fn(ref, x, y)).backward()
                for n, p in ref.named_parameters():
                    if p.grad is not None:
                        total[n] = total[n] + p.grad if n in total else p.grad.clone()
            for n, g in total.items():
                grads.setdefault(n, []).append(g)
    return grads


def mean_error_ratio(grad: torch.Tensor, per_rank: list[torch.Tensor]) -> float:
    """How far ``grad`` is from the mean of ``per_rank``, as a fraction of float32's bound for that mean.

    ``grad`` is the float32 sum of the ``w`` rank gradients in the reduction's order, divided
    by ``w``. A sum of ``w`` terms in any order is within ``(w - 1) U sum|g_r|`` of the exact
    sum and the division adds ``U |mean|``, so ``|grad - mean| <= w U mean|g_r|`` (to first
    order); ``(w + 1) U`` leaves room for the second-order terms. Ratio 0: bitwise the mean.
    """
    w = len(per_rank)
    exact = torch.stack([g.double() for g in per_rank]).mean(0)
    scale = torch.stack([g.double().abs() for g in per_rank]).mean(0)
    excess = (grad.double() - exact).abs() - (w + 1) * U * scale
    if (excess > 0).any():
        return 1.0 + excess.max().item()
    return ((grad.double() - exact).abs() / ((w + 1) * U * scale).clamp_min(1e-300)).max().item()


def _grads_worker(rank, world, bucket_size):
    model = make_model()
    per_rank = rank_gradients(world)
    ddp = LayerwiseDataParallel(model, bucket_size=bucket_size)
    idx, target = next(batches(1))
    loss_fn(ddp, local(idx, rank, world), local(target, rank, world)).backward()
    ddp.finish_grad_sync()
    owned, errors, none_ok = [], {}, True
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if ddp.owns(p):
            owned.append(name)
            if name not in per_rank:
                none_ok &= p.grad is None  # unused everywhere: no gradient, as in the reference
            elif world == 1:  # the very same backward: the same bits
                errors[name] = 0.0 if torch.equal(p.grad, per_rank[name][0]) else rel_err(p.grad, per_rank[name][0]) + 1
            else:
                errors[name] = mean_error_ratio(p.grad, per_rank[name])
        else:
            none_ok &= p.grad is None
    return owned, errors, none_ok


def _train_worker(rank, world, opt_name, steps, kwargs):
    # Different init per rank: the wrapper must broadcast rank 0's, which was seeded like the reference.
    model = make_model(seed=rank)
    ddp = LayerwiseDataParallel(model, **kwargs)
    opt = make_optimizer(opt_name, model.parameters())
    for idx, target in batches(steps):
        opt.zero_grad()
        loss_fn(ddp, local(idx, rank, world), local(target, rank, world)).backward()
        ddp.finish_grad_sync()
        opt.step()
        ddp.start_param_sync()
    ddp.finish_param_sync()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    padding_zero = all(_padding_is_zero(ddp, which) for which in ("params", "grads"))
    state_elems = sum(t.numel() for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())
    return params, padding_zero, state_elems


def _padding_is_zero(ddp: LayerwiseDataParallel, which: str) -> bool:
    for plan, flat in zip(ddp.layout.buffers, ddp.flat_buffers):
        mask = torch.ones(plan.numel, dtype=torch.bool)
        for bucket in plan.buckets:
            for name in bucket.params:
                slot = ddp.layout.params[name]
                mask[slot.offset:slot.end] = False
        tensor = getattr(flat, which)
        if which == "grads":  # only this rank's shards are meaningful after a reduce-scatter
            shard_mask = torch.zeros_like(mask)
            for bucket in plan.buckets:
                lo, hi = bucket.shard_range(ddp.dp_rank)
                shard_mask[lo:hi] = True
            mask &= shard_mask
        if tensor[mask].abs().sum().item() != 0:
            return False
    return True


# --- tests ---------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("bucket_size", [300, 10**6])
def test_owned_grads_equal_reference(world, bucket_size):
    results = run_distributed(_grads_worker, world, bucket_size)
    owned = [name for names, _, _ in results for name in names]
    trainable = [n for n, p in make_model().named_parameters() if p.requires_grad]
    assert sorted(owned) == sorted(trainable), "every trainable parameter has exactly one owner"
    for _, errors, none_ok in results:
        assert none_ok, "non-owned (and fully unused) parameters must have .grad None"
        for name, ratio in errors.items():  # world 1: bitwise; else within float32's bound (mean_error_ratio)
            assert ratio <= 1.0, (name, ratio)


@functools.cache
def train_run(world: int, opt_name: str, steps: int, late_ms: float | None = None) -> list:
    return run_distributed(_train_worker, world, opt_name, steps, {"bucket_size": 500, "prefetch_depth": 1},
                           late_ms=late_ms)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_training_equals_single_process(world, opt_name):
    steps = 10
    ref = reference_run(opt_name, steps)
    results = train_run(world, opt_name, steps)
    for params, padding_zero, _ in results:
        assert padding_zero
        for name, value in params.items():
            assert rel_err(value, ref[name]) <= 1e-5, (name, rel_err(value, ref[name]))
    # every rank holds the same parameters, bit for bit
    for params, _, _ in results[1:]:
        for name, value in params.items():
            assert torch.equal(value, results[0][0][name])


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_training_with_late_collectives_is_bitwise_the_plain_run(world, opt_name):
    """Note [late collectives] (collectives.py): every collective up to LATE_MS late, the same parameters.

    Mutation runs (LATE_MS=4; the line restored afterwards), relative error of emb.weight to one
    process, adamw 2 / 3 ranks, sgd 2 / 3 ranks: reduce-scatter not awaited before the step
    3.6e-2 / 4.5e-2, 1.3e-2 / 1.6e-2; all-gather not awaited in the forward pre-hook
    9.8e-3 / 1.2e-2, 5.5e-3 / 7.8e-3.
    """
    steps = 10
    ref = reference_run(opt_name, steps)
    late, plain = train_run(world, opt_name, steps, LATE_MS), train_run(world, opt_name, steps)
    for (params, padding_zero, _), (want, _, _) in zip(late, plain):
        assert padding_zero
        for name, value in params.items():
            assert rel_err(value, ref[name]) <= 1e-5, (name, rel_err(value, ref[name]))
            assert torch.equal(value, want[name]), (name, rel_err(value, want[name]))


@pytest.mark.parametrize("late_ms", [None, LATE_MS])
@pytest.mark.parametrize("kwargs", [
    {"overlap_grad_reduce": False, "overlap_param_gather": False, "bucket_size": 10**6},
    {"bucket_size": 200, "prefetch_depth": 3, "process_groups": "shared"},
])
def test_training_variants_equal_single_process(kwargs, late_ms):
    """``late_ms``: every collective up to that late (Note [late collectives] in collectives.py); with
    one group for both reduce-scatters and all-gathers, the two kinds share one queue.

    Mutation runs (LATE_MS=4), relative error of emb.weight, without overlap / shared group:
    reduce-scatter not awaited 3.2e-2 / 3.4e-2; all-gather not awaited in the pre-hook: passes
    without overlap (every all-gather is awaited before the forward), 8.8e-3 with the shared group.
    """
    world, steps = 3, 6
    ref = reference_run("adamw", steps)
    results = run_distributed(_variant_worker, world, steps, kwargs, late_ms=late_ms)
    for params, padding_zero, _ in results:
        assert padding_zero
        for name, value in params.items():
            assert rel_err(value, ref[name]) <= 1e-5, name


def _variant_worker(rank, world, steps, kwargs):
    kwargs = dict(kwargs)
    if kwargs.pop("process_groups", None) == "shared":
        kwargs["process_groups"] = ProcessGroups.create(separate_all_gather=False)
    return _train_worker(rank, world, "adamw", steps, kwargs)


def test_optimizer_state_is_sharded():
    world = 3
    ref_model = make_model()
    ref_opt = make_optimizer("adamw", ref_model.parameters())
    idx, target = next(batches(1))
    loss_fn(ref_model, idx, target).backward()
    ref_opt.step()
    ref_elems = sum(t.numel() for s in ref_opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())
    results = run_distributed(_train_worker, world, "adamw", 1, {"bucket_size": 500})
    per_rank = [elems for _, _, elems in results]
    assert sum(per_rank) == ref_elems
    assert max(per_rank) < ref_elems


def _accumulation_worker(rank, world, micro):
    model = make_model()
    ddp = LayerwiseDataParallel(model, bucket_size=400, trace=True)
    idx, target = next(batches(1))
    idx, target = local(idx, rank, world), local(target, rank, world)
    parts = list(zip(idx.chunk(micro), target.chunk(micro)))
    for i, (x, y) in enumerate(parts):
        ctx = ddp.no_sync() if i < micro - 1 else _null()
        with ctx:
            (loss_fn(ddp, x, y) / micro).backward()
        if i < micro - 1:
            assert not any(e == "rs_dispatch" for e, _ in ddp.events), "no_sync must skip communication"
    ddp.finish_grad_sync()
    n_reduces = sum(1 for e, _ in ddp.events if e == "rs_dispatch")
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    # The reference: every rank's micro-batches on one process, averaged over ranks.
    per_rank = rank_gradients(world, micro)
    errors = {n: mean_error_ratio(g, per_rank[n]) for n, g in grads.items()}
    return n_reduces, len(ddp.buckets), errors


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("world,late_ms", [(2, None), (3, None), (2, LATE_MS), (3, LATE_MS)])
def test_no_sync_accumulation_equals_one_large_batch(world, late_ms):
    """``late_ms``: every collective up to that late (Note [late collectives] in collectives.py).

    Mutation run under LATE_MS=4: reduce-scatter not awaited before the gradients are handed
    out: relative errors to one process 0.66-0.81 (2 ranks), 0.74-1.03 (3 ranks). The
    all-gather mutation cannot show here: one backward, no forward after a step.
    """
    for n_reduces, n_buckets, errors in run_distributed(_accumulation_worker, world, 2, late_ms=late_ms):
        assert n_reduces == n_buckets, "one reduce-scatter per bucket per optimizer step"
        assert errors and max(errors.values()) <= 1.0, errors  # within float32's bound (mean_error_ratio)


def _prefetch_worker(rank, world, depth):
    model = make_model()
    ddp = LayerwiseDataParallel(model, bucket_size=200, prefetch_depth=depth, trace=True)
    opt = make_optimizer("sgd", model.parameters())
    idx, target = next(batches(1))
    loss_fn(ddp, local(idx, rank, world), local(target, rank, world)).backward()
    ddp.finish_grad_sync()
    opt.step()
    ddp.events.clear()
    ddp.start_param_sync()
    loss_fn(ddp, local(idx, rank, world), local(target, rank, world))  # forward waits bucket by bucket
    forward_events = list(ddp.events)
    ddp.finish_param_sync()
    order = [b.name for b in ddp._gather_order]
    return forward_events, list(ddp.events), order


@pytest.mark.parametrize("depth", [1, 2])
def test_all_gathers_awaited_in_forward_order_with_bounded_prefetch(depth):
    for forward_events, all_events, order in run_distributed(_prefetch_worker, 2, depth):
        waits = [b for e, b in all_events if e == "ag_wait"]
        dispatches = [b for e, b in all_events if e == "ag_dispatch"]
        assert waits == order and dispatches == order, "bucket by bucket, in forward order"
        in_flight, peak = 0, 0
        for e, _ in all_events:
            in_flight += 1 if e == "ag_dispatch" else -1 if e == "ag_wait" else 0
            peak = max(peak, in_flight)
        assert peak == min(depth, len(order))
        # the forward itself waited (not a blocking sync before it): it saw waits interleaved with dispatches
        assert any(e == "ag_wait" for e, _ in forward_events)
        assert forward_events[0] == ("ag_dispatch", order[0]) or forward_events[0][0] == "ag_wait"


def _groups_worker(rank, world, separate):
    seen = {"rs": set(), "ag": set()}
    rs, ag = collectives._reduce_scatter_single, collectives._all_gather_single

    def rs_spy(out, inp, op=dist.ReduceOp.SUM, group=None, async_op=False):
        seen["rs"].add(id(group))
        return rs(out, inp, op=op, group=group, async_op=async_op)

    def ag_spy(out, inp, group=None, async_op=False):
        seen["ag"].add(id(group))
        return ag(out, inp, group=group, async_op=async_op)

    collectives._reduce_scatter_single, collectives._all_gather_single = rs_spy, ag_spy
    groups = ProcessGroups.create(separate_all_gather=separate)
    model = make_model()
    ddp = LayerwiseDataParallel(model, process_groups=groups, bucket_size=300)
    opt = make_optimizer("sgd", model.parameters())
    idx, target = next(batches(1))
    loss_fn(ddp, local(idx, rank, world), local(target, rank, world)).backward()
    ddp.finish_grad_sync()
    opt.step()
    ddp.start_param_sync(force_sync=True)
    return seen["rs"] == {id(groups.dp)}, seen["ag"] == {id(groups.dp_all_gather)}, seen["rs"] != seen["ag"]


@pytest.mark.parametrize("separate", [True, False])
def test_reduce_scatter_and_all_gather_groups(separate):
    for rs_ok, ag_ok, different in run_distributed(_groups_worker, 2, separate):
        assert rs_ok and ag_ok
        assert different == separate


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4, bias=False)
        self.b = nn.Linear(4, 1, bias=False)

    def forward(self, x):
        return self.b(self.a(x))


def _idle_rank_worker(rank, world):
    torch.manual_seed(0)
    model = Tiny()
    ddp = LayerwiseDataParallel(model, bucket_size=10**4)
    owned = [n for n, _ in ddp.named_owned_parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        x = torch.randn(GLOBAL_BATCH, 4, generator=g)
        opt.zero_grad()
        ddp(local(x, rank, world)).pow(2).mean().backward()
        ddp.finish_grad_sync()
        opt.step()
        ddp.start_param_sync()
    ddp.finish_param_sync()
    return owned, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_rank_that_owns_nothing():
    torch.manual_seed(0)
    ref = Tiny()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    with reference_threads():
        for _ in range(5):
            x = torch.randn(GLOBAL_BATCH, 4, generator=g)
            opt.zero_grad()
            ref(x).pow(2).mean().backward()
            opt.step()
    results = run_distributed(_idle_rank_worker, 4)
    assert sum(1 for owned, _ in results if not owned) >= 2, "two parameters, four ranks: two own nothing"
    for _, params in results:
        for n, p in ref.named_parameters():
            assert rel_err(params[n], p.detach()) <= 1e-5


def _buffers_worker(rank, world):
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(3, 6), nn.BatchNorm1d(6))
    model[1].running_mean.fill_(float(rank))
    ddp = LayerwiseDataParallel(model)
    after_wrap = model[1].running_mean.clone()
    weight = model[0].weight.detach().clone()
    seen_at_forward = []
    model[1].register_forward_pre_hook(lambda m, args: seen_at_forward.append(m.running_mean.clone()))
    ddp(torch.randn(4, 3) + rank)  # each rank's statistics drift with its own data...
    ddp(torch.randn(4, 3))  # ...and the next training forward starts from rank 0's again
    return after_wrap, weight, seen_at_forward


def test_buffers_and_parameters_broadcast_from_rank0():
    results = run_distributed(_buffers_worker, 3)
    for after_wrap, weight, seen in results:
        assert torch.equal(after_wrap, torch.zeros(6))
        assert torch.equal(weight, results[0][1])
        for step in range(2):
            assert torch.equal(seen[step], results[0][2][step])
    assert not torch.equal(results[0][2][0], results[0][2][1]), "statistics did move between forwards"


def _replaced_buffer_worker(rank, world):
    model = nn.Sequential(nn.Linear(3, 6), nn.BatchNorm1d(6))
    ddp = LayerwiseDataParallel(model)
    seen = []
    model[1].register_forward_pre_hook(lambda m, args: seen.append(m.running_mean.clone()))
    ddp(torch.randn(4, 3))
    model[1].running_mean = torch.full((6,), float(rank + 1))  # a new buffer object, after a forward
    ddp(torch.randn(4, 3))
    return seen[1]


def test_a_buffer_replaced_after_wrapping_is_broadcast_too():
    """The broadcast reads each module's buffers at every forward, not a list made at wrapping."""
    for seen in run_distributed(_replaced_buffer_worker, 2):
        assert torch.equal(seen, torch.ones(6))


class MixedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8).to(torch.bfloat16)

    def forward(self, x):
        return self.b(self.a(x).to(torch.bfloat16)).float().pow(2).mean()


def _mixed_dtype_worker(rank, world):
    torch.manual_seed(0)
    model, ref = MixedNet(), MixedNet()
    ref.load_state_dict(model.state_dict())
    ddp = LayerwiseDataParallel(model, grad_reduce_dtype=torch.float32)
    x = torch.randn(GLOBAL_BATCH, 8, generator=torch.Generator().manual_seed(5))
    ref(x).backward()
    ddp(local(x, rank, world)).backward()
    ddp.finish_grad_sync()
    errs = {}
    for (n, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        if p.grad is not None:
            assert p.grad.dtype == p.dtype and p.main_grad.dtype == torch.float32
            errs[n] = rel_err(p.main_grad, rp.grad.float())
    return len(ddp.layout.buffers), errs


def test_mixed_dtypes_get_separate_buffers():
    for n_buffers, errs in run_distributed(_mixed_dtype_worker, 2):
        assert n_buffers == 2
        for n, e in errs.items():
            # bf16 layer: the reference's gradient is rounded to bf16 once, ours per rank
            assert e <= (1e-2 if n.startswith("b.") else 1e-6), (n, e)


def _bad_module_worker(rank, world):
    model = nn.Linear(4, 4 + rank)
    try:
        LayerwiseDataParallel(model)
    except ValueError as e:
        return str(e)
    return None


def test_parameters_differing_across_ranks_rejected_before_training():
    for message in run_distributed(_bad_module_worker, 2):
        assert message is not None and "differ across ranks" in message and "same model" in message


def test_bad_arguments_rejected():
    with pytest.raises(ValueError, match="bucket_size=0"):
        LayerwiseDataParallel(nn.Linear(2, 2), process_groups=ProcessGroups.single(), bucket_size=0)
    with pytest.raises(ValueError, match="bucket_size=-1"):
        LayerwiseDataParallel(nn.Linear(2, 2), process_groups=ProcessGroups.single(), bucket_size=-1)
    with pytest.raises(ValueError, match="prefetch_depth=0"):
        LayerwiseDataParallel(nn.Linear(2, 2), process_groups=ProcessGroups.single(), prefetch_depth=0)
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        LayerwiseDataParallel(frozen, process_groups=ProcessGroups.single())
    with pytest.raises(ValueError, match="no trainable parameter"):
        LayerwiseDataParallel(nn.ReLU(), process_groups=ProcessGroups.single())


def test_backward_passes_accumulate_until_the_gradients_are_cleared():
    """Every backward adds to the gradients, as under ddp, until zero_grad (Note [gradient lifecycle]).

    One process, so the reduction is the identity and the wrapper must equal plain autograd exactly.
    """
    torch.manual_seed(0)
    model, ref = nn.Linear(3, 3), nn.Linear(3, 3)
    ref.load_state_dict(model.state_dict())
    ddp = LayerwiseDataParallel(model, process_groups=ProcessGroups.single())
    xs = [torch.randn(2, 3) for _ in range(3)]
    for x in xs[:2]:  # two reducing backward passes, no zero_grad in between
        ddp.prepare_backward()
        ddp(x).pow(2).sum().backward()
        ddp.finish_grad_sync()
        ref(x).pow(2).sum().backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, r.grad)
    model.zero_grad()  # cleared: the next backward starts from zero
    ref.zero_grad()
    out = ddp(xs[2]).sum()
    out.backward(retain_graph=True)  # a bare backward after clearing is fine
    ddp.finish_grad_sync()
    ref(xs[2]).sum().backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, r.grad)
    # A bare backward while the gradients are still held: autograd adds into the handed-out gradient
    # before the wrapper can set it aside, which is refused by name.
    with pytest.raises(RuntimeError, match="still held the gradient of the last sync.*prepare_backward"):
        out.backward()


def test_a_gradient_arriving_twice_in_one_backward_names_reentrant_checkpointing():
    """A weight used inside a reentrant checkpoint and outside it gets its gradient twice in one backward:
    the second arrives after its bucket was reduced, which is refused by name (non-reentrant is fine)."""
    from torch.utils.checkpoint import checkpoint

    class Twice(nn.Module):
        def __init__(self, reentrant):
            super().__init__()
            self.a, self.reentrant = nn.Linear(4, 4, bias=False), reentrant

        def forward(self, x):
            return self.a(checkpoint(self.a, x, use_reentrant=self.reentrant)).sum()

    x = torch.randn(2, 4, requires_grad=True)
    wrapper = LayerwiseDataParallel(Twice(reentrant=True), process_groups=ProcessGroups.single())
    with pytest.raises(RuntimeError, match=r"'a.weight'.*after its bucket was reduced.*use_reentrant=False"):
        wrapper(x).backward()
    torch.manual_seed(0)
    model, ref = Twice(reentrant=False), Twice(reentrant=False)
    ref.load_state_dict(model.state_dict())
    wrapper = LayerwiseDataParallel(model, process_groups=ProcessGroups.single())
    wrapper(x).backward()
    wrapper.finish_grad_sync()
    ref(x).backward()
    assert torch.equal(model.a.weight.grad, ref.a.weight.grad)


def test_a_sparse_gradient_is_refused_by_name():
    """nn.Embedding(sparse=True) is refused at wrapping; a functional sparse lookup when its gradient arrives."""
    with pytest.raises(ValueError, match=r"'0.weight' belongs to Embedding\(sparse=True\).*sparse=False"):
        LayerwiseDataParallel(nn.Sequential(nn.Embedding(5, 3, sparse=True)), process_groups=ProcessGroups.single())

    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Parameter(torch.randn(5, 3))

        def forward(self, idx):
            return nn.functional.embedding(idx, self.table, sparse=True).sum()

    wrapper = LayerwiseDataParallel(Functional(), process_groups=ProcessGroups.single())
    with pytest.raises(RuntimeError, match=r"'table' received a sparse gradient.*sparse=False"):
        wrapper(torch.tensor([1, 2])).backward()


# --- Note [in-place gradients] ----------------------------------------------------------------------------------


def _mlp_and_batches():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(1)
    return model, [torch.randn(4, 6, generator=g) for _ in range(3)]


def test_gradients_accumulate_in_place_in_the_bucket():
    """After a restart each parameter's .grad is its slot of the grad buffer, and autograd adds into it: no
    micro-batch leaves a gradient outside the buffer; the result equals plain accumulation exactly."""
    model, batches = _mlp_and_batches()
    plain = [p.detach().clone().requires_grad_() for p in model.parameters()]
    wrapper = LayerwiseDataParallel(model, process_groups=ProcessGroups.single())
    storages = {flat.grads.untyped_storage().data_ptr() for flat in wrapper._flat_buffers}
    wrapper.prepare_backward()
    wrapper.finish_grad_sync()  # a sync with no backward, so the next prepare restarts with the slots
    wrapper.prepare_backward()
    for p in model.parameters():  # autograd's first gradient already lands in the bucket
        assert p.grad is not None and p.grad.untyped_storage().data_ptr() in storages and not p.grad.any()
    with wrapper.no_sync():
        for x in batches[:2]:
            wrapper(x).square().mean().backward()
            for p in model.parameters():
                assert p.grad is not None and p.grad.untyped_storage().data_ptr() in storages
    wrapper(batches[2]).square().mean().backward()
    wrapper.finish_grad_sync()
    for x in batches:
        torch.func.functional_call(model, dict(zip([n for n, _ in model.named_parameters()], plain)), (x,)) \
            .square().mean().backward()
    for p, q in zip(model.parameters(), plain):
        assert torch.equal(p.grad, q.grad)
    wrapper.release()


def test_backward_with_create_graph_adds_each_gradient_once():
    """``backward(create_graph=True)`` sums out of place into a new .grad that already holds the slot's value:
    copied into the slot, not added again."""
    model, batches = _mlp_and_batches()
    want = [torch.zeros_like(p) for p in model.parameters()]
    reference = [p.detach().clone() for p in model.parameters()]
    wrapper = LayerwiseDataParallel(model, process_groups=ProcessGroups.single())
    wrapper.prepare_backward()
    wrapper.finish_grad_sync()
    wrapper.prepare_backward()
    with wrapper.no_sync():
        for x in batches[:2]:
            wrapper(x).square().mean().backward(create_graph=True)
    wrapper(batches[2]).square().mean().backward(create_graph=True)
    wrapper.finish_grad_sync()
    names = [n for n, _ in model.named_parameters()]
    for x in batches:
        params = [r.clone().requires_grad_() for r in reference]
        loss = torch.func.functional_call(model, dict(zip(names, params)), (x,)).square().mean()
        for w, g in zip(want, torch.autograd.grad(loss, params)):
            w += g
    for p, w in zip(model.parameters(), want):
        assert torch.allclose(p.grad, w, rtol=1e-6, atol=1e-7), (p.grad - w).abs().max()
    for p in model.parameters():
        p.grad = None  # create_graph leaves a reference cycle between a parameter and its gradient
    wrapper.release()
