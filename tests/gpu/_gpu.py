"""What the GPU tests share: running a test body in a fresh process, an NCCL world of one rank, comparing
values, and small models with their plain and wrapped training loops.

The GPU suite (``test_gpu_lightning.py``, ``test_gpu_collectives.py``, ``test_gpu_ranks.py`` in this
folder): every test needs CUDA (and NCCL) and is skipped without it. Run on a machine with one NVIDIA GPU,
as ``bash scripts/gpu_check.sh`` does::

    python3 -m pytest -m gpu -v tests/gpu

Every test compares *values* with a reference computed on the same GPU in the
same process (float32 relative error <= 1e-5 unless a comment says why a
precision needs more). Each test runs its training in a fresh Python process
(:func:`_run_child`): CUDA cannot be used in a forked child of a process that
touched it, an NCCL world must be created and destroyed per test, and Lightning's
DDP-family strategies initialise a process group even with ``devices=1``. In the
child the default process group is an NCCL world of one rank (a ``FileStore``),
created before the Trainer, which then reuses it.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import os
import pickle
import subprocess
import sys
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lightning_layerwise as llw
from _dist import free_port as _free_port

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
# tests/ (helpers.py, _dist.py), as pyproject.toml puts it on pytest's path, and this folder, which pytest puts there
# for its test modules: a child imports a test module of this folder, and this module, by name.
TEST_DIRS = [TESTS, TESTS / "gpu"]
TOL = 1e-5
CHILD_TIMEOUT = 900  # seconds; the compiled fits compile four or five times


# --- running a test body in a fresh process --------------------------------------------------------------------------

def _run_child(fn, *args, timeout: float = CHILD_TIMEOUT):
    """Runs ``fn(tmpdir, *args)`` (a function of a test module) in a new Python process; returns its result.

    The child imports ``fn``'s module by its name (``tests/`` and its folders are put on its path),
    so ``fn`` and everything it uses must be module-level. A child that raises makes this raise
    with the child's traceback and the tail of its output.
    """
    with tempfile.TemporaryDirectory() as tmp:
        request, reply = os.path.join(tmp, "request.pkl"), os.path.join(tmp, "reply.pkl")
        with open(request, "wb") as f:
            pickle.dump((fn.__module__, fn.__name__, (tmp, *args)), f)
        env = dict(os.environ)
        paths = [*map(str, TEST_DIRS), str(ROOT), str(ROOT / "examples")]
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(paths)
        code = "import sys, _gpu; _gpu._child_main(sys.argv[1], sys.argv[2])"
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
        module, name, args = pickle.load(f)
    try:
        result = ("ok", getattr(importlib.import_module(module), name)(*args))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        result = ("error", traceback.format_exc())
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    with open(reply, "wb") as f:
        pickle.dump(result, f)


def _init_nccl_world1(tmp: str, bind_device: bool = False) -> None:
    """An NCCL default group of one rank, set up the way Lightning's launcher would leave it; ``bind_device``
    binds it to ``cuda:0`` (``device_id``), as Lightning does on GPUs with torch >= 2.3."""
    torch.cuda.set_device(0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", NODE_RANK="0")
    store = dist.FileStore(os.path.join(tmp, "nccl_store"), 1)
    bound = {"device_id": torch.device("cuda", 0)} if bind_device else {}
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, timeout=timedelta(seconds=120), **bound)


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
    wrapper.param_sync.finish()
    torch.cuda.synchronize()
    events = {}
    for event, _ in wrapper.grad_sync.waiter.events:
        events[event] = events.get(event, 0) + 1
    return {"params": _params_of(model), "losses": torch.stack(losses).cpu(), "buckets": len(wrapper.buckets),
            "events": events, "owned": sum(1 for _ in wrapper.named_owned_parameters()),
            "n_params": len(list(model.parameters()))}


def _fresh(model_name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[model_name]().cuda()


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


# --- several gloo ranks over CUDA tensors on the one GPU (NCCL refuses two ranks on one device) -----------------------

@contextlib.contextmanager
def gloo_over_cuda(tmp: str, tag: str, rank: int, world: int):
    """Inside a spawned rank: the GPU, and a gloo group over a file store under ``tmp``, destroyed at the end."""
    torch.cuda.set_device(0)
    store = dist.FileStore(os.path.join(tmp, f"gloo_store_{tag}"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        yield
    finally:
        dist.destroy_process_group()


def save_rank(tmp: str, tag: str, rank: int, out: object) -> None:
    """What a spawned rank hands back to :func:`spawn_ranks`."""
    with open(os.path.join(tmp, f"{tag}_rank{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)


def spawn_ranks(worker, world: int, tmp: str, tag: str, *args) -> list:
    """Runs ``worker(rank, world, tmp, *args)`` on ``world`` spawned processes; returns what each saved with
    :func:`save_rank` under ``tag``, by rank."""
    import torch.multiprocessing as mp

    mp.start_processes(worker, args=(world, tmp, *args), nprocs=world, start_method="spawn")
    ranks = []
    for rank in range(world):
        with open(os.path.join(tmp, f"{tag}_rank{rank}.pkl"), "rb") as f:
            ranks.append(pickle.load(f))
    return ranks
