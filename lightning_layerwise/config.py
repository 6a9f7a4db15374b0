"""Every setting of the layer-wise strategies, typed and checked in one place.

:class:`LayerwiseConfig` is what ``LayerwiseStrategy(...)`` and ``LayerwiseFabricStrategy(...)``
build from their arguments, and what a :class:`~lightning_layerwise.LayerwiseSession` is given:
a frozen dataclass whose construction checks every value (before any process or group
exists), each error naming the strategy class, the argument, the value and a fix. The
defaults are written here once; the Trainer strategy repeats them in its signature only so
that LightningCLI can read the types (a test keeps the two equal).
"""

from __future__ import annotations

import difflib
import functools
import inspect
from dataclasses import InitVar, dataclass, fields
from datetime import timedelta
from typing import Any, Callable, Literal, Optional, Sequence, Union

import torch
from torch.distributed.constants import default_pg_timeout

from .layout import (DEFAULT_BUCKET_SIZE, SHARDED_BUCKET_SIZE, is_bucket_size, resolve_bucket_size,
                     resolve_prefetch_depth)
from .optim.elementwise import resolve_optimizer_classes
from .engine.read_guard import READ_GUARDS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
START_METHODS = ("popen", "spawn", "fork", "forkserver")


@dataclass(frozen=True)
class LayerwiseConfig:
    """The settings of one layer-wise strategy; see ``LayerwiseStrategy`` and docs/usage.md for each."""

    bucket_size: Union[int, Literal["auto"]] = "auto"
    """Elements per communication bucket (all shards together); ``"auto"``: ``DEFAULT_BUCKET_SIZE``, or
    ``SHARDED_BUCKET_SIZE`` with ``shard_parameters`` (a bucket is then also what a forward gathers)."""
    overlap_grad_reduce: bool = True
    """Dispatch a bucket's reduce-scatter during backward as soon as its gradients are complete."""
    overlap_param_gather: Union[bool, Literal["auto"]] = "auto"
    """All-gather parameters behind the next forward; ``"auto"``: unless the model is compiled."""
    param_read_guard: Literal["wait", "strict", "off"] = "wait"
    """What a read of a parameter whose all-gather has not landed does (Note [read guard] in
    ``engine/read_guard.py``)."""
    prefetch_depth: Union[int, Literal["auto"]] = "auto"
    """Buckets whose all-gather may be in flight at once; ``"auto"``: 2, and 1 with ``shard_parameters`` (each
    prefetched bucket is then held full)."""
    separate_all_gather_group: bool = True
    """All-gathers on their own process group, so they can overlap reduce-scatters."""
    grad_reduce_dtype: Optional[Literal["float32", "bfloat16", "float16"]] = None
    """Dtype of the gradient buffers and reduce-scatter; ``None``: the parameter dtype."""
    broadcast_buffers: bool = True
    """Broadcast module buffers from rank 0 at every training forward, as ``ddp`` does."""
    checkpoint_format: Literal["auto", "sharded", "full"] = "auto"
    """``"auto"``: one file for a model of at most ``formats.AUTO_FULL_LIMIT`` bytes, else sharded; ``"sharded"``: a
    directory each rank writes its part of; ``"full"``: one file written by rank 0."""
    replica_check_every: Optional[int] = None
    """Every this many optimizer steps, check that all ranks hold bitwise-equal parameters."""
    skip_nonfinite_steps: bool = False
    """Skip the optimizer step on every rank when any rank's reduced gradients are not finite."""
    elementwise_fill: bool = True
    """Split the parameters the optimizer updates element-wise across shards."""
    elementwise_optimizers: Sequence[Union[type, str]] = ()
    """Further optimizer classes (or import paths) whose update is element-wise; resolved to classes. Needs
    ``elementwise_fill``."""
    owner_group_size: Union[int, Literal["auto"], None] = "auto"
    """Ranks per owner group; ``"auto"``: one group on one node; ``None``: every rank."""
    expert_parallel_size: int = 1
    """Ranks per expert-parallel group (1: no expert parallelism)."""
    tensor_parallel_size: int = 1
    """Ranks per tensor-parallel group: the ranks form a ``(data_parallel, tensor_parallel)`` mesh (Note
    [tensor-parallel mesh] in ``engine/tensor_parallel.py``); 1: no tensor parallelism."""
    shard_parameters: bool = False
    """Each rank holds only its shard of the parameters and gradients between uses; buckets are gathered for
    each forward and backward (Note [sharded parameters] in ``engine/buffers.py``)."""
    reshard_after_forward: bool = True
    """With ``shard_parameters``: free buckets during the forward and gather them again for the backward.
    ``False`` without ``shard_parameters`` is refused (it would change nothing)."""
    timeout: Optional[timedelta] = default_pg_timeout
    """Collective timeout."""
    start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen"
    """How processes are launched, as for ``ddp``."""
    owner: InitVar[str] = "LayerwiseConfig"
    """The name errors give the settings under (the strategy class); not kept."""

    @property
    def planned_bucket_size(self) -> int:
        """The bucket length the layout is planned with (``"auto"`` resolved)."""
        return resolve_bucket_size(self.bucket_size, self.shard_parameters)

    @property
    def planned_prefetch_depth(self) -> int:
        """The all-gathers in flight at once (``"auto"`` resolved)."""
        return resolve_prefetch_depth(self.prefetch_depth, self.shard_parameters)

    def __post_init__(self, owner: str) -> None:
        cls = owner
        if self.bucket_size != "auto" and not is_bucket_size(self.bucket_size):
            raise ValueError(f"{cls}(bucket_size={self.bucket_size!r}): pass a positive number of elements, "
                             f"e.g. bucket_size={DEFAULT_BUCKET_SIZE}, or 'auto' ({DEFAULT_BUCKET_SIZE}, and "
                             f"{SHARDED_BUCKET_SIZE} with shard_parameters=True).")
        if self.overlap_param_gather not in (True, False, "auto"):
            raise ValueError(f"{cls}(overlap_param_gather={self.overlap_param_gather!r}): use True, False or 'auto'.")
        if self.param_read_guard not in READ_GUARDS:
            raise ValueError(f"{cls}(param_read_guard={self.param_read_guard!r}): use 'wait' (reads wait for their "
                             "all-gather), 'strict' (such reads raise, for debugging) or 'off' (stale reads, for "
                             "measurements only).")
        if self.prefetch_depth != "auto" and not _is_count(self.prefetch_depth):
            raise ValueError(f"{cls}(prefetch_depth={self.prefetch_depth!r}): pass an integer >= 1, or 'auto' (2, and "
                             "1 with shard_parameters=True).")
        if self.grad_reduce_dtype is not None and self.grad_reduce_dtype not in DTYPES:
            raise ValueError(f"{cls}(grad_reduce_dtype={self.grad_reduce_dtype!r}): use one of {sorted(DTYPES)} or "
                             "None (the parameter dtype).")
        if self.checkpoint_format not in ("auto", "sharded", "full"):
            raise ValueError(f"{cls}(checkpoint_format={self.checkpoint_format!r}): use 'auto' (one file for a model "
                             "of up to 512 MiB, else a directory), 'sharded' (a directory, each rank writes what it "
                             "owns) or 'full' (one file written by rank 0).")
        if self.replica_check_every is not None and not _is_count(self.replica_check_every):
            raise ValueError(f"{cls}(replica_check_every={self.replica_check_every!r}): pass a number of optimizer "
                             "steps >= 1 (e.g. 100), or None to never check.")
        for name in ("overlap_grad_reduce", "separate_all_gather_group", "broadcast_buffers", "skip_nonfinite_steps",
                     "elementwise_fill", "shard_parameters", "reshard_after_forward"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{cls}({name}={getattr(self, name)!r}): pass True or False.")
        if self.reshard_after_forward is False and not self.shard_parameters:
            raise ValueError(f"{cls}(reshard_after_forward=False): it applies only with shard_parameters=True (whether "
                             "a bucket gathered for the forward is kept for its backward); without it every rank "
                             "holds the whole model and nothing is freed. Pass shard_parameters=True as well, or "
                             "leave reshard_after_forward out.")
        if isinstance(self.elementwise_optimizers, (str, type)):
            raise ValueError(f"{cls}(elementwise_optimizers={self.elementwise_optimizers!r}): pass a list of "
                             "optimizer classes or import paths, e.g. ['my_package.optim.Lion'].")
        given = list(self.elementwise_optimizers)
        classes = resolve_optimizer_classes(given, f"{cls}(elementwise_optimizers=...)")
        object.__setattr__(self, "elementwise_optimizers", classes)  # frozen: the resolved classes are kept
        if classes and not self.elementwise_fill:
            raise ValueError(f"{cls}(elementwise_optimizers={given!r}): it applies only "
                             "with elementwise_fill=True (it declares which optimizers' parameters may be split), "
                             "and elementwise_fill=False owns every parameter whole. Drop one of the two.")
        if self.owner_group_size not in ("auto", None) and not _is_count(self.owner_group_size):
            raise ValueError(f"{cls}(owner_group_size={self.owner_group_size!r}): pass 'auto', None (one group of "
                             "every rank) or a positive integer that divides the number of ranks, e.g. 8.")
        if not _is_count(self.expert_parallel_size):
            raise ValueError(f"{cls}(expert_parallel_size={self.expert_parallel_size!r}): pass a positive integer "
                             "that divides the number of ranks and every MoE layer's expert count (1: no expert "
                             "parallelism).")
        if not _is_count(self.tensor_parallel_size):
            raise ValueError(f"{cls}(tensor_parallel_size={self.tensor_parallel_size!r}): pass a positive integer "
                             "that divides the processes per node, e.g. 2 (1: no tensor parallelism).")
        if self.tensor_parallel_size > 1:
            for name, value, fix in (
                    ("expert_parallel_size", self.expert_parallel_size != 1, "expert_parallel_size=1"),):
                if value:
                    raise ValueError(
                        f"{cls}(tensor_parallel_size={self.tensor_parallel_size}, {name}="
                        f"{getattr(self, name)!r}): tensor parallelism does not combine with {name} yet; pass "
                        f"{fix}, or tensor_parallel_size=1.")
        if self.timeout is not None and not isinstance(self.timeout, timedelta):
            raise ValueError(f"{cls}(timeout={self.timeout!r}): pass a datetime.timedelta, e.g. "
                             "timeout=timedelta(minutes=30) (in a LightningCLI config: a number of seconds is not "
                             "accepted either).")
        if self.start_method not in START_METHODS:
            raise ValueError(f"{cls}(start_method={self.start_method!r}): use 'popen', 'spawn', 'fork' or "
                             "'forkserver'.")


def _is_count(value) -> bool:
    """An ``int`` (not a ``bool``) >= 1."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


SETTINGS: tuple[str, ...] = tuple(f.name for f in fields(LayerwiseConfig))
"""The names of the settings, in order."""


def config_from_options(owner: str, options: dict, fabric_arguments: Sequence[str] = (),
                        **fixed) -> LayerwiseConfig:
    """A :class:`LayerwiseConfig` from keyword arguments, refusing unknown names with the list of known ones.

    ``fabric_arguments``: the strategy's own named arguments, also offered as the closest match of a misspelt name.
    """
    unknown = sorted(set(options) - set(SETTINGS))
    if unknown:
        hint = did_you_mean(unknown, (*SETTINGS, *fabric_arguments))
        raise TypeError(f"{owner} got unknown argument(s) {unknown}{hint}; its arguments are {sorted(SETTINGS)} "
                        "(as LayerwiseStrategy's) and Fabric's own (accelerator, precision, process_group_backend, "
                        "timeout, start_method, ...).")
    return LayerwiseConfig(**options, **fixed, owner=owner)


def named_arguments(function: Callable) -> tuple[str, ...]:
    """The names ``function`` takes by keyword, in order (``self`` and ``*args``/``**kwargs`` left out)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(name for name, p in inspect.signature(function).parameters.items()
                 if p.kind in kinds and name != "self")


def refuse_unknown_keywords(init: Callable) -> Callable:
    """Decorates a strategy's ``__init__`` to refuse a misspelt keyword with the closest name and the valid ones.

    Python's own ``TypeError: __init__() got an unexpected keyword argument`` names neither the class nor what
    was meant. The signature stays ``init``'s (``functools.wraps``): LightningCLI (jsonargparse) and
    ``inspect.signature`` read the explicit arguments and their types from it, so it cannot become ``**kwargs``.
    """
    known = named_arguments(init)
    settings = sorted(name for name in known if name in SETTINGS)
    lightning = ", ".join(name for name in known if name not in SETTINGS)

    @functools.wraps(init)
    def checked(self, *args: Any, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            raise TypeError(f"{type(self).__name__} got unknown argument(s) {unknown}{did_you_mean(unknown, known)}; "
                            f"its arguments are {settings} and Lightning's ({lightning}).")
        init(self, *args, **kwargs)

    return checked


def did_you_mean(unknown: Sequence[str], known: Sequence[str]) -> str:
    """`` (did you mean 'bucket_size'?)`` for the names in ``unknown`` close to one in ``known``; else ``""``.

    A misspelt keyword is the usual cause of an unknown argument: naming the closest setting saves reading the list.
    """
    matches = {name: difflib.get_close_matches(name, known, n=1) for name in unknown}
    pairs = [(name, close[0]) for name, close in matches.items() if close]
    if not pairs:
        return ""
    if len(unknown) == 1:
        return f" (did you mean {pairs[0][1]!r}?)"
    return " (did you mean " + ", ".join(f"{match!r} for {name!r}" for name, match in pairs) + "?)"
