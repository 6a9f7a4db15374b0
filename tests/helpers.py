"""The helpers that more than one test file uses: each is defined here once, and tests import it by name.

``tests/`` is on pytest's path (``pythonpath`` in ``pyproject.toml``), so this module is ``helpers``:
``from helpers import rel_err, snapshot``. No test file imports another test file; what two of them share
lives here. Fixtures go in ``conftest.py``; running a function on several gloo ranks is ``_dist.py``; the
themed models and references of the meta-device and Muon-family tests are ``_init_styles.py`` and
``_muon_family.py``; the GPU suite's child-process harness is ``gpu/_gpu.py`` (whose ``_rel_err`` and
``_params_of`` differ from the ones here: an infinite error on a shape mismatch or a non-finite value, CPU copies).

Sections, by what they serve:

* comparing: ``rel_err`` (relative error in float64), ``snapshot`` (parameters by name, cloned),
  ``params_of`` (the same, with a compiled submodule's ``_orig_mod.`` left out of the names);
* ``RMSNorm``: a norm without ``reset_parameters``;
* ``Tiny``, ``tiny_batches``, ``tiny_trainer`` and ``outcome``: a two-layer LightningModule, its data and a
  quiet ``Trainer`` for the tests of bad inputs and faults; ``outcome(fn)`` runs ``fn`` and returns ``"ok"``
  or the type and text of what it raised, so a test can assert the exact message a user reads, also from a
  forked rank;
* ``Regressor``, ``loaders``, ``Core``, ``dataset``, ``world_trainer``: the small regressor of
  ``lightning/test_trainer.py`` and the tests built on it;
* ``gpt``, ``gpt_optimizer``, ``gpt_batches``, ``gpt_loss``, ``wrap_gpt``, ``backward_micro_batches``,
  ``gpt_reference``: the example GPT with its tied embedding (``engine/test_elementwise_fill.py``);
* ``moe_gpt``, ``moe_optimizer``, ``moe_batches``, ``moe_loss``, ``moe_reference``, ``wrap_moe``, ``train_moe``,
  ``global_names``: the example MoE GPT against one process holding every expert (``engine/test_experts.py``);
* ``TiedNet`` and ``sharded_model``, ``sharded_batches``, ``sharded_loss``, ``sharded_optimizer``,
  ``nothing_full``: sharded parameters (``engine/test_data_parallel.py``, ``engine/test_sharded_parameters.py``);
* ``READ_CASES`` and its models, ``read_batches``, ``read_loss``, ``read_optimizer``, ``read_reference``,
  ``local_part``: models that read parameters outside their modules' forward (``engine/test_stale_reads.py``);
* ``CkptNet``, ``RankSlices``, ``ckpt_trainer``, ``ckpt_loader``, ``ckpt_result``, ``ckpt_run_worker``,
  ``assert_continues``, ``assert_at_checkpoint``, ``saved_params``: checkpoints that reshard
  (``checkpoint/test_checkpoint_resharding.py``);
* ``ROOT``, ``LAUNCH_SCRIPT``, ``clean_env``: running ``tests/launch_script.py`` in a fresh process.

Where two sections had the same name for different things (``batches``, ``optimizer``, ``STEPS``, ``Net``, ...),
each carries its section's prefix (``gpt_batches``, ``moe_optimizer``, ``MOE_STEPS``, ``CkptNet``), and the test
file it came from imports it under the name its tests use (``from helpers import gpt_batches as batches``).
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos import Transformer
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

import lightning_layerwise as llw
from _dist import reference_threads
from lightning_layerwise import LayerwiseDataParallel, ProcessGroups
from lightning_layerwise.engine.buffers import ParamState, is_allocated
from lightning_layerwise.experts import check_expert_marks, expert_parameter_names
from lightning_layerwise.optim import Muon, elementwise_parameters, muon_param_groups


# --- comparing -------------------------------------------------------------------------------------------------------

def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()


def params_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters by name (a torch.compile'd submodule's ``_orig_mod.`` left out of the names)."""
    return {n.replace("_orig_mod.", ""): p.detach().clone() for n, p in module.named_parameters()}


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# --- a norm without reset_parameters (engine/test_init_replay.py, lightning/test_meta_device_init.py) ----------------

