"""GPU: the wrapper's collectives on one GPU: real NCCL, then slowed down on a side stream.

Needs CUDA (and NCCL); each test runs its body in a fresh process (``_gpu.py`` says why and how).

b. The wrapper over real NCCL collectives at world size 1 (separate reduce-scatter
   and all-gather groups, several buckets, overlap on and off, SGD and AdamW)
   against plain single-device training.
c. Stream safety: the bucket collectives replaced by versions that finish about
   100 ms late on a side stream, with the buffer poisoned (NaN) until then; the
   wrapper must still match the reference, and breaking ``wait()`` must not.
d. Parameter reads outside a parameter's own module (``nn.MultiheadAttention``
   reading ``out_proj.weight``, a parent calling ``F.linear(h, self.child.weight)``)
   under the slowed collectives, and ``param_read_guard`` (``"wait"`` default,
   ``"strict"``, ``"off"``).
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lightning_layerwise as llw
from _gpu import (_assert_matches, _batches, _fresh, _init_nccl_world1, _max_err, _nccl_groups, _run_child,
                  _train_plain, _train_wrapped)
from lightning_layerwise.engine import collectives

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (and NCCL)"),
]


# --- b. the wrapper over real NCCL collectives at world size 1 -------------------------------------------------------

WRAP_STEPS = 6


def _nccl_wrapper_child(tmp: str) -> dict:
    _init_nccl_world1(tmp)
    batches = _batches("mlp", WRAP_STEPS)
    out = {}
    for optimizer in ("sgd", "adamw"):
        reference = _train_plain(_fresh("mlp"), batches, optimizer)
        for overlap in (True, False):
            groups = _nccl_groups()
            assert dist.get_backend(groups.dp) == "nccl" and groups.separate_all_gather
            result = _train_wrapped(_fresh("mlp"), batches, optimizer, process_groups=groups, bucket_size=1024,
                                    overlap_grad_reduce=overlap, overlap_param_gather=overlap, prefetch_depth=1)
            result["max_err"] = _max_err(result, reference)
            out[(optimizer, overlap)] = (result, reference)
    return out


def test_wrapper_over_real_nccl_collectives_matches_single_device_training():
    """``LayerwiseDataParallel`` with ``ProcessGroups(dp=g, dp_all_gather=g2)``, both real one-rank NCCL groups,
    several buckets, overlap on and off, SGD (momentum, weight decay) and AdamW, 6 steps, against the same
    model trained without the wrapper."""
    out = _run_child(_nccl_wrapper_child)
    for (optimizer, overlap), (result, reference) in out.items():
        what = f"{optimizer}, overlap={overlap}"
        assert result["buckets"] >= 4, what
        assert result["owned"] == result["n_params"], what  # one rank owns everything
        # Every bucket went through a real reduce-scatter and all-gather in every step.
        assert result["events"].get("rs_dispatch") == result["buckets"] * WRAP_STEPS, (what, result["events"])
        assert result["events"].get("ag_dispatch") == result["buckets"] * WRAP_STEPS, (what, result["events"])
        _assert_matches(result, reference, what=what)


def _nccl_split_child(tmp: str) -> dict:
    from lightning_layerwise.engine import process_groups
    _init_nccl_world1(tmp, bind_device=True)
    out = {"can_split": process_groups.can_split({})}
    calls = []
    real_split, real_new = dist.split_group, dist.new_group
    dist.split_group = lambda *a, **k: calls.append("split_group") or real_split(*a, **k)
    dist.new_group = lambda *a, **k: calls.append("new_group") or real_new(*a, **k)
    try:
        dp = process_groups._partition([[0]], 0, {})
        gather = process_groups._partition([[0]], 0, {})
    finally:
        dist.split_group, dist.new_group = real_split, real_new
    out["calls"] = calls
    out["backend"] = dist.get_backend(dp)
    device = torch.device("cuda", 0)
    out["averaging"] = sorted(collectives.probe_averaging(dp, device))
    t = torch.full((5,), 3.0, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.AVG, group=dp)
    out["avg"] = t.cpu()
    batches = _batches("mlp", WRAP_STEPS)
    reference = _train_plain(_fresh("mlp"), batches, "adamw")
    result = _train_wrapped(_fresh("mlp"), batches, "adamw", process_groups=llw.ProcessGroups(dp=dp,
                            dp_all_gather=gather), bucket_size=1024, prefetch_depth=1)
    out["result"], out["reference"] = result, reference
    result["max_err"] = _max_err(result, reference)
    return out


def test_groups_split_from_a_device_bound_nccl_world_and_its_averaging_probe():
    """An NCCL world bound to its device (as Lightning binds it): groups come from ``dist.split_group``, one
    call per family (Note [splitting groups]); the averaging probe finds NCCL averaging all three reductions;
    the wrapper over the split groups trains like one device (6 AdamW steps)."""
    out = _run_child(_nccl_split_child)
    assert out["can_split"] is True
    assert out["calls"] == ["split_group", "split_group"], out["calls"]
    assert out["backend"] == "nccl"
    assert out["averaging"] == sorted(collectives.AVERAGED), out["averaging"]
    assert torch.equal(out["avg"], torch.full((5,), 3.0))
    result, reference = out["result"], out["reference"]
    assert result["events"].get("rs_dispatch") == result["buckets"] * WRAP_STEPS, result["events"]
    _assert_matches(result, reference, what="split groups")


# --- c. stream safety with slowed collectives ------------------------------------------------------------------------

SLOW_MS = 100.0


def _sleep_cycles(ms: float) -> int:
    """GPU clock cycles that ``torch.cuda._sleep`` needs to spin for about ``ms`` milliseconds."""
    cycles = 20_000_000
    per_ms = 0.0
    for _ in range(2):  # the first launch pays for loading the kernel
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        per_ms = cycles / max(start.elapsed_time(end), 1e-3)
    return int(per_ms * ms)


class _SlowWork:
    """What the slowed collectives return: ``wait()`` makes the current stream wait for the side stream's
    event, as NCCL's work handles do; a broken one returns without ordering anything."""

    def __init__(self, event: torch.cuda.Event, honest: bool):
        self.event, self.honest = event, honest

    def wait(self, timeout=None) -> bool:
        if self.honest:
            torch.cuda.current_stream().wait_event(self.event)
        return True

    def is_completed(self) -> bool:
        return self.event.query()


