"""Train the example character-level GPT with a plain Lightning Fabric loop, ``strategy="layerwise"``
and ``lightning_layerwise.Muon``.

Run from the repository root (after ``bash scripts/setup_env.sh examples``)::

    # 2 CPU processes, about a minute
    .venv/bin/python examples/fabric_train.py --accelerator cpu --devices 2 --max-steps 200

    # one machine with 8 GPUs, bf16 autocast, two micro-batches per step
    python examples/fabric_train.py --accelerator cuda --devices 8 --precision bf16-mixed --grad-accum 2

    # the same script under torchrun, `fabric run` or SLURM (Fabric reads the cluster environment)
    torchrun --nproc-per-node 8 examples/fabric_train.py --accelerator cuda --devices 8
    fabric run --accelerator cuda --devices 8 examples/fabric_train.py --accelerator cuda --devices 8
    srun python examples/fabric_train.py --accelerator cuda --devices 8 --num-nodes 2

    # stop, then continue from the last checkpoint, on any number of processes
    .venv/bin/python examples/fabric_train.py --devices 3 --max-steps 300 --resume runs/fabric/last.ckpt

Each step: ``--grad-accum`` micro-batches (all but the last inside
``fabric.no_backward_sync``), ``fabric.backward``, ``fabric.clip_gradients`` by the global
norm, ``optimizer.step()``. Validation loss and accuracy are torchmetrics, reduced
across processes. A sharded checkpoint (model, optimizer, step) is written every
``--val-every`` steps and at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torchmetrics.aggregation import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning_layerwise as llw  # noqa: E402  (also registers strategy="layerwise" with Fabric)
from examples.data import CharDataModule  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--accelerator", default="cpu", choices=["cpu", "cuda", "gpu", "auto"])
    p.add_argument("--devices", type=int, default=2, help="processes per node")
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--precision", default="32-true",
                   help="32-true, bf16-mixed, 16-mixed, bf16-true, 16-true or 64-true")
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16, help="windows per micro-batch per process")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip (0: none)")
    p.add_argument("--val-every", type=int, default=100)
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--max-chars", type=int, default=2_000_000)
    p.add_argument("--lr", type=float, default=0.02, help="Muon's learning rate")
    p.add_argument("--adamw-lr", type=float, default=3e-3, help="the AdamW groups' learning rate")
    p.add_argument("--checkpoint-format", default="auto", choices=["auto", "sharded", "full"])
    p.add_argument("--out", default="runs/fabric", help="where checkpoints go")
    p.add_argument("--resume", default=None, help="a checkpoint written by this script (any world size)")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    if args.grad_accum < 1 or args.max_steps < 1 or args.val_every < 1:
        p.error("--grad-accum, --max-steps and --val-every must be >= 1")
    return args


def _launched_by_fabric_cli() -> bool:
    from lightning.fabric.connector import _is_using_cli

    return _is_using_cli()


@torch.no_grad()
def validate(fabric: Fabric, model, loader, batches: int, vocab_size: int) -> tuple[float, float]:
    model.eval()
    loss = MeanMetric().to(fabric.device)
    accuracy = MulticlassAccuracy(num_classes=vocab_size, average="micro").to(fabric.device)
    for i, (x, y) in enumerate(loader):
        if i == batches:
            break
        logits, _ = model(x)
        loss.update(F.cross_entropy(logits.flatten(0, 1), y.flatten()))
        accuracy.update(logits.flatten(0, 1), y.flatten())
    model.train()
    return loss.compute().item(), accuracy.compute().item()  # compute() reduces over the processes


def main(argv=None) -> dict:
    args = parse_args(argv)
    strategy = llw.LayerwiseFabricStrategy(bucket_size=200_000, checkpoint_format=args.checkpoint_format)
    fabric = Fabric(accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes,
                    strategy=strategy, precision=args.precision)
    if not _launched_by_fabric_cli():  # `fabric run` has started the processes already
        fabric.launch()
    fabric.seed_everything(args.seed)

    data = CharDataModule(block_size=args.block_size, batch_size=args.batch_size, max_chars=args.max_chars,
                          seed=args.seed)
    data.setup("fit")
    train_loader, val_loader = fabric.setup_dataloaders(data.train_dataloader(), data.val_dataloader())

    config = GPTConfig(vocab_size=data.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                       n_head=max(1, args.n_embd // 32), n_embd=args.n_embd)
    model = GPT(config)
    # Muon for the hidden matrices, AdamW for embeddings, norms and biases: one optimizer, several groups.
    optimizer = llw.Muon(llw.muon_param_groups(model), lr=args.lr, momentum=0.95, adamw_lr=args.adamw_lr)
    model, optimizer = fabric.setup(model, optimizer)

    state = {"model": model, "optimizer": optimizer, "step": 0}
    if args.resume:
        fabric.load(args.resume, state)
        fabric.print(f"resumed from {args.resume} at step {state['step']} on {fabric.world_size} processes")

    fabric.print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {fabric.world_size} "
                 f"processes, {args.grad_accum} x {args.batch_size} windows per process per step")
    results: dict = {"val": []}
    batches = iter(train_loader)
    start = time.perf_counter()
    while state["step"] < args.max_steps:
        optimizer.zero_grad()
        total = 0.0
        for micro in range(args.grad_accum):
            try:
                x, y = next(batches)
            except StopIteration:
                batches = iter(train_loader)
                x, y = next(batches)
            # Only the last micro-batch's backward reduces the accumulated gradients.
            with fabric.no_backward_sync(model, enabled=micro < args.grad_accum - 1):
                _, loss = model(x, y)
                fabric.backward(loss / args.grad_accum)
            total += loss.item() / args.grad_accum
        norm = fabric.clip_gradients(model, optimizer, max_norm=args.clip) if args.clip > 0 else None
        optimizer.step()
        state["step"] += 1
        step = state["step"]
        if step % 10 == 0:
            norm_text = f", grad norm {norm.item():.3f}" if norm is not None else ""
            fabric.print(f"step {step}: train loss {total:.4f}{norm_text}")
        if step % args.val_every == 0 or step == args.max_steps:
            val_loss, val_acc = validate(fabric, model, val_loader, args.val_batches, data.vocab_size)
            results["val"].append((step, val_loss, val_acc))
            fabric.print(f"step {step}: val loss {val_loss:.4f}, val accuracy {val_acc:.1%} "
                         f"({time.perf_counter() - start:.0f} s)")
            fabric.save(os.path.join(args.out, "last.ckpt"), state)
    fabric.strategy.teardown()  # waits for the last all-gather and frees the process groups
    results["final_val_loss"] = results["val"][-1][1]
    return results


if __name__ == "__main__":
    main()