class RMSNorm(nn.Module):
    """A norm without ``reset_parameters`` (as Hugging Face's and most hand-written ones)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


# --- Tiny: a two-layer LightningModule, its data, a quiet Trainer (the tests of bad inputs and faults) ---------------

class Tiny(L.LightningModule):
    """Two linear layers; ``head`` names the second one (another name makes another model)."""

    def __init__(self, width: int = 8, head: str = "out"):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, width)
        setattr(self, head, nn.Linear(width, 2))
        self.head_name = head

    def forward(self, x):
        return getattr(self, self.head_name)(self.inp(x).tanh())

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def tiny_batches(n: int = 8, batch_size: int = 2) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return DataLoader(TensorDataset(x, x[:, :2].sin()), batch_size=batch_size)


def tiny_trainer(devices: int = 1, strategy=None, **kwargs) -> L.Trainer:
    options = dict(accelerator="cpu", devices=devices, strategy=strategy or llw.LayerwiseStrategy(), max_steps=1,
                   logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    options.update(kwargs)
    return L.Trainer(**options)


def outcome(fn) -> str:
    """``"ok"``, or the type and text of what ``fn()`` raised."""
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - the message is what is under test
        return f"{type(e).__name__}: {e}"
    return "ok"


# --- a small regressor (lightning/test_trainer.py) -------------------------------------------------------------------

WORLD = 2


class Regressor(L.LightningModule):
    def __init__(self, optimizer: str = "adamw", inf_on_rank: int | None = None, inf_at_step: int = 1):
        super().__init__()
        self.optimizer_name = optimizer
        self.inf_on_rank, self.inf_at_step = inf_on_rank, inf_at_step
        torch.manual_seed(0)
        self.emb = nn.Linear(7, 24)
        self.body = nn.Sequential(nn.Linear(24, 33), nn.GELU(), nn.LayerNorm(33), nn.Linear(33, 24))
        self.head = nn.Linear(24, 3)

    def forward(self, x):
        h = self.emb(x)
        return self.head(h + self.body(h))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        if self.inf_on_rank == self.global_rank and self.global_step == self.inf_at_step:
            # An inf gradient for one parameter only: after the reduce-scatter only its owner sees it.
            loss = loss + self.head.bias.sum() * float("inf")
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        groups = llw.muon_param_groups(self)
        return llw.Muon(groups, lr=0.02, adamw_lr=1e-2, ns_dtype=torch.float32)


def loaders(n: int = 64, batch_size: int = 4):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 7, generator=g)
    y = torch.stack([x[:, 0] * x[:, 1], x[:, 2].sin(), x[:, 3:].sum(1)], dim=1)
    data = TensorDataset(x, y)
    return DataLoader(data, batch_size=batch_size), DataLoader(data, batch_size=8)


class Core(nn.Module):
    def __init__(self, norm: str = "layer"):
        super().__init__()
        self.emb = nn.Linear(7, 24)
        norm_layer = nn.LayerNorm(33) if norm == "layer" else nn.BatchNorm1d(33)
        self.body = nn.Sequential(nn.Linear(24, 33), nn.GELU(), norm_layer, nn.Linear(33, 24))
        self.head = nn.Linear(24, 3)

    def forward(self, x):
        h = self.emb(x)
        return self.head(h + self.body(h))


def dataset(n: int, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 7, generator=g)
    y = torch.stack([x[:, 0] * x[:, 1], x[:, 2].sin(), x[:, 3:].sum(1)], dim=1)
    return TensorDataset(x, y)


def world_trainer(strategy, root, **kwargs) -> L.Trainer:
    options = dict(accelerator="cpu", devices=torch.distributed.get_world_size(), strategy=strategy, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   num_sanity_val_steps=0, default_root_dir=root, max_epochs=1)
    options.update(kwargs)
    return L.Trainer(**options)


# --- the example GPT, tied embedding (engine/test_elementwise_fill.py) -----------------------------------------------

GPT_STEPS = 10
GPT_GLOBAL_BATCH = 12  # rank r of world w forwards rows r::w... as chunks: t.chunk(world)[rank]
GPT_SEQ = 8
GPT_VOCAB = 97  # wte (97x24) is no peer of the MLP matrices (96x24): it is split at 2, 3 and 4 ranks


def gpt(seed: int = 0) -> nn.Module:
    from examples.gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    # No biases: the key bias of attention has a mathematically zero gradient, and Adam would
    # scale its rounding noise (different on 1 and on N processes) up to the learning rate.
    return GPT(GPTConfig(vocab_size=GPT_VOCAB, n_layer=2, n_head=2, n_embd=24, block_size=GPT_SEQ, bias=False))


def gpt_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":  # AdamW and Muon are blind to a constant gradient scale; SGD is not
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    return Muon(muon_param_groups(model), lr=0.02, weight_decay=0.01, ns_dtype=torch.float32, adamw_lr=3e-3,
                adamw_weight_decay=0.1)


def gpt_batches(steps: int = GPT_STEPS):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, GPT_VOCAB, (GPT_GLOBAL_BATCH, GPT_SEQ + 1), generator=g) for _ in range(steps)]


def gpt_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    _, loss = model(tokens[:, :-1], tokens[:, 1:])
    return loss


def wrap_gpt(model: nn.Module, opt: torch.optim.Optimizer, bucket_size: int,
             owner_group_size: int | None = None) -> LayerwiseDataParallel:
    """The wrapper with element-wise fill (and owner groups of ``owner_group_size``), as LayerwiseStrategy sets it up."""
    elementwise = elementwise_parameters(opt)
    groups = ProcessGroups.create(owner_group_size=owner_group_size)
    ddp = LayerwiseDataParallel(model, groups, bucket_size=bucket_size, prefetch_depth=1,
                                elementwise=lambda name, p: p in elementwise)
    ddp.use_shards_in(opt)
    return ddp


def backward_micro_batches(model: nn.Module, ddp: LayerwiseDataParallel | None, micro: list[torch.Tensor]) -> None:
    """The mean loss over ``micro`` backward, one micro-batch at a time: through ``ddp`` with every backward but
    the last inside ``no_sync``, or (``ddp`` None) through ``model`` alone."""
    for i, part in enumerate(micro):
        if ddp is not None and i < len(micro) - 1:
            with ddp.no_sync():
                (gpt_loss(ddp, part) / len(micro)).backward()
        else:
            (gpt_loss(ddp if ddp is not None else model, part) / len(micro)).backward()


@functools.cache
def gpt_reference_run(opt_name: str) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """One process on every batch of :func:`gpt_batches`: the parameters and the optimizer's state tensors."""
    model = gpt()
    opt = gpt_optimizer(opt_name, model)
    with reference_threads():
        for tokens in gpt_batches():
            opt.zero_grad()
            gpt_loss(model, tokens).backward()
            opt.step()
    return snapshot(model), [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]