class SlowCollectives:
    """Replaces ``collectives._all_gather_single`` / ``_reduce_scatter_single`` while active.

    Each call, on the calling (compute) stream, copies the input, then fills the output with
    NaN (what a reader sees before the data has landed). A side stream, one per kind (as NCCL
    serialises one communicator), waits for that, spins ``torch.cuda._sleep`` for about
    ``SLOW_MS`` ms, runs the real collective from the copy into the output, and records an
    event. Only ``wait()`` on the returned work orders the compute stream after the event.
    ``broken`` names kinds whose ``wait()`` does nothing (the mutation check).
    """

    KINDS = ("all_gather", "reduce_scatter")

    def __init__(self, sleep_cycles: int, broken: tuple[str, ...] = ()):
        self.sleep_cycles, self.broken = sleep_cycles, set(broken)
        self.calls = {k: 0 for k in self.KINDS}
        self.sizes: dict[str, list[int]] = {k: [] for k in self.KINDS}
        self._streams: dict[str, torch.cuda.Stream] = {}
        self._real = {}

    def __enter__(self):
        self._real = {"all_gather": collectives._all_gather_single,
                      "reduce_scatter": collectives._reduce_scatter_single}
        collectives._all_gather_single = self._make("all_gather")
        collectives._reduce_scatter_single = self._make("reduce_scatter")
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize()  # nothing of a side stream may outlive the buffers it writes
        collectives._all_gather_single = self._real["all_gather"]
        collectives._reduce_scatter_single = self._real["reduce_scatter"]
        return False

    def _make(self, kind: str):
        def slowed(output, input, *args, group=None, async_op=False, **kwargs):
            self.calls[kind] += 1
            self.sizes[kind].append(input.numel())
            compute = torch.cuda.current_stream()
            staged = input.clone()
            output.fill_(float("nan"))
            side = self._streams.setdefault(kind, torch.cuda.Stream())
            side.wait_stream(compute)
            with torch.cuda.stream(side):
                torch.cuda._sleep(self.sleep_cycles)
                self._real[kind](output, staged, *args, group=group, async_op=False, **kwargs)
                event = torch.cuda.Event()
                event.record(side)
            staged.record_stream(side)
            work = _SlowWork(event, honest=kind not in self.broken)
            if async_op:
                return work
            work.wait()
            return None

        return slowed


