"""A ``LayerwiseSession`` in a plain torch loop (``examples/torch_train.py``): no Lightning.

* The example's loop at 2 and 3 gloo ranks equals one process on the same global batch (fp32, relative
  error <= 1e-5 after 6 steps; Muon with float32 Newton-Schulz), and so do the norms
  ``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`` returns: the same on every rank.
* With Lightning not importable, ``import lightning_layerwise.session`` and ``import lightning_layerwise``
  succeed without importing any Lightning module, the Lightning strategies raise an ``ImportError`` naming
  Lightning, and a session trains.
* The session's own checkpoints (``save_checkpoint`` / ``load_checkpoint``, both formats): 2 ranks train
  half the steps and save, 3 ranks resume and finish, equal to the uninterrupted one-process run.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from _dist import reference_threads, run_distributed
from helpers import rel_err
from examples.gpt import GPT, GPTConfig
from examples.torch_train import make_optimizer, text_batches, train

STEPS, BATCH, BLOCK = 6, 12, 16
TOL = 1e-5


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, n_layer=2, n_head=2, n_embd=32, block_size=BLOCK, bias=False))


def batches():
    return list(text_batches(STEPS, BATCH, BLOCK, limit=200_000))


def _worker(rank, world, name):
    m = model()
    _, norms = train(m, make_optimizer(name, m, ns_dtype=torch.float32), batches(), rank, world, bucket_size=4096)
    return {n: p.detach().clone() for n, p in m.named_parameters()}, norms


def reference(name):
    with reference_threads():
        m = model()
        opt = make_optimizer(name, m, ns_dtype=torch.float32)
        norms = []
        for tokens in batches():
            opt.zero_grad()
            _, loss = m(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0).item())
            opt.step()
    return {n: p.detach().clone() for n, p in m.named_parameters()}, norms


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adamw", "muon"])
@pytest.mark.parametrize("world", [2, 3])
def test_the_plain_torch_loop_equals_one_process(world, name):
    want, want_norms = reference(name)
    for rank, (got, norms) in enumerate(run_distributed(_worker, world, name)):
        for n in want:
            assert rel_err(got[n], want[n]) <= TOL, f"{name} at {world} ranks, rank {rank}: {n}"
        for g, w in zip(norms, want_norms, strict=True):
            assert g == pytest.approx(w, rel=TOL)
    assert max(want_norms) > 1.0, "clipping was active"


NO_LIGHTNING = r"""
import sys
sys.modules["lightning"] = None  # `import lightning` raises ImportError
sys.path[:0] = [".", "examples"]
import torch
from lightning_layerwise.session import LayerwiseSession, SessionEnv
import lightning_layerwise as llw
assert sys.modules["lightning"] is None
assert not [m for m in sys.modules if m.startswith("lightning.")], "a Lightning module was imported"
try:
    llw.LayerwiseStrategy
except ImportError as error:
    assert "needs Lightning" in str(error), error
else:
    raise AssertionError("LayerwiseStrategy without Lightning")
from examples.torch_train import make_optimizer, text_batches, train
from examples.gpt import GPT, GPTConfig
torch.manual_seed(0)
m = GPT(GPTConfig(vocab_size=256, n_layer=1, n_head=2, n_embd=16, block_size=16, bias=False))
losses, _ = train(m, make_optimizer("adamw", m), text_batches(8, 8, 16, limit=100_000), 0, 1)
assert losses[-1] < losses[0], losses
print("trained", round(losses[0], 2), round(losses[-1], 2))
"""


def test_the_engine_imports_and_trains_without_lightning():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, "-c", NO_LIGHTNING], cwd=root, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("trained"), result.stdout


def _resume_worker(rank, world, name, fmt, path, half):
    """``half`` "first": the first STEPS // 2 steps, then a checkpoint; "second": resume from it, finish."""
    m = model()
    opt = make_optimizer(name, m, ns_dtype=torch.float32)
    if half == "first":
        train(m, opt, batches()[:STEPS // 2], rank, world, save=path, bucket_size=4096, checkpoint_format=fmt)
    else:
        train(m, opt, batches(), rank, world, resume=path, bucket_size=4096, checkpoint_format=fmt)
    return {n: p.detach().clone() for n, p in m.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_the_plain_loop_resumes_at_another_world_size(tmp_path, fmt):
    """2 ranks train half the steps and save; 3 ranks resume and finish: the uninterrupted one-process run
    (AdamW: its state is split across ranks, and must be re-cut for 3)."""
    path = str(tmp_path / "half.ckpt")
    run_distributed(_resume_worker, 2, "adamw", fmt, path, "first")
    assert os.path.isdir(path) == (fmt == "sharded")
    if fmt == "full":
        assert set(torch.load(path, weights_only=True)) == {"state_dict", "optimizer_states", "step"}
    want, _ = reference("adamw")
    for rank, got in enumerate(run_distributed(_resume_worker, 3, "adamw", fmt, path, "second")):
        for n in want:
            assert rel_err(got[n], want[n]) <= TOL, f"{fmt}, rank {rank}: {n} differs by {rel_err(got[n], want[n])}"