def gpt_reference(opt_name: str) -> dict[str, torch.Tensor]:
    """The parameters after :func:`gpt_batches` in one process (seed 0, optimizer ``opt_name``)."""
    return gpt_reference_run(opt_name)[0]


# --- the example MoE GPT (engine/test_experts.py) --------------------------------------------------------------------

MOE_STEPS = 10
MOE_GLOBAL_BATCH = 8
MOE_SEQ = 8
MOE_VOCAB = 23
NUM_EXPERTS = 4


def moe_gpt(expert_parallel_size: int = 1, expert_rank: int = 0) -> nn.Module:
    from examples.moe import MoEGPT

    torch.manual_seed(0)  # every rank draws every expert's weights and keeps its own
    return MoEGPT(vocab_size=MOE_VOCAB, block_size=MOE_SEQ, n_layer=2, n_head=2, n_embd=16, num_experts=NUM_EXPERTS,
                  top_k=2, expert_parallel_size=expert_parallel_size, expert_rank=expert_rank)


def moe_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":  # AdamW and Muon are blind to a constant gradient scale; SGD checks the averaging rule
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    return Muon(muon_param_groups(model), lr=0.02, weight_decay=0.01, ns_dtype=torch.float32, adamw_lr=3e-3)


def moe_batches():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, MOE_VOCAB, (MOE_GLOBAL_BATCH, MOE_SEQ + 1), generator=g) for _ in range(MOE_STEPS)]


def moe_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def global_names(model: nn.Module, first_expert: int) -> dict[str, torch.Tensor]:
    """Parameters by the name they have in the one-process model (local expert j is expert first + j)."""
    def rename(name: str) -> str:
        return re.sub(r"experts\.(\d+)\.", lambda m: f"experts.{first_expert + int(m.group(1))}.", name)

    return {rename(n): p.detach().clone() for n, p in model.named_parameters()}


