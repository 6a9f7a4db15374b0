"""GPU benchmark of the layer-wise optimizer: matmul peak, Newton–Schulz, a GPT-2-small step, dp=8 Muon.

Run on a machine with one NVIDIA GPU (about 2 minutes on an H100)::

    python3 benchmarks/bench_gpu.py                 # writes benchmarks/results/gpu.json and gpu.md
    python3 benchmarks/bench_gpu.py --quick --device cpu --out /tmp/x   # seconds; a smoke test

Sections, all in one run and one process (CUDA events, warm-ups, medians of repeats):

peak
    The bf16 matmul throughput this GPU reaches in this run (``8192^3``), the
    yardstick for the Newton–Schulz numbers.
newton_schulz
    The package's batched :func:`lightning_layerwise.optim.newton_schulz` (5
    iterations, bf16) on stacks of Llama-3-8B-like matrices. FLOPs per iteration
    for an ``(m, n)`` matrix with ``m <= n`` (a tall matrix is transposed first):
    ``X X^T`` 2m²n, ``A A`` 2m³, ``B X`` 2m²n. Reported as TFLOP/s and as a
    fraction of the measured peak (target >= 0.5).
muon_step
    One optimizer step of :class:`lightning_layerwise.Muon` (batched) against
    ``torch.optim.Muon`` (per matrix, when this torch has it) on the same float32
    matrices and gradients.
gpt
    GPT-2 small (``examples/gpt.py``: 12 layers, d=768, 12 heads, vocab 50304,
    seq 1024, batch 8, bf16 autocast, AdamW) step time (forward + backward +
    optimizer step) and peak memory for: plain single-device training; the
    layer-wise wrapper with ``ProcessGroups.single()`` (no communication) and
    with real one-rank process groups (NCCL); ``DistributedDataParallel`` on a
    one-rank NCCL group. Target: layer-wise <= 1.02x plain. With ``--profile``,
    also each variant's aten operations per step, counted (untimed) with
    ``lightning_layerwise.testing.op_counts.OpCounts``: calls in all, device
    copies (``aten.copy_``, ``aten.clone``), the copies that touch the wrapper's
    buffers, and the most frequent operations.
optimizer_dp8
    The optimizer step of the busiest rank at a simulated dp=8: a stack of 4
    Llama-3-8B layers with embeddings and head is planned with
    ``plan_layout(param_specs(model), 8, bucket_size, cost)``; every rank's owned
    parameters are stepped by one :class:`lightning_layerwise.Muon` (as in
    training: a rank holds gradients only for what it owns) and compared with
    the replicated step over all parameters. Planned with the wrapper's default
    cost (``newton_schulz_cost``) and with a cost that follows the Muon/AdamW
    routing.

Without CUDA (``--device cpu``) the NCCL variants run over gloo and the note in
the output says so; the CPU numbers are a smoke test, not measurements.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "examples"))

import lightning_layerwise as llw  # noqa: E402
from lightning_layerwise.layout import (  # noqa: E402
    DEFAULT_BUCKET_SIZE,
    ParamSpec,
    newton_schulz_cost,
    numel_cost,
    param_specs,
)
from lightning_layerwise.optim import muon_param_groups, newton_schulz, route_parameters  # noqa: E402
from lightning_layerwise.testing.op_counts import BUFFER_COPIES, OpCounts  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.harness import summary, time_ms  # noqa: E402

NS_STEPS = 5
NS_TARGET = 0.5
WRAPPER_TARGET = 1.02


# --- memory --------------------------------------------------------------------------------------------------------

def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


# --- a. matmul peak --------------------------------------------------------------------------------------------------

def bench_peak(device: torch.device, quick: bool) -> dict:
    n = 256 if quick else 8192
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=g)
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    samples = time_ms(lambda: torch.matmul(a, b, out=c), device, warmup=2 if quick else 5,
                      repeats=3 if quick else 10, inner=2 if quick else 10)
    flops = 2 * n ** 3
    tflops = [flops / (ms * 1e-3) / 1e12 for ms in samples]
    del a, b, c
    return {"n": n, "dtype": "bfloat16", **summary(samples), "tflops_median": statistics.median(tflops),
            "tflops_max": max(tflops)}


# --- b. Newton–Schulz and Muon steps -------------------------------------------------------------------------------

def ns_flops(m: int, n: int, steps: int = NS_STEPS) -> int:
    """FLOPs of ``steps`` Newton–Schulz iterations on one (m, n) matrix (transposed first if tall)."""
    m, n = min(m, n), max(m, n)
    per_iteration = 2 * m * m * n + 2 * m ** 3 + 2 * m * m * n  # X X^T, A A, B X
    return steps * per_iteration


def ns_shapes(quick: bool) -> list[tuple[int, int, int]]:
    """(rows, cols, batch): Llama-3-8B's attention, MLP and GQA key/value matrices, stacked as Muon batches them."""
    if quick:
        return [(64, 64, 4), (64, 224, 2), (224, 64, 2), (16, 64, 4)]
    return [(4096, 4096, 8), (4096, 14336, 4), (14336, 4096, 4), (1024, 4096, 8)]


