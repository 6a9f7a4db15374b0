"""Train the example GPT with a plain torch loop: no Lightning, only ``lightning_layerwise``'s session.

Run from the repository root (after ``bash scripts/setup_env.sh test``)::

    # 2 CPU processes (gloo), a minute or so
    .venv/bin/torchrun --nproc-per-node 2 examples/torch_train.py --steps 100

    # 8 GPUs (NCCL), Muon for the matrices and AdamW for the rest; a sharded checkpoint at the end
    torchrun --nproc-per-node 8 examples/torch_train.py --steps 2000 --optimizer muon --save runs/torch.ckpt
    torchrun --nproc-per-node 8 examples/torch_train.py --normuon --split-qkv heads --qk-clip-tau 100

The loop is what a ``DistributedDataParallel`` user writes, with a ``LayerwiseSession`` around
it: ``session.wrap(model, optimizer)`` (the layout splits what the optimizer updates
element-wise; rank 0's parameters are broadcast), ``zero_grad``, forward,
``session.backward(loss)`` (each rank then holds the averaged gradient of what it owns),
``torch.nn.utils.clip_grad_norm_`` over the model's parameters (the norm of the full gradient,
on every rank), ``session.step(optimizer)`` (each rank steps only what it owns, then starts the
all-gather that the next forward waits for, bucket by bucket). The text is the Python standard
library's source, read character by character; every rank reads its own rows of each global batch.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning_layerwise as llw  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402


def make_optimizer(name: str, model: torch.nn.Module, **muon_options) -> torch.optim.Optimizer:
    if name == "muon":
        options = {"lr": 0.02, "adamw_lr": 3e-3, "adamw_weight_decay": 0.1, **muon_options}
        return llw.Muon(llw.muon_param_groups(model), **options)
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches, rank: int, world: int,
          max_norm: float = 1.0, save: str | None = None, resume: str | None = None,
          **options) -> tuple[list[float], list[float]]:
    """The training loop: ``batches`` are global batches of tokens, each rank takes its rows. Returns each
    step's loss on this rank's rows and the norm of the full gradient before clipping (the same on every
    rank). ``options``: :class:`lightning_layerwise.LayerwiseConfig` settings. ``resume``: a checkpoint to
    start from (it says how many of ``batches`` were done); ``save``: where to write one at the end.
    Collective: every rank calls it."""
    session = llw.LayerwiseSession(llw.LayerwiseConfig(**options))  # world and rank from torch.distributed
    wrapped = session.wrap(model, optimizer)  # broadcasts rank 0's parameters
    done = session.load_checkpoint(resume)["step"] if resume else 0
    losses, norms = [], []
    for step, tokens in enumerate(batches):
        if step < done:
            continue
        mine = tokens.chunk(world)[rank]
        optimizer.zero_grad()
        _, loss = wrapped(mine[:, :-1], mine[:, 1:])
        session.backward(loss)
        losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        session.step(optimizer)
        done = step + 1
    if save:
        session.save_checkpoint(save, step=done)
    session.release()  # waits for the last all-gather; the model is an ordinary module again
    return losses, norms


def text_batches(steps: int, batch: int, block: int, seed: int = 0, limit: int = 2_000_000):
    """``steps`` global batches of ``block + 1`` characters (bytes) from the standard library's source."""
    text = bytearray()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text += path.read_bytes()
        if len(text) >= limit:
            break
    data = torch.frombuffer(text, dtype=torch.uint8).long()
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - block - 1, (batch,), generator=g)
        yield torch.stack([data[s:s + block + 1] for s in starts.tolist()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=32, help="global batch (rows), divisible by the world size")
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--optimizer", choices=("adamw", "muon"), default="muon")
    parser.add_argument("--normuon", action="store_true", help="Muon with NorMuon's per-row normalization (lr 0.01)")
    parser.add_argument("--split-qkv", choices=("none", "qkv", "heads"), default="none",
                        help="how Muon sees each fused QKV weight: one matrix, three, or one per head")
    parser.add_argument("--qk-clip-tau", type=float, help="QK-clip: rescale the heads whose logits exceed this")
    parser.add_argument("--save", help="write a checkpoint here at the end (a directory: each rank writes its part)")
    parser.add_argument("--resume", help="continue from this checkpoint (any world size)")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, n_layer=4, n_head=4, n_embd=128, block_size=args.block,
                          split_qkv=args.split_qkv, qk_clip=args.qk_clip_tau is not None)).to(device)
    muon_options = {"normuon": True, "lr": 0.01} if args.normuon else {}
    optimizer = make_optimizer(args.optimizer, model, **muon_options)
    if args.qk_clip_tau is not None:  # after every optimizer step, on the ranks stepping the query and key rows
        llw.QKClip(model, tau=args.qk_clip_tau).attach(optimizer)
    start = time.perf_counter()
    batches = (t.to(device) for t in text_batches(args.steps, args.batch, args.block))
    losses, norms = train(model, optimizer, batches, rank, world, save=args.save, resume=args.resume)
    if rank == 0 and losses:
        print(f"{len(losses)} steps at {world} processes in {time.perf_counter() - start:.0f} s; loss "
              f"{losses[0]:.2f} at the first, {losses[-1]:.2f} at the last (rank 0's rows)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