@functools.cache
def moe_reference(opt_name: str, epochs_of_half: bool = False) -> dict[str, torch.Tensor]:
    """One process holding every expert; ``epochs_of_half``: two epochs of the first MOE_STEPS // 2 batches."""
    model = moe_gpt()
    opt = moe_optimizer(opt_name, model)
    with reference_threads():
        for tokens in (moe_batches()[:MOE_STEPS // 2] * 2 if epochs_of_half else moe_batches()):
            opt.zero_grad()
            moe_loss(model, tokens).backward()
            opt.step()
    return global_names(model, 0)


def wrap_moe(groups: ProcessGroups, E: int, opt_name: str, bucket_size: int = 4096):
    """This rank's MoE GPT (its experts of ``E``), its optimizer and the wrapper, as the strategy sets them up."""
    model = moe_gpt(E, groups.expert_parallel_rank)
    check_expert_marks(model, E)
    model.set_expert_group(groups.expert_parallel)
    opt = moe_optimizer(opt_name, model)
    experts = expert_parameter_names(model)
    elementwise = elementwise_parameters(opt)
    ddp = LayerwiseDataParallel(model, groups, bucket_size=bucket_size, prefetch_depth=1,
                                expert=lambda n, p: n in experts, elementwise=lambda n, p: p in elementwise)
    ddp.use_shards_in(opt)
    return model, opt, ddp, experts


def train_moe(ddp: LayerwiseDataParallel, opt: torch.optim.Optimizer, rank: int, world: int,
              before_step=lambda: None) -> None:
    """Every batch of :func:`moe_batches`, this rank's rows of each; ``before_step`` runs at the start of each step."""
    for tokens in moe_batches():
        before_step()
        opt.zero_grad()
        moe_loss(ddp, tokens.chunk(world)[rank]).backward()
        ddp.finish_grad_sync()
        opt.step()
        ddp.start_param_sync()
    ddp.param_sync.finish()


# --- sharded parameters (engine/test_data_parallel.py, engine/test_sharded_parameters.py) ----------------------------

class TiedNet(nn.Module):
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


SHARDED_STEPS = 10
SHARDED_GLOBAL_BATCH = 12  # divisible by 2, 3 and 4; a rank's rows by its micro-batches (equal micro-batches)
SHARDED_VOCAB, SHARDED_SEQ = 23, 5


class CheckpointedAttentionNet(nn.Module):
    """Reads parameters outside their modules' forward on purpose; its encoder layer is checkpointed."""

    def __init__(self, d: int = 16, reentrant: bool = False):
        super().__init__()
        self.reentrant = reentrant
        self.emb = nn.Embedding(SHARDED_VOCAB, d)
        # No attention biases: the key bias's gradient is zero up to rounding, and AdamW scales that rounding up to
        # full-size steps, so it would differ from one process by far more than 1e-5 with or without sharding.
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True, bias=False)
        self.block = nn.TransformerEncoderLayer(d, 2, 24, dropout=0.0, batch_first=True, norm_first=True, bias=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, SHARDED_VOCAB)

    def forward(self, idx):
        penalty = 1e-3 * self.head.weight.square().sum()  # read before any module runs
        h = self.emb(idx)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        h = checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.head(self.norm(h)), penalty


def sharded_model(name: str):
    torch.manual_seed(0)
    return TiedNet() if name == "net" else CheckpointedAttentionNet(reentrant=name == "attention-reentrant")


def sharded_batches(name: str):
    g = torch.Generator().manual_seed(1)
    shape = (SHARDED_GLOBAL_BATCH,) if name == "net" else (SHARDED_GLOBAL_BATCH, SHARDED_SEQ)
    for _ in range(SHARDED_STEPS):
        idx = torch.randint(0, SHARDED_VOCAB, shape, generator=g)
        yield idx, (idx * 7 + 3) % SHARDED_VOCAB


def sharded_loss(model, idx, target):
    out = model(idx)
    logits, penalty = out if isinstance(out, tuple) else (out, 0.0)
    return F.cross_entropy(logits.reshape(-1, SHARDED_VOCAB), target.reshape(-1)) + penalty


def sharded_optimizer(name: str, model: nn.Module):
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return llw.Muon(llw.muon_param_groups(model), lr=0.02, weight_decay=0.01, ns_dtype=torch.float32,
                    adamw_lr=1e-2)


def nothing_full(wrapper) -> bool:
    """No bucket's full parameters or full gradient buffer (its own, or autograd's gradient taken as it) is held."""
    return not any(b.param.state is not ParamState.FREED or is_allocated(b.param.data) or is_allocated(b.grad.data)
                   or b.grad.taken is not None for b in wrapper.buckets)


# --- models that read parameters outside their modules' forward (engine/test_stale_reads.py) -------------------------

READ_STEPS = 4


class AttentionBlock(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))

    def forward(self, h):
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return h + self.ff(h)


