"""Character-level language-modelling data for the examples, with no download.

By default the corpus is the Python standard library's own source code (the
``*.py`` files under ``sysconfig.get_paths()["stdlib"]``, in sorted path order,
``site-packages`` left out), so every machine that runs the examples already has
it. Pass ``text_path`` to train on any UTF-8 text file instead.

Use it from Python::

    from examples.data import CharDataModule

    dm = CharDataModule(block_size=128, batch_size=32)
    dm.vocab_size                       # 96 for CPython 3.11's stdlib, first 2 M chars
    trainer.fit(model, datamodule=dm)

The training job ``examples/train.py`` builds it from the command line (its
docstring has the run commands).

Note [windows and samplers]
    A sample is a window of ``block_size + 1`` consecutive characters, returned as
    ``(x, y)`` with ``y`` shifted one to the left of ``x``. The training set is a
    map-style dataset with one item per possible window start, served by an ordinary
    ``DataLoader``, so that Lightning can swap its sampler for a ``DistributedSampler``
    when ``use_distributed_sampler=True`` under a multi-process strategy:

    - ``shuffle=True`` (default): a seeded ``RandomSampler`` in one process (the
      DataLoader's generator is seeded with ``seed``), Lightning's
      ``DistributedSampler`` (seeded by ``seed_everything``) in several. Every epoch
      draws a fresh order, so ``Trainer(limit_train_batches=...)`` gives short epochs
      of new windows.
    - ``shuffle=False``: the dataset itself holds one fixed, seeded random order of
      the windows and is read sequentially. ``DistributedSampler(shuffle=False)``
      deals index ``i`` to rank ``i % N``, so global step ``k`` sees exactly the
      windows that one process with an N times larger batch sees at step ``k``. Use
      it to compare runs across world sizes. Every epoch repeats the same order.

    Validation (also test and predict) uses ``val_windows`` fixed, evenly spaced
    windows of the held-out tail of the corpus, read in order.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

__all__ = ["CharDataModule", "CharWindowDataset", "load_stdlib_text"]


def load_stdlib_text(max_chars: int | None = 2_000_000) -> str:
    """Concatenate the standard library's ``*.py`` files in sorted path order, up to ``max_chars``.

    Files that cannot be read as UTF-8 are skipped; ``site-packages`` is left out
    because what is installed there differs from machine to machine.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(
        (p for p in root.rglob("*.py") if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    chunks: list[str] = []
    total = 0
    for path in paths:
        if max_chars is not None and total >= max_chars:
            break
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # broken links, permission errors, test files with other encodings
        chunks.append(text)
        total += len(text)
    text = "".join(chunks)
    return text if max_chars is None else text[:max_chars]


class CharWindowDataset(Dataset):
    """Windows of ``block_size + 1`` tokens from a 1-D token tensor, as ``(x, y)`` int64 pairs.

    ``starts`` lists the window start of each item; None means every possible start
    ``0 .. len(tokens) - block_size - 1`` in order (no tensor is stored for that case).
    """

    def __init__(self, tokens: Tensor, block_size: int, starts: Tensor | None = None) -> None:
        if tokens.ndim != 1 or tokens.numel() < block_size + 1:
            raise ValueError(
                f"CharWindowDataset: `tokens` must be 1-D with at least block_size + 1 = {block_size + 1}"
                f" entries, got shape {tuple(tokens.shape)}."
            )
        self.tokens = tokens
        self.block_size = block_size
        self.starts = starts

    def __len__(self) -> int:
        if self.starts is None:
            return self.tokens.numel() - self.block_size
        return self.starts.numel()

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = index if self.starts is None else int(self.starts[index])
        chunk = self.tokens[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


class CharDataModule(L.LightningDataModule):
    """Character-level windows of a text corpus, split into a training head and a validation tail.

    Args:
        text_path: UTF-8 text file to train on. None uses the Python standard library's sources.
        max_chars: Keep only the first ``max_chars`` characters of the corpus; None keeps all.
        block_size: Characters per sample (the model's context length).
        batch_size: Samples per batch in each process (the global batch is ``batch_size`` times
            the number of processes).
        val_fraction: Fraction of the corpus, taken from its end, held out for validation.
        val_windows: Number of evenly spaced validation windows (fewer if the split is shorter).
        shuffle: Reshuffle the training windows every epoch (True), or read one fixed seeded
            random order that is the same for any number of processes (False). See
            Note [windows and samplers] in the module docstring.
        num_workers: DataLoader worker processes; 0 loads in the main process, which is enough
            for slicing an in-memory tensor.
        seed: Seed of the training order.
    """

    def __init__(
        self,
        text_path: str | None = None,
        max_chars: int | None = 2_000_000,
        block_size: int = 128,
        batch_size: int = 32,
        val_fraction: float = 0.05,
        val_windows: int = 512,
        shuffle: bool = True,
        num_workers: int = 0,
        seed: int = 1234,
    ) -> None:
        super().__init__()
        if text_path is not None and not Path(text_path).is_file():
            raise ValueError(
                f"CharDataModule: `text_path` {text_path!r} is not a file; pass an existing UTF-8 text"
                f" file, or leave text_path unset (None) to use the Python standard library's sources."
            )
        if max_chars is not None and max_chars < 1:
            raise ValueError(f"CharDataModule: `max_chars` must be None or >= 1, got {max_chars}.")
        for name, value in (("block_size", block_size), ("batch_size", batch_size), ("val_windows", val_windows)):
            if value < 1:
                raise ValueError(f"CharDataModule: `{name}` must be >= 1, got {value}.")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(
                f"CharDataModule: `val_fraction` must be in (0, 1), got {val_fraction}; 0.05 holds out"
                f" the last 5% of the corpus."
            )
        if num_workers < 0:
            raise ValueError(f"CharDataModule: `num_workers` must be >= 0, got {num_workers}.")
        self.save_hyperparameters()
        self.text_path = text_path
        self.max_chars = max_chars
        self.block_size = block_size
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.val_windows = val_windows
        self.shuffle = shuffle
        self.num_workers = num_workers
        self.seed = seed
        # Filled by _load(), lazily: `vocab_size` is read (LightningCLI's link to
        # model.vocab_size) before `setup`, and loading twice would be wasted work.
        self._chars: str = ""
        self.train_tokens: Tensor | None = None
        self.val_tokens: Tensor | None = None

    # ----------------------------------------------------------------- corpus

    def _load(self) -> None:
        if self.train_tokens is not None:
            return
        if self.text_path is None:
            text = load_stdlib_text(self.max_chars)
            source = f"the standard library under {sysconfig.get_paths()['stdlib']!r}"
        else:
            try:
                text = Path(self.text_path).read_text(encoding="utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"CharDataModule: `text_path` {self.text_path!r} is not valid UTF-8 ({err});"
                    f" convert it to UTF-8 first."
                ) from err
            if self.max_chars is not None:
                text = text[: self.max_chars]
            source = repr(self.text_path)
        if not text:
            raise ValueError(
                f"CharDataModule: the corpus read from {source} is empty; pass a non-empty `text_path`."
            )
        # Code points -> ids in one vectorised pass: the vocabulary is the sorted set of
        # code points, so an id is the code point's rank in it (searchsorted).
        codes = torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32)
        vocab_codes = torch.unique(codes)
        ids = torch.searchsorted(vocab_codes, codes)
        # The smallest integer type that holds every id keeps a 2 M-char corpus at 2 MB.
        dtype = torch.uint8 if len(vocab_codes) <= 256 else torch.int16 if len(vocab_codes) <= 2**15 else torch.int32
        tokens = ids.to(dtype)

        n_val = int(len(tokens) * self.val_fraction)
        n_train = len(tokens) - n_val
        need = self.block_size + 1
        if n_train < need or n_val < need:
            raise ValueError(
                f"CharDataModule: a corpus of {len(tokens)} characters split with val_fraction="
                f"{self.val_fraction} gives {n_train} training and {n_val} validation characters, but each"
                f" split needs at least block_size + 1 = {need}; use a longer text, a larger `max_chars`,"
                f" or a smaller `block_size`."
            )
        self._chars = "".join(map(chr, vocab_codes.tolist()))
        self._index = {c: i for i, c in enumerate(self._chars)}
        self.train_tokens = tokens[:n_train]
        self.val_tokens = tokens[n_train:]

    @property
    def chars(self) -> str:
        """The vocabulary: the corpus's distinct characters in code-point order; id ``i`` is ``chars[i]``."""
        self._load()
        return self._chars

    @property
    def vocab_size(self) -> int:
        """Number of distinct characters in the corpus (loads it on first use)."""
        return len(self.chars)

    def encode(self, text: str) -> Tensor:
        """Map a string to a 1-D int64 tensor of ids; characters outside the vocabulary raise ValueError."""
        self._load()
        try:
            return torch.tensor([self._index[c] for c in text], dtype=torch.long)
        except KeyError as err:
            raise ValueError(
                f"CharDataModule.encode: character {err.args[0]!r} is not in the corpus vocabulary;"
                f" use only characters of the training text."
            ) from None

    def decode(self, ids: Tensor | list[int]) -> str:
        """Map a 1-D sequence of ids back to a string."""
        chars = self.chars
        if isinstance(ids, Tensor):
            ids = ids.tolist()
        return "".join(chars[i] for i in ids)

    # --------------------------------------------------------------- datasets

    def setup(self, stage: str | None = None) -> None:
        self._load()
        if self.shuffle:
            self.train_set = CharWindowDataset(self.train_tokens, self.block_size)
        else:
            n = self.train_tokens.numel() - self.block_size
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed)).to(torch.int32)
            self.train_set = CharWindowDataset(self.train_tokens, self.block_size, starts=order)
        # Evenly spaced, fixed windows: every validation pass scores the same text,
        # so validation losses of different runs and steps are comparable.
        last_start = self.val_tokens.numel() - self.block_size - 1
        n_val = min(self.val_windows, last_start + 1)
        starts = torch.linspace(0, last_start, n_val).round().to(torch.int64)
        self.val_set = CharWindowDataset(self.val_tokens, self.block_size, starts=starts)

    def _loader(self, dataset: Dataset, shuffle: bool, drop_last: bool) -> DataLoader:
        # A plain DataLoader (no custom sampler) so Lightning can inject a
        # DistributedSampler under multi-process strategies; see Note [windows and samplers].
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            generator=torch.Generator().manual_seed(self.seed) if shuffle else None,
        )

    def train_dataloader(self) -> DataLoader:
        # drop_last: equal batches on every step, so per-step losses compare across runs.
        return self._loader(self.train_set, shuffle=self.shuffle, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False, drop_last=False)

    def test_dataloader(self) -> DataLoader:
        # No third split: the corpus is small, and the examples only report validation.
        return self._loader(self.val_set, shuffle=False, drop_last=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False, drop_last=False)