def bench_newton_schulz(device: torch.device, quick: bool, peak_tflops: float) -> dict:
    rows = []
    total_flops, total_ms = 0, 0.0
    g = torch.Generator(device=device).manual_seed(1)
    for m, n, batch in ns_shapes(quick):
        G = torch.randn(batch, m, n, device=device, dtype=torch.bfloat16, generator=g)
        def run(G=G):
            return newton_schulz(G, steps=NS_STEPS, coefficients="simple", eps=1e-7, dtype=torch.bfloat16)

        samples = time_ms(run, device, warmup=1 if quick else 3, repeats=2 if quick else 7)
        flops = batch * ns_flops(m, n)
        med = statistics.median(samples)
        tflops = flops / (med * 1e-3) / 1e12
        rows.append({"shape": [m, n], "batch": batch, "flops": flops, **summary(samples), "tflops": tflops,
                     "fraction_of_peak": tflops / peak_tflops})
        total_flops += flops
        total_ms += med
        del G
    overall = total_flops / (total_ms * 1e-3) / 1e12
    return {"ns_steps": NS_STEPS, "coefficients": "simple", "dtype": "bfloat16", "rows": rows,
            "overall_tflops": overall, "overall_fraction_of_peak": overall / peak_tflops,
            "target_fraction": NS_TARGET, "target_met": overall / peak_tflops >= NS_TARGET}


def bench_muon_step(device: torch.device, quick: bool) -> dict:
    """``llw.Muon`` (batched Newton–Schulz) vs ``torch.optim.Muon`` on the same float32 matrices and gradients."""
    g = torch.Generator(device=device).manual_seed(2)
    params = []
    for m, n, batch in ns_shapes(quick):
        for _ in range(batch):
            p = nn.Parameter(torch.randn(m, n, device=device, generator=g) * 0.02)
            p.grad = torch.randn(m, n, device=device, generator=g)
            params.append(p)
    warmup, repeats = (1, 2) if quick else (2, 5)
    hyper = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0, ns_steps=NS_STEPS)
    ours = llw.Muon(params, **hyper, adjust_lr="original")
    result = {"n_matrices": len(params), "ns_steps": NS_STEPS}
    result["layerwise_muon"] = summary(time_ms(ours.step, device, warmup, repeats))
    ours.state.clear()
    torch_muon = getattr(torch.optim, "Muon", None)
    if torch_muon is None:
        result["torch_muon"] = None
        result["note"] = f"torch {torch.__version__} has no torch.optim.Muon"
    else:
        wanted = dict(lr=hyper["lr"], weight_decay=0.0, momentum=hyper["momentum"], nesterov=True,
                      ns_steps=NS_STEPS)
        accepted = inspect.signature(torch_muon.__init__).parameters
        theirs = torch_muon(params, **{k: v for k, v in wanted.items() if k in accepted})
        result["torch_muon"] = summary(time_ms(theirs.step, device, warmup, repeats))
        result["speedup_vs_torch"] = result["torch_muon"]["median_ms"] / result["layerwise_muon"]["median_ms"]
        theirs.state.clear()
    del params
    return result


# --- c. GPT-2 small step ---------------------------------------------------------------------------------------------