class AttentionNet(nn.Module):
    """Hand-written blocks around ``nn.MultiheadAttention`` (which never calls ``out_proj``)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([AttentionBlock(16, 32), AttentionBlock(16, 32)])
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class ParentReadsChild(nn.Module):
    """The parent uses ``child.proj``'s weight and bias directly; ``child`` is never called.

    ``child`` is registered last, so at 2 ranks its bias lands in the last bucket.
    """

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(20, 3)
        self.child = nn.Module()
        self.child.proj = nn.Linear(16, 20)

    def forward(self, x):
        h = self.mid(self.emb(x)).tanh()
        h = F.linear(h, self.child.proj.weight, self.child.proj.bias).tanh()
        return self.head(h)


class Symmetric(nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).transpose(0, 1)


class Parametrized(nn.Module):
    """A weight computed by a parametrization from ``parametrizations.weight.original``."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(8, 16)
        self.sym = nn.Linear(16, 16)
        parametrize.register_parametrization(self.sym, "weight", Symmetric())
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.sym(self.emb(x)).tanh())


class MLP(nn.Module):
    """Calls every module it uses: the pre-hooks alone keep it correct, strict mode stays silent."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x):
        return self.layers(x)


def example_gpt():
    from examples.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=11, n_layer=2, n_head=2, n_embd=16, block_size=16))


def demo_transformer():
    return Transformer(vocab_size=33, ninp=32, nhead=2, nhid=64, nlayers=2, dropout=0.0)


# case -> (model factory, bucket size, L2 penalty before the forward, parameter strict mode must name)
READ_CASES = {
    "transformer_default": (demo_transformer, None, False, None),
    "transformer_512": (demo_transformer, 512, False, "out_proj"),
    "transformer_1024": (demo_transformer, 1024, False, None),
    "attention": (AttentionNet, 64, False, "blocks.0.attn.out_proj"),
    "parent_reads_child": (ParentReadsChild, 64, False, "child.proj"),
    "parametrize": (Parametrized, 64, False, None),
    "l2_before_forward": (MLP, 64, True, "layers"),
    "mlp": (MLP, 64, False, None),
    "example_gpt": (example_gpt, 256, False, None),
}


def read_batches(case: str, world: int, steps: int):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        if case.startswith("transformer"):
            tokens = torch.randint(0, 33, (6, 7), generator=g)
            out.append(((tokens, (tokens * 5 + 1) % 33), (tokens * 5 + 2) % 33))
        elif case == "example_gpt":
            tokens = torch.randint(0, 11, (6, 16), generator=g)
            out.append(((tokens,), (tokens * 3 + 1) % 11))
        else:
            x = torch.randn(6, 5, 8, generator=g)
            out.append(((x,), torch.randn(6, 5, 3, generator=g)))
    return out


def read_loss(case: str, model: nn.Module, inputs, target, penalty: bool):
    reg = sum(p.square().sum() for p in model.parameters()) * 1e-3 if penalty else None  # before the forward
    out = model(*inputs)
    if case.startswith("transformer"):
        loss = F.nll_loss(out, target.reshape(-1))
    elif case == "example_gpt":
        loss = F.cross_entropy(out[0].flatten(0, 1), target.reshape(-1))
    else:
        loss = F.mse_loss(out, target)
    return loss if reg is None else loss + reg, reg


def local_part(batch, rank: int, world: int):
    inputs, target = batch
    return tuple(t.chunk(world)[rank] for t in inputs), target.chunk(world)[rank]


def read_optimizer(params):
    # SGD, not Adam: the key bias of attention has a gradient that is zero in exact arithmetic, and
    # Adam would scale its rounding noise up to +-lr, which no two summation orders agree on.
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


@functools.cache
def read_reference(case: str, world: int):
    with reference_threads():
        return _read_reference_run(case, world)


def _read_reference_run(case: str, world: int):
    factory, _, penalty, _ = READ_CASES[case]
    torch.manual_seed(0)
    model = factory()
    opt = read_optimizer(model.parameters())
    regs = []
    for inputs, target in read_batches(case, world, READ_STEPS):
        opt.zero_grad()
        loss, reg = read_loss(case, model, inputs, target, penalty)
        loss.backward()
        opt.step()
        regs.append(None if reg is None else reg.item())
    return {n: p.detach().clone() for n, p in model.named_parameters()}, regs


# --- checkpoints that reshard (checkpoint/test_checkpoint_resharding.py) ---------------------------------------------

CKPT_GLOBAL_BATCH = 12
CKPT_STEPS = 3  # steps per epoch; checkpoints are written after epoch 1, runs end after 2 epochs
CKPT_TOL = 1e-5


class CkptNet(L.LightningModule):
    def __init__(self, optimizer: str = "adamw"):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.inp = nn.Linear(5, 24)
        self.hidden = nn.Linear(24, 24)
        self.norm = nn.LayerNorm(24)
        self.out = nn.Linear(24, 2)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.losses: list[float] = []

    def forward(self, x):
        return self.out(self.norm(self.hidden(self.inp(x).tanh()).tanh()))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.calls += 1
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        if self.hparams.optimizer == "adamw":
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        else:  # "muon", or "normuon": NorMuon's per-row second moments are state that must reshard too
            opt = llw.Muon(llw.muon_param_groups(self), lr=0.01 if self.hparams.optimizer == "normuon" else 0.02,
                           adamw_lr=1e-2, ns_dtype=torch.float32, normuon=self.hparams.optimizer == "normuon")
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class RankSlices(torch.utils.data.Dataset):
    """Item i is this rank's slice of global batch i."""

    def __init__(self, steps: int = CKPT_STEPS):
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(steps, CKPT_GLOBAL_BATCH, 5, generator=g)
        self.y = torch.stack([self.x[..., 0] * self.x[..., 1], self.x[..., 2:].sum(-1)], dim=-1)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        return self.x[i][rank::world], self.y[i][rank::world]


