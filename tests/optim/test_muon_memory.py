"""Muon's ``ns_batch_bytes``: Newton-Schulz stacks stay under a byte budget, with bitwise the same result.

Single process, CPU. Three checks:

- chunked and unchunked (``ns_batch_bytes=None``) Muon give bitwise equal parameters
  and momentum buffers over several steps, many same-shaped matrices, bf16 and fp32,
  one and two threads;
- every stack handed to ``newton_schulz`` holds at most ``ns_batch_bytes`` bytes
  (recorded by wrapping the function);
- the peak of the memory a step allocates, measured with ``torch.profiler``
  (``profile_memory=True``, CPU allocation records), follows the budget and not the
  number of matrices.

``python tests/optim/test_muon_memory.py`` measures the realistic case quoted in
docs/muon.md (64 fp32 matrices of 1024x1024, budget 64 MiB against none), on CPU,
and also on CUDA when a GPU is present.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_layerwise.optim.orthogonalization as ns_module
from lightning_layerwise.optim import Muon, mark_matrices, newton_schulz, orthogonalize
from lightning_layerwise.optim.muon import DEFAULT_NS_BATCH_BYTES

MiB = 2**20


@pytest.fixture(autouse=True)
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def make_params(seed: int = 0) -> list[nn.Parameter]:
    """Many same-shaped matrices (wide, tall, conv kernels, a stack of six 64x48 matrices in a group of its own,
    cut into two stacks) and one shape that occurs once."""
    g = torch.Generator().manual_seed(seed)
    shapes = ([(64, 48)] * 21 + [(6, 64, 48)] + [(48, 160)] * 6 + [(8, 4, 3, 3)] * 6  # 6x64x48: a stack
              + [(384, 96)] * 5 + [(20, 30)])  # 384x96: tall, >32k
    params = [nn.Parameter(torch.randn(s, generator=g) / s[-1] ** 0.5) for s in shapes]
    for p in params:
        if p.ndim == 4:
            mark_matrices(p, stack=False)  # a kernel: one (8, 36) matrix
        elif p.ndim == 3:
            mark_matrices(p, stack=True)
    return params


def set_grads(params: list[nn.Parameter], step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def run(params: list[nn.Parameter], steps: int, **kwargs) -> Muon:
    opt = Muon(params, lr=0.02, **kwargs)
    for step in range(steps):
        set_grads(params, step)
        opt.step()
    return opt


def stack_bytes(rows: int, cols: int, count: int, dtype: torch.dtype) -> int:
    return rows * cols * count * dtype.itemsize


# ---------------------------------------------------------------------------
# (a) chunked == unchunked, bitwise
# ---------------------------------------------------------------------------


# Two threads on a shared 2-core machine are slow (OpenMP spin-waits), so one case runs with two.
@pytest.mark.parametrize(("threads", "ns_dtype", "nesterov"), [
    (1, torch.bfloat16, True), (1, torch.bfloat16, False), (1, torch.float32, True), (1, torch.float32, False),
    (2, torch.bfloat16, True),
])
def test_chunked_step_is_bitwise_the_unchunked_step(threads, ns_dtype, nesterov):
    torch.set_num_threads(threads)
    steps = 4 if threads == 1 else 2
    reference = make_params()
    opt_ref = run(reference, steps, ns_dtype=ns_dtype, nesterov=nesterov, ns_batch_bytes=None)
    budgets = [
        1,  # the shortest stacks: two matrices (three for an odd count)
        # per group: the 21 plain 64x48 in stacks of 5+4+4+4+4, the stack's six 64x48 in 3+3, 48x160 of 2+2+2,
        # the conv kernels in one, 384x96 of 3+2
        stack_bytes(64, 48, 5, ns_dtype),
        stack_bytes(64, 48, 5, ns_dtype) + 7,  # a budget that is no multiple of a matrix
    ]
    for budget in budgets if threads == 1 else budgets[:1]:
        chunked = make_params()
        opt = run(chunked, steps, ns_dtype=ns_dtype, nesterov=nesterov, ns_batch_bytes=budget)
        for i, (a, b) in enumerate(zip(chunked, reference)):
            assert torch.equal(a, b), f"budget {budget}: parameter {i} {tuple(a.shape)} differs by " \
                                      f"{(a - b).abs().max().item():.3e}"
            assert torch.equal(opt.state[a]["momentum_buffer"], opt_ref.state[b]["momentum_buffer"])


@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, torch.float32])
def test_orthogonalize_in_chunks_equals_one_stack(ns_dtype):
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    mats = [torch.randn(32, 24, generator=g) for _ in range(11)] + [torch.randn(24, 40, generator=g)]
    whole = orthogonalize(mats, 5, "quintic", 1e-7, ns_dtype, batched=True)
    # The old unchunked formulation: one torch.stack, cast by newton_schulz.
    old = newton_schulz(torch.stack(mats[:11]), 5, "quintic", 1e-7, ns_dtype).unbind(0)
    for count in (1, 2, 4, 11):
        chunked = orthogonalize(mats, 5, "quintic", 1e-7, ns_dtype, batched=True,
                                max_batch_bytes=stack_bytes(32, 24, count, ns_dtype))
        for i, (c, w) in enumerate(zip(chunked, whole)):
            assert c.dtype == ns_dtype and torch.equal(c, w), (count, i)
    for c, o in zip(whole, old):
        assert torch.equal(c, o)


# ---------------------------------------------------------------------------
# (b) bounded stacks and bounded peak memory
# ---------------------------------------------------------------------------


@pytest.fixture
def recorded_batches(monkeypatch):
    """Every tensor handed to newton_schulz, as (number of matrices, bytes)."""
    calls: list[tuple[int, int]] = []
    original = ns_module.newton_schulz

    def recording(G, *args, **kwargs):
        calls.append((G.shape[0] if G.ndim == 3 else 1, G.numel() * G.element_size()))
        return original(G, *args, **kwargs)

    monkeypatch.setattr(ns_module, "newton_schulz", recording)
    return calls


def test_every_newton_schulz_stack_fits_the_budget(recorded_batches):
    torch.set_num_threads(1)
    params = [nn.Parameter(torch.randn(32, 48)) for _ in range(40)]
    budget = stack_bytes(32, 48, 6, torch.bfloat16)
    run(params, 1, ns_batch_bytes=budget)  # ns_dtype bf16 by default
    assert [n for n, _ in recorded_batches] == [6] * 5 + [5] * 2, "7 stacks of nearly equal length"
    assert max(b for _, b in recorded_batches) <= budget
    recorded_batches.clear()
    run([nn.Parameter(p.detach().clone()) for p in params], 1, ns_batch_bytes=None)
    assert recorded_batches == [(40, stack_bytes(32, 48, 40, torch.bfloat16))], "None stacks the whole batch"
    recorded_batches.clear()
    # Matrices larger than the budget: stacks of two (three for an odd count), never a batch of one,
    # which oneDNN computes differently in bf16 (Note [chunked Newton-Schulz]).
    run([nn.Parameter(torch.randn(32, 48)) for _ in range(7)], 1, ns_batch_bytes=100)
    assert [n for n, _ in recorded_batches] == [3, 2, 2]


def profiled_peak_bytes(fn) -> int:
    """Peak of the CPU bytes allocated while ``fn`` runs, above what was allocated before it.

    Reads the allocation records of ``torch.profiler`` (``profile_memory=True``): each
    holds the size allocated (positive) or freed (negative), and their running sum in
    time order is the memory ``fn`` holds at that moment.
    """
    from torch.profiler import ProfilerActivity, profile

    try:
        from torch._C._profiler import _EventType
    except ImportError:  # pragma: no cover - private API of the profiler
        pytest.skip("torch._C._profiler._EventType is not available in this torch")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = []
    nodes = list(prof.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        nodes.extend(node.children)
        if node.tag == _EventType.Allocation and str(node.extra_fields.device) == "cpu":
            records.append((node.start_time_ns, node.extra_fields.alloc_size))
    assert records, "the profiler recorded no CPU allocation"
    held = peak = 0
    for _, size in sorted(records):
        held += size
        peak = max(peak, held)
    return peak


def step_peak(n: int, size: int, budget: int | None, steps: int = 2) -> int:
    """Peak memory of one Muon step (after a first step created the momentum buffers)."""
    g = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(size, size, generator=g)) for _ in range(n)]
    opt = Muon(params, ns_batch_bytes=budget)
    for step in range(steps):
        for p in params:
            p.grad = torch.randn(size, size, generator=g)
        if step == steps - 1:
            return profiled_peak_bytes(opt.step)
        opt.step()
    raise AssertionError("unreachable")


def test_peak_memory_of_a_step_follows_the_budget_not_the_matrix_count():
    torch.set_num_threads(1)
    size = 96
    budget = stack_bytes(size, size, 4, torch.bfloat16)  # 4 bf16 matrices per stack, 72 KiB
    unlimited = step_peak(48, size, None)
    chunked_48 = step_peak(48, size, budget)
    chunked_96 = step_peak(96, size, budget)
    # Measured (torch 2.13, CPU): 7.5x the budget with it (554 kB), 7.0x the whole batch's stack without
    # (6.2 MB for 48 matrices): per matrix, its bf16 stack slot, the Newton-Schulz temporaries (X, A, B
    # and the next X: 4 slots for a square matrix) and the fp32 Nesterov direction (2 slots).
    assert chunked_48 <= 10 * budget, f"peak {chunked_48} B exceeds 10x the budget {budget} B"
    assert chunked_96 <= 10 * budget, f"96 matrices: peak {chunked_96} B exceeds 10x the budget {budget} B"
    assert unlimited >= 6 * stack_bytes(size, size, 48, torch.bfloat16), unlimited
    assert unlimited >= 8 * chunked_48, (unlimited, chunked_48)


# ---------------------------------------------------------------------------
# The argument
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "256MiB"])
def test_bad_ns_batch_bytes_raises_naming_the_argument_and_the_fix(value):
    with pytest.raises(ValueError, match=rf"Muon: ns_batch_bytes={value!r} is invalid: .* or None \(no limit\), "
                                         r"e\.g\. ns_batch_bytes=268435456"):
        Muon([nn.Parameter(torch.randn(4, 4))], ns_batch_bytes=value)
    with pytest.raises(ValueError, match=rf"Muon param group 0: ns_batch_bytes={value!r} is invalid"):
        Muon([{"params": [nn.Parameter(torch.randn(4, 4))], "ns_batch_bytes": value}])


def test_default_and_per_group_budget(recorded_batches):
    torch.set_num_threads(1)
    opt = Muon([nn.Parameter(torch.randn(4, 4))])
    assert opt.param_groups[0]["ns_batch_bytes"] == DEFAULT_NS_BATCH_BYTES == 2**28
    assert Muon([nn.Parameter(torch.randn(4, 4))], ns_batch_bytes=None).param_groups[0]["ns_batch_bytes"] is None
    params = [nn.Parameter(torch.randn(8, 8)) for _ in range(6)]
    opt = Muon([{"params": params, "ns_batch_bytes": stack_bytes(8, 8, 2, torch.bfloat16)}], ns_batch_bytes=None)
    set_grads(params, 0)
    opt.step()
    assert [n for n, _ in recorded_batches] == [2, 2, 2], "a group's own ns_batch_bytes wins"


def test_state_dict_saved_without_the_key_still_steps():
    """A checkpoint written before ns_batch_bytes existed has groups without it: the default applies."""
    params = [nn.Parameter(torch.randn(8, 8)) for _ in range(3)]
    opt = run(params, 1)
    saved = opt.state_dict()
    for group in saved["param_groups"]:
        del group["ns_batch_bytes"]
    fresh = Muon(params, lr=0.02)
    fresh.load_state_dict(saved)
    assert "ns_batch_bytes" not in fresh.param_groups[0]
    set_grads(params, 1)
    fresh.step()


# ---------------------------------------------------------------------------
# The measurement quoted in docs/muon.md
# ---------------------------------------------------------------------------


def _measure(device: str, n: int = 64, size: int = 1024, budget: int | None = 64 * MiB) -> float:
    """Peak MiB allocated by one Muon step (the second) on ``device``."""
    g = torch.Generator(device=device).manual_seed(0)
    params = [nn.Parameter(torch.randn(size, size, generator=g, device=device)) for _ in range(n)]
    opt = Muon(params, ns_batch_bytes=budget)
    for step in range(2):
        for p in params:
            p.grad = torch.randn(size, size, generator=g, device=device)
        if step == 0:
            opt.step()
        elif device == "cpu":
            return profiled_peak_bytes(opt.step) / MiB
        else:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            opt.step()
            torch.cuda.synchronize()
            return (torch.cuda.max_memory_allocated() - before) / MiB
    raise AssertionError("unreachable")


def _sweep(device: str, count: int = 12) -> None:
    """Which stack lengths give other bits than one stack of ``count``, per shape and dtype."""
    g = torch.Generator(device=device).manual_seed(0)
    shapes = [(4, 4), (8, 36), (16, 16), (64, 48), (128, 128), (384, 96), (512, 2048), (1024, 1024), (2048, 512),
              (768, 3072), (3072, 768)]
    print(f"{device}, {torch.get_num_threads()} threads: stack lengths whose result differs from one stack of "
          f"{count} (newton_schulz, 5 steps)")
    for (m, n), dtype in ((s, d) for s in shapes for d in (torch.bfloat16, torch.float32)):
        G = torch.randn(count, m, n, generator=g, device=device)
        whole = newton_schulz(G, 5, "simple", 1e-7, dtype)
        differ = {min(k, count - i) for k in range(1, count) for i in range(0, count, k)
                  if not torch.equal(newton_schulz(G[i:i + k], 5, "simple", 1e-7, dtype), whole[i:i + k])}
        print(f"  {m}x{n} {str(dtype).removeprefix('torch.'):8s} {sorted(differ)}", flush=True)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Peak memory of one Muon step with and without ns_batch_bytes")
    parser.add_argument("--devices", default="cpu,cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--budgets-mib", default="none,256,64,16", help="comma-separated; 'none' = no limit")
    parser.add_argument("--sweep", action="store_true", help="instead: which stack lengths change the bits")
    args = parser.parse_args()
    if args.sweep:
        for device in args.devices.split(","):
            _sweep(device)
        raise SystemExit
    print(f"torch {torch.__version__}; one Muon step (ns_dtype bf16, nesterov, 5 steps) on 64 fp32 matrices "
          f"of 1024x1024 (256 MiB of parameters); peak memory allocated during the step")
    for device in args.devices.split(","):
        for text in args.budgets_mib.split(","):
            budget = None if text == "none" else int(text) * MiB
            label = "None" if budget is None else f"{text} MiB"
            print(f"{device:5s} ns_batch_bytes={label:8s} peak {_measure(device, budget=budget):8.1f} MiB",
                  flush=True)