def gpt_config(quick: bool, batch: int | None = None) -> tuple[GPTConfig, int]:
    if quick:
        return GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=32), batch or 2
    return GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768), batch or 8


class World1:
    """A one-rank default process group (NCCL on CUDA, gloo on CPU) for the DDP and NCCL-wrapper variants."""

    def __init__(self, device: torch.device):
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.tmp = tempfile.TemporaryDirectory()
        self.owned = False
        if not dist.is_initialized():
            store = dist.FileStore(os.path.join(self.tmp.name, "store"), 1)
            dist.init_process_group(self.backend, store=store, rank=0, world_size=1, timeout=timedelta(seconds=300))
            self.owned = True

    def groups(self) -> llw.ProcessGroups:
        return llw.ProcessGroups(dp=dist.new_group([0], backend=self.backend),
                                 dp_all_gather=dist.new_group([0], backend=self.backend))

    def close(self) -> None:
        if self.owned and dist.is_initialized():
            dist.destroy_process_group()
        self.tmp.cleanup()


def _gpt_variant(name: str, config: GPTConfig, device: torch.device, world: World1):
    """Builds the model (same seed every time) and returns ``(step_fn, loss_of_first_forward, holder)``."""
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(config)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    if name == "plain":
        runner = model
    elif name == "layerwise_single":
        runner = llw.LayerwiseDataParallel(model, process_groups=llw.ProcessGroups.single())
    elif name == "layerwise_pg1":
        runner = llw.LayerwiseDataParallel(model, process_groups=world.groups())
    elif name == "ddp_pg1":
        from torch.nn.parallel import DistributedDataParallel

        runner = DistributedDataParallel(model, device_ids=[device.index or 0] if device.type == "cuda" else None)
    else:
        raise ValueError(name)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95))
    layerwise = isinstance(runner, llw.LayerwiseDataParallel)
    losses: list[torch.Tensor] = []

    def step(idx, targets):
        with autocast:
            _, loss = runner(idx, targets)
        loss.backward()
        if layerwise:
            runner.finish_grad_sync()
            opt.step()
            runner.start_param_sync()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        if len(losses) < 3:
            losses.append(loss.detach())

    return step, losses, (model, runner, opt)


GPT_VARIANTS = ("plain", "layerwise_single", "layerwise_pg1", "ddp_pg1")