def ckpt_trainer(world: int, strategy="layerwise", fmt: str = "sharded", bucket_size: int = 40_000_000,
                 callbacks=(), max_steps: int = 2 * CKPT_STEPS, owner_group_size="auto",
                 fill: bool = True) -> L.Trainer:
    if strategy == "layerwise":
        strategy = llw.LayerwiseStrategy(checkpoint_format=fmt, bucket_size=bucket_size,
                                         owner_group_size=owner_group_size, elementwise_fill=fill)
    return L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=max_steps, logger=False,
                     enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
                     callbacks=list(callbacks), enable_progress_bar=False,
                     enable_model_summary=False, use_distributed_sampler=False)


def ckpt_loader():
    return torch.utils.data.DataLoader(RankSlices(), batch_size=None, shuffle=False)


def global_losses(model: CkptNet) -> list[float]:
    """Per-step loss of the global batch: the mean of the ranks' (equal-sized) slice losses."""
    losses = torch.tensor(model.losses, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(losses)
        losses /= dist.get_world_size()
    return losses.tolist()


def ckpt_result(model: CkptNet) -> dict:
    llw.release(model)  # a sharded run goes on after fit: ended here, every parameter whole (a no-op otherwise)
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "calls": int(model.calls), "losses": global_losses(model)}


def ckpt_run_worker(rank, world, optimizer, strategy, fmt, dirpath, bucket_size=40_000_000, owner_group_size="auto"):
    """The uninterrupted run of 2 epochs; ModelCheckpoint writes ``step=3.ckpt`` after the first."""
    model = CkptNet(optimizer)
    save = ModelCheckpoint(dirpath=dirpath, filename="{step}", every_n_train_steps=CKPT_STEPS, save_top_k=-1)
    seen = {}

    class Inspect(L.Callback):
        def on_train_start(self, trainer, pl_module):
            ranks = getattr(getattr(trainer.strategy, "wrapper", None), "ranks", None)
            seen["owner_group_size"] = None if ranks is None else ranks.owner_group_size

    trainer = ckpt_trainer(world, strategy, fmt, bucket_size, callbacks=[save, Inspect()],
                           owner_group_size=owner_group_size)
    trainer.fit(model, ckpt_loader())
    return {**ckpt_result(model), **seen}