def _slow_run(model_name: str, batches, cycles: int, broken=(), optimizer: str = "adamw", **wrapper_kwargs) -> dict:
    options = dict(process_groups=_nccl_groups(), bucket_size=256, prefetch_depth=1)
    options.update(wrapper_kwargs)
    with SlowCollectives(cycles, broken) as slow:
        try:
            result = _train_wrapped(_fresh(model_name), batches, optimizer, **options)
        except BaseException as err:  # noqa: BLE001 - reported to the parent as data
            return {"error_type": type(err).__name__, "error": str(err),
                    "is_stale_error": _is_stale_read_error(err), "calls": dict(slow.calls),
                    "sizes": dict(slow.sizes)}
    result["calls"], result["sizes"] = dict(slow.calls), dict(slow.sizes)
    return result


def _is_stale_read_error(err: BaseException) -> bool:
    cls = getattr(llw, "StaleParameterReadError", None)
    return cls is not None and isinstance(err, cls)


def _stream_safety_child(tmp: str) -> dict:
    _init_nccl_world1(tmp)
    cycles = _sleep_cycles(SLOW_MS)
    batches = _batches("mlp", 4)
    reference = _train_plain(_fresh("mlp"), batches, "adamw")
    out = {"reference": reference, "cycles": cycles}
    for mode, broken in (("honest", ()), ("broken_all_gather", ("all_gather",)),
                         ("broken_reduce_scatter", ("reduce_scatter",))):
        result = _slow_run("mlp", batches, cycles, broken, bucket_size=1024)
        result["max_err"] = _max_err(result, reference)
        out[mode] = result
    return out


def test_stream_safety_with_slow_side_stream_collectives():
    """Values stay exact when every collective lands ~100 ms late on another CUDA stream.

    Both bucket collectives are replaced (:class:`SlowCollectives`): the output is NaN until
    a side stream, after ``torch.cuda._sleep``, runs the real NCCL collective into it; only
    the work handle's ``wait()`` orders the compute stream after that. Four AdamW steps of a
    five-bucket MLP with overlapped gathers (prefetch depth 1) must equal plain training.

    Mutation check (run in the same child): with ``wait()`` made a no-op for the all-gather,
    the forward reads NaN parameters, and with it made a no-op for the reduce-scatter, the
    optimizer reads NaN gradients; both runs must be detected as mismatches, which shows the
    comparison can fail and that the wrapper's correctness rests on ``wait()`` alone.
    """
    out = _run_child(_stream_safety_child)
    honest = out["honest"]
    assert "error" not in honest, honest
    assert honest["buckets"] >= 4
    # Every bucket's two collectives in each of the 4 steps went through the slowed path; besides them only set-up's
    # averaging probe (Note [averaging]: one reduce-scatter of one element per rank) did.
    steps = {k: [n for n in sizes if n > 1] for k, sizes in honest["sizes"].items()}
    assert len(steps["all_gather"]) == len(steps["reduce_scatter"]) == honest["buckets"] * 4, honest["sizes"]
    assert honest["sizes"]["all_gather"] == steps["all_gather"], honest["sizes"]
    assert [n for n in honest["sizes"]["reduce_scatter"] if n == 1] == [1], honest["sizes"]
    _assert_matches(honest, out["reference"], what="slowed side-stream collectives")
    for mode in ("broken_all_gather", "broken_reduce_scatter"):
        assert "error" not in out[mode], out[mode]
        assert out[mode]["max_err"] > 1e-3, f"{mode}: a no-op wait() went unnoticed ({out[mode]['max_err']})"


# --- d. parameters read outside their module's own forward -----------------------------------------------------------