def gpt_batch(config: GPTConfig, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The one batch every GPT step runs on: tokens and targets."""
    g = torch.Generator(device=device).manual_seed(3)
    idx = torch.randint(0, config.vocab_size, (batch, config.block_size), device=device, generator=g)
    targets = torch.randint(0, config.vocab_size, (batch, config.block_size), device=device, generator=g)
    return idx, targets


PROFILE_WARMUP, PROFILE_STEPS, PROFILE_TOP = 3, 2, 8


def profile_gpt(device: torch.device, quick: bool, world: World1, batch: int | None = None) -> dict:
    """``--profile``: each GPT variant's aten operations per steady-state step (after warm-up steps), untimed."""
    config, batch = gpt_config(quick, batch)
    idx, targets = gpt_batch(config, batch, device)
    profiles = {}
    for name in GPT_VARIANTS:
        free_memory(device)
        step, losses, (model, runner, opt) = _gpt_variant(name, config, device, world)
        for _ in range(PROFILE_WARMUP):
            step(idx, targets)
        counts = OpCounts()
        if isinstance(runner, llw.LayerwiseDataParallel):
            counts.watch(runner)
        with counts:
            for _ in range(PROFILE_STEPS):
                counts.mark()
                step(idx, targets)
            counts.mark()
        if isinstance(runner, llw.LayerwiseDataParallel):
            runner.param_sync.finish()
        per_step = counts.per_step(0, PROFILE_STEPS)
        buffer_copies = per_step.pop(BUFFER_COPIES, 0)
        profiles[name] = {"ops": sum(per_step.values()), "copy_": per_step.get("aten.copy_", 0),
                          "clone": per_step.get("aten.clone", 0), "buffer_copies": buffer_copies,
                          "parameters": sum(1 for _ in model.parameters()),
                          "top": dict(per_step.most_common(PROFILE_TOP))}
        del step, losses, model, runner, opt
    free_memory(device)
    return profiles


def profile_table(profiles: dict) -> str:
    """``--profile``'s table: one row per variant."""
    rows = [[name, fmt(p["ops"], "g"), fmt(p["copy_"], "g"), fmt(p["clone"], "g"),
             fmt(p["buffer_copies"], "g"), str(p["parameters"]),
             ", ".join(f"{op.removeprefix('aten.')} {n:g}" for op, n in p["top"].items())]
            for name, p in profiles.items()]
    return harness.markdown_table(["variant", "ops/step", "copy_/step", "clone/step", "buffer copies/step",
                                   "parameters", "most frequent ops/step"], rows)


def bench_gpt(device: torch.device, quick: bool, world: World1, batch: int | None = None) -> dict:
    config, batch = gpt_config(quick, batch)
    idx, targets = gpt_batch(config, batch, device)
    warmup, repeats, rounds = (1, 2, 1) if quick else (4, 15, 2)
    samples: dict[str, list[float]] = {v: [] for v in GPT_VARIANTS}
    peaks: dict[str, int | None] = {}
    first_loss: dict[str, float] = {}
    n_params = None
    for r in range(rounds):
        order = GPT_VARIANTS if r % 2 == 0 else tuple(reversed(GPT_VARIANTS))
        for name in order:
            free_memory(device)
            step, losses, holder = _gpt_variant(name, config, device, world)
            n_params = sum(p.numel() for p in holder[0].parameters())
            samples[name] += time_ms(lambda: step(idx, targets), device, warmup, repeats)
            peak = peak_bytes(device)
            peaks[name] = peak if peaks.get(name) is None else max(peaks[name], peak)
            first_loss[name] = losses[0].float().item()
            if isinstance(holder[1], llw.LayerwiseDataParallel):
                holder[1].param_sync.finish()
            del step, losses, holder
    free_memory(device)
    plain = statistics.median(samples["plain"])
    variants = {}
    for name in GPT_VARIANTS:
        med = statistics.median(samples[name])
        variants[name] = {**summary(samples[name]), "ratio_vs_plain": med / plain,
                          "peak_memory_bytes": peaks[name],
                          "peak_memory_gib": None if peaks[name] is None else peaks[name] / 2**30,
                          "first_loss": first_loss[name]}
    worst = max(variants[v]["ratio_vs_plain"] for v in ("layerwise_single", "layerwise_pg1"))
    return {"config": {"vocab_size": config.vocab_size, "block_size": config.block_size, "n_layer": config.n_layer,
                       "n_head": config.n_head, "n_embd": config.n_embd, "batch": batch, "params": n_params,
                       "autocast": "bfloat16", "optimizer": "AdamW (foreach)"},
            "backend": world.backend, "warmup": warmup, "repeats_per_round": repeats, "rounds": rounds,
            "variants": variants, "target_ratio": WRAPPER_TARGET, "worst_layerwise_ratio": worst,
            "target_met": worst <= WRAPPER_TARGET}


# --- d. busiest-rank optimizer step at simulated dp=8 ----------------------------------------------------------------

class LlamaLayer(nn.Module):
    def __init__(self, d: int, kv: int, ffn: int):
        super().__init__()
        self.input_layernorm = nn.Parameter(torch.ones(d))
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, kv, bias=False)
        self.v_proj = nn.Linear(d, kv, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(d))
        self.gate_proj = nn.Linear(d, ffn, bias=False)
        self.up_proj = nn.Linear(d, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, d, bias=False)