def assert_continues(reference: dict, resumed: dict, what: str) -> None:
    """The resumed run's parameters and per-step losses equal the uninterrupted run's second epoch."""
    for name, value in resumed["params"].items():
        err = rel_err(value, reference["params"][name])
        assert err <= CKPT_TOL, f"{what}: {name} differs by {err:.2e}"
    assert len(resumed["losses"]) == CKPT_STEPS, f"{what}: resumed for {len(resumed['losses'])} steps, not {CKPT_STEPS}"
    for step, (got, want) in enumerate(zip(resumed["losses"], reference["losses"][CKPT_STEPS:]), start=CKPT_STEPS + 1):
        assert abs(got - want) <= CKPT_TOL * abs(want), f"{what}: loss at step {step}: {got} vs {want}"
    assert resumed["calls"] == reference["calls"], "the module buffer was restored from the checkpoint"


def assert_at_checkpoint(reference_at_k: dict, resumed: dict, what: str) -> None:
    """Right after loading, every rank holds the checkpoint's parameters (synced after load)."""
    for name, value in resumed["params_at_start"].items():
        err = rel_err(value, reference_at_k[name])
        assert err <= CKPT_TOL, f"{what}: {name} right after loading differs from the saved one by {err:.2e}"


def saved_params(path: str) -> dict:
    """The parameters a checkpoint holds, read with torch.distributed.checkpoint or torch.load."""
    if os.path.isdir(path):
        from lightning.fabric.utilities.load import _load_distributed_checkpoint
        from pathlib import Path

        return _load_distributed_checkpoint(Path(path))["model"]
    return torch.load(path, weights_only=True)["state_dict"]


# --- launching tests/launch_script.py (lightning/test_launch.py) -----------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_SCRIPT = str(ROOT / "tests" / "launch_script.py")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_", "PL_")) and k not in
           ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
            "LOCAL_WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **extra)
    return env


# --- a small language model under the Trainer (test_sharded_trainer.py, test_sharded_after_fit.py) ---

TINY_LM_VOCAB, TINY_LM_SEQ, TINY_LM_D = 29, 6, 16
TINY_LM_BATCH = 12
TINY_LM_STEPS = 10


class TinyLM(L.LightningModule):
    def __init__(self, optimizer: str = "adamw", activation_checkpointing: bool = False,
                 compile_blocks: str | None = None):
        super().__init__()
        self.optimizer_name, self.activation_checkpointing = optimizer, activation_checkpointing
        torch.manual_seed(0)
        self.wte = nn.Embedding(TINY_LM_VOCAB, TINY_LM_D)
        # no attention biases: the key bias's gradient is zero up to rounding, which AdamW scales to full steps
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(TINY_LM_D, 2, 32, dropout=0.0, batch_first=True,
                                                               norm_first=True, bias=False) for _ in range(2))
        if compile_blocks is not None:  # torch.compile of each block, as users compile transformer blocks
            self.blocks = nn.ModuleList(torch.compile(b, backend=compile_blocks) for b in self.blocks)
        self.norm = nn.LayerNorm(TINY_LM_D)
        self.unused = nn.Linear(3, 3)
        self.head = nn.Linear(TINY_LM_D, TINY_LM_VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx):
        h = self.wte(idx)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if self.activation_checkpointing else block(h)
        return self.head(self.norm(h))

    def training_step(self, batch, batch_idx):
        x, y = batch
        penalty = 1e-3 * self.blocks[0].linear1.weight.square().sum()  # read before the forward
        loss = F.cross_entropy(self(x).reshape(-1, TINY_LM_VOCAB), y.reshape(-1)) + penalty
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x).reshape(-1, TINY_LM_VOCAB), y.reshape(-1)), sync_dist=True)

    def configure_optimizers(self):
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        return llw.Muon(llw.muon_param_groups(self), lr=0.02, adamw_lr=1e-2, ns_dtype=torch.float32)


def tiny_lm_loader(world: int, accumulate: int) -> DataLoader:
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, TINY_LM_VOCAB, (TINY_LM_BATCH * TINY_LM_STEPS * accumulate, TINY_LM_SEQ), generator=g)
    return DataLoader(TensorDataset(x, (x * 5 + 1) % TINY_LM_VOCAB), batch_size=TINY_LM_BATCH // world)