def _has_read_guard() -> bool:
    return "param_read_guard" in inspect.signature(llw.LayerwiseDataParallel.__init__).parameters


def _gather_positions(model: nn.Module, names: list[str], **wrapper_kwargs) -> list[int]:
    """Position in the all-gather order (buckets by first registered parameter) of each named parameter's bucket."""
    wrapper = llw.LayerwiseDataParallel(copy.deepcopy(model), **wrapper_kwargs)
    order = sorted(wrapper.buckets, key=lambda b: b.first_param)
    named = dict(wrapper.module.named_parameters())
    position = {id(p): i for i, b in enumerate(order) for p in b.params}
    return [position[id(named[n])] for n in names]


def _read_guard_child(tmp: str, model_name: str, guard: str | None) -> dict:
    """Trains ``model_name`` under the slowed collectives with ``param_read_guard=guard`` (None: the default)."""
    _init_nccl_world1(tmp)
    cycles = _sleep_cycles(SLOW_MS)
    batches = _batches(model_name, 4)
    reference = _train_plain(_fresh(model_name), batches, "adamw")
    kwargs = {} if guard is None else {"param_read_guard": guard}
    out = {"reference": reference, "has_guard_argument": _has_read_guard()}
    probe = {"attn": ["attn.in_proj_weight", "attn.out_proj.weight"],
             "parent": ["inp.weight", "child.weight"]}.get(model_name)
    if probe:
        out["positions"] = _gather_positions(_fresh(model_name), probe, process_groups=llw.ProcessGroups.single(),
                                             bucket_size=256)
    result = _slow_run(model_name, batches, cycles, **kwargs)
    if "error" not in result:
        result["max_err"] = _max_err(result, reference)
    out["result"] = result
    return out


@pytest.mark.parametrize("model_name", ["attn", "parent"])
def test_parameters_read_outside_their_module_are_awaited_by_default(model_name):
    """``nn.MultiheadAttention`` reads ``out_proj.weight`` without calling ``out_proj``; ``ParentNet`` reads
    ``self.child.weight`` with ``F.linear`` without calling ``child``. With small buckets the read parameter
    sits in a later all-gather bucket than the module that reads it, so no forward pre-hook waits for it;
    under the slowed collectives an unguarded read sees NaN. The default ``param_read_guard="wait"`` must
    give the reference values."""
    out = _run_child(_read_guard_child, model_name, None)
    first, read = out["positions"]
    assert read > first, f"the layout no longer puts the read parameter in a later bucket: {out['positions']}"
    assert "error" not in out["result"], out["result"]
    _assert_matches(out["result"], out["reference"], what=f"{model_name}, default param_read_guard")


def test_unguarded_reads_outside_the_module_are_detected_as_stale():
    """Mutation check for the test above: with ``param_read_guard="off"`` (before the argument existed: the
    wrapper as it was), the MultiheadAttention model reads ``out_proj.weight`` before its all-gather lands,
    so its values must differ from the reference. Shows that the comparison above can fail."""
    out = _run_child(_read_guard_child, "attn", "off" if _has_read_guard() else None)
    assert "error" not in out["result"], out["result"]
    assert out["result"]["max_err"] > 1e-3, out["result"]["max_err"]


def test_strict_read_guard_accepts_a_model_that_calls_its_modules():
    """``param_read_guard="strict"`` on an MLP that calls every module normally never raises, and trains to
    the reference values under the slowed collectives."""
    out = _run_child(_read_guard_child, "seq_mlp", "strict")
    assert "error" not in out["result"], out["result"]
    _assert_matches(out["result"], out["reference"], what="seq_mlp, strict")


def test_strict_read_guard_names_the_stale_parameter():
    """``param_read_guard="strict"`` on the MultiheadAttention model raises
    ``lightning_layerwise.StaleParameterReadError`` naming ``out_proj.weight``."""
    out = _run_child(_read_guard_child, "attn", "strict")
    result = out["result"]
    assert result.get("error_type") == "StaleParameterReadError", result.get("error_type", result)
    assert result["is_stale_error"], "the error is not lightning_layerwise.StaleParameterReadError"
    assert "out_proj.weight" in result["error"], result["error"]