class LlamaStack(nn.Module):
    """Parameters only (never run): Llama-3-8B's shapes for ``n_layer`` layers, untied embedding and head."""

    def __init__(self, n_layer: int, d: int, kv: int, ffn: int, vocab: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(LlamaLayer(d, kv, ffn) for _ in range(n_layer))
        self.norm = nn.Parameter(torch.ones(d))
        self.lm_head = nn.Linear(d, vocab, bias=False)


def llama_stack(quick: bool, device: torch.device) -> tuple[LlamaStack, dict]:
    shape = (dict(n_layer=2, d=64, kv=16, ffn=224, vocab=512) if quick
             else dict(n_layer=4, d=4096, kv=1024, ffn=14336, vocab=128256))
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaStack(**shape)
    return model, shape


def routed_cost(model: nn.Module) -> Callable[[ParamSpec], float]:
    """Newton–Schulz cost for parameters Muon steps, element count for the ones AdamW steps."""
    muon = {r.name for r in route_parameters(model) if r.use_muon}
    return lambda spec: newton_schulz_cost(spec) if spec.name in muon else numel_cost(spec)


def bench_optimizer_dp8(device: torch.device, quick: bool, dp: int = 8) -> dict:
    free_memory(device)
    model, shape = llama_stack(quick, device)
    named = dict(model.named_parameters())
    g = torch.Generator(device=device).manual_seed(4)
    grads = {n: torch.randn(p.shape, device=device, generator=g) * 1e-3 for n, p in named.items()}
    opt = llw.Muon(muon_param_groups(model), lr=0.02, adamw_lr=3e-4)
    warmup, repeats = (1, 1) if quick else (1, 3)

    def step_over(names: set[str]) -> list[float]:
        for n, p in named.items():
            p.grad = grads[n] if n in names else None
        return time_ms(opt.step, device, warmup, repeats)

    everything = set(named)
    replicated = summary(step_over(everything))
    specs = param_specs(model)
    plans = {}
    for label, cost in (("newton_schulz_cost", newton_schulz_cost), ("routed_cost", routed_cost(model))):
        layout = llw.plan_layout(specs, dp, DEFAULT_BUCKET_SIZE, cost)
        costs = layout.rank_costs()
        ranks = []
        for r in range(dp):
            owned = set(layout.owned_by(r))
            timing = summary(step_over(owned) if owned else [])
            ranks.append({"rank": r, "params": len(owned), "elements": sum(named[n].numel() for n in owned),
                          "planned_cost": costs[r], **timing})
        busiest = max(ranks, key=lambda x: x["median_ms"])
        planned = max(range(dp), key=lambda r: costs[r])
        plans[label] = {
            "padding_fraction": layout.padding_fraction, "planned_imbalance": layout.imbalance,
            "planned_busiest_rank": planned, "measured_busiest_rank": busiest["rank"],
            "busiest_ms": busiest["median_ms"], "ratio_vs_replicated": busiest["median_ms"] / replicated["median_ms"],
            "ideal_ratio": 1 / dp, "ranks": ranks,
        }
    for p in named.values():
        p.grad = None
    n_params = sum(p.numel() for p in named.values())
    del opt, grads, named, model
    free_memory(device)
    return {"dp": dp, "model": {**shape, "params": n_params}, "bucket_size": DEFAULT_BUCKET_SIZE,
            "optimizer": "lightning_layerwise.Muon (Muon for hidden matrices, AdamW for embeddings, head, norms)",
            "replicated": replicated, "plans": plans}


# --- report ----------------------------------------------------------------------------------------------------------

fmt = harness.fmt


def _md_peak(peak: dict) -> list[str]:
    return ["## bf16 matmul peak", "",
            harness.markdown_table(["n", "median ms", "TFLOP/s (median)", "TFLOP/s (max)"],
                                   [[peak["n"], fmt(peak["median_ms"], ".3f"), fmt(peak["tflops_median"], ".1f"),
                                     fmt(peak["tflops_max"], ".1f")]]), ""]


def _md_newton_schulz(ns: dict) -> list[str]:
    rows = [[f"{r['shape'][0]}x{r['shape'][1]}", r["batch"], fmt(r["median_ms"], ".2f"), fmt(r["tflops"], ".1f"),
             fmt(r["fraction_of_peak"], ".2f")] for r in ns["rows"]]
    return [f"## Batched Newton–Schulz ({ns['ns_steps']} iterations, bf16)", "",
            harness.markdown_table(["shape", "batch", "median ms", "TFLOP/s", "fraction of peak"], rows),
            "", f"All shapes: {fmt(ns['overall_tflops'], '.1f')} TFLOP/s, "
            f"{fmt(ns['overall_fraction_of_peak'], '.2f')} of peak "
            f"(target >= {ns['target_fraction']}: {'met' if ns['target_met'] else 'missed'}).", ""]


def _md_muon_step(mu: dict) -> list[str]:
    torch_ms = mu["torch_muon"]["median_ms"] if mu.get("torch_muon") else None
    lines = ["## Muon step on the same matrices (float32 parameters)", "",
             harness.markdown_table(["optimizer", "median ms"],
                                    [["lightning_layerwise.Muon (batched)", fmt(mu["layerwise_muon"]["median_ms"])],
                                     ["torch.optim.Muon (per matrix)", fmt(torch_ms)]]), ""]
    if mu.get("speedup_vs_torch"):
        lines += [f"{mu['n_matrices']} matrices; lightning_layerwise.Muon is "
                  f"{fmt(mu['speedup_vs_torch'])}x as fast as torch.optim.Muon.", ""]
    elif mu.get("note"):
        lines += [mu["note"], ""]
    return lines


def _md_gpt(gpt: dict) -> list[str]:
    c = gpt["config"]
    labels = {"plain": "plain", "layerwise_single": "layerwise, ProcessGroups.single()",
              "layerwise_pg1": f"layerwise, 1-rank {gpt['backend']} groups",
              "ddp_pg1": f"DDP, 1-rank {gpt['backend']}"}
    rows = [[labels[name], fmt(v["median_ms"]), fmt(v["min_ms"]), f"{fmt(v['ratio_vs_plain'], '.3f')}x",
             fmt(v["peak_memory_gib"]), fmt(v["first_loss"], ".4f")] for name, v in gpt["variants"].items()]
    return [f"## GPT step ({c['n_layer']} layers, d={c['n_embd']}, vocab {c['vocab_size']}, "
            f"seq {c['block_size']}, batch {c['batch']}, {c['params'] / 1e6:.1f}M parameters, bf16 autocast, "
            f"AdamW)", "",
            harness.markdown_table(["variant", "median ms", "min ms", "vs plain", "peak memory GiB", "first loss"],
                                   rows),
            "", f"Worst layer-wise ratio {fmt(gpt['worst_layerwise_ratio'], '.3f')}x "
            f"(target <= {gpt['target_ratio']}: {'met' if gpt['target_met'] else 'missed'}); "
            f"{gpt['rounds']} rounds x {gpt['repeats_per_round']} timed steps after {gpt['warmup']} "
            "warm-ups.", ""] + (["aten operations per step (`--profile`, untimed):", "",
                                 profile_table(gpt["profile"]), ""] if "profile" in gpt else [])


def _md_optimizer_dp8(opt: dict) -> list[str]:
    m = opt["model"]
    rows = [[label, f"{100 * p['padding_fraction']:.1f}%", fmt(p["planned_imbalance"], ".3f"),
             f"{p['measured_busiest_rank']} (planned {p['planned_busiest_rank']})", fmt(p["busiest_ms"]),
             fmt(p["ratio_vs_replicated"], ".3f"), fmt(p["ideal_ratio"], ".3f")] for label, p in opt["plans"].items()]
    per_rank = "; ".join(f"{label}: " + ", ".join(fmt(r["median_ms"], ".1f") for r in p["ranks"])
                         for label, p in opt["plans"].items())
    return [f"## Busiest rank's optimizer step at simulated dp={opt['dp']}", "",
            f"{m['n_layer']} Llama layers (d={m['d']}, kv={m['kv']}, ffn={m['ffn']}) + embedding and head "
            f"(vocab {m['vocab']}), {m['params'] / 1e9:.2f}B parameters; {opt['optimizer']}. "
            f"Replicated step (all parameters): {fmt(opt['replicated']['median_ms'])} ms.", "",
            harness.markdown_table(["layout cost", "padding", "planned imbalance", "busiest rank (measured)",
                                    "busiest ms", "vs replicated", "ideal"], rows),
            "", f"Per rank (ms): {per_rank}", ""]


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [f"# GPU benchmark ({meta['device_name']})", "",
             f"torch {meta['torch']}, lightning {meta['lightning']}, CUDA {meta['cuda']}, "
             f"{'quick sizes' if meta['quick'] else 'full sizes'}, {meta['date']}, {meta['wall_s']:.0f} s.", ""]
    lines += [f"* {note}" for note in result["notes"]] + ([""] if result["notes"] else [])
    sections = (("peak", _md_peak), ("newton_schulz", _md_newton_schulz), ("muon_step", _md_muon_step),
                ("gpt", _md_gpt), ("optimizer_dp8", _md_optimizer_dp8))
    for key, section in sections:
        if result.get(key):
            lines += section(result[key])
    return "\n".join(lines)


# --- main ------------------------------------------------------------------------------------------------------------

SECTIONS = ("peak", "newton_schulz", "muon_step", "gpt", "optimizer_dp8")


def run_sections(device: torch.device, sections: list[str], args: argparse.Namespace, result: dict) -> None:
    """Runs the chosen sections in order into ``result``, a line of progress after each."""
    peak_tflops = None
    if "peak" in sections or "newton_schulz" in sections:
        result["peak"] = bench_peak(device, args.quick)
        peak_tflops = result["peak"]["tflops_median"]
        print(f"peak: {peak_tflops:.1f} TFLOP/s bf16 ({result['peak']['n']}^3)", flush=True)
    if "newton_schulz" in sections:
        result["newton_schulz"] = bench_newton_schulz(device, args.quick, peak_tflops)
        print(f"newton_schulz: {result['newton_schulz']['overall_tflops']:.1f} TFLOP/s", flush=True)
        free_memory(device)
    if "muon_step" in sections:
        result["muon_step"] = bench_muon_step(device, args.quick)
        print(f"muon_step: {result['muon_step']['layerwise_muon']['median_ms']:.2f} ms", flush=True)
        free_memory(device)
    if "gpt" in sections:
        world = World1(device)
        try:
            result["gpt"] = bench_gpt(device, args.quick, world, args.gpt_batch)
            print("gpt: " + ", ".join(f"{k} {v['median_ms']:.2f} ms" for k, v in result["gpt"]["variants"].items()),
                  flush=True)
            if args.profile:
                result["gpt"]["profile"] = profile_gpt(device, args.quick, world, args.gpt_batch)
                print("gpt --profile: aten operations per step\n" + profile_table(result["gpt"]["profile"]),
                      flush=True)
        finally:
            world.close()
    if "optimizer_dp8" in sections:
        result["optimizer_dp8"] = bench_optimizer_dp8(device, args.quick)
        print("optimizer_dp8: replicated "
              f"{result['optimizer_dp8']['replicated']['median_ms']:.2f} ms", flush=True)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a few seconds (smoke test)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=str(harness.RESULTS), help="directory for gpu.json, gpu.md")
    parser.add_argument("--gpt-batch", type=int, default=None,
                        help="the GPT step's batch size (default 8; 2 with --quick)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--profile", action="store_true",
                        help="with the gpt section: each variant's aten operations and device copies per step")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda, but torch sees no CUDA device; use --device cpu (with --quick)")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    if device.type == "cpu" and args.quick:
        torch.set_num_threads(1)  # a shared CPU: one thread per process is the steadiest for a smoke test
    import lightning

    clock = harness.Clock()
    notes = []
    if device.type != "cuda":
        notes.append("No CUDA device: the numbers below are a CPU smoke test, not measurements. "
                     "The NCCL variants ran over gloo; CUDA events were replaced by wall-clock timers.")
    machine = harness.machine()
    result: dict = {
        "meta": {"device": str(device),
                 "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else machine["cpu_model"],
                 "torch": machine["torch"], "lightning": lightning.__version__,
                 "cuda": torch.version.cuda, "python": machine["python"], "quick": args.quick,
                 "date": time.strftime("%Y-%m-%d %H:%M:%S"), "sections": sections},
        "notes": notes,
    }
    run_sections(device, sections, args, result)
    result["meta"]["wall_s"] = clock.elapsed_s()

    out = Path(args.out)
    text = markdown(result)
    print()
    print(text)
    harness.write_json(out / "gpu.json", result, indent=2)
    (out / "gpu.md").write_text(text + "\n")
    print(f"wrote {out / 'gpu.json'} and {out / 'gpu.md'}")
    return result


if __name__ == "__main__":
    main()
