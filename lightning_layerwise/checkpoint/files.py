"""Files: where a checkpoint may be written, and writing it so that a crash loses nothing.

Note [atomic save]
    A checkpoint is written aside (``.NAME.partial``) and renamed into place when
    complete, so a process killed while saving leaves the previous checkpoint
    under ``NAME`` intact. A directory cannot replace another in one rename: the
    old one is first renamed to ``.NAME.old``, the new one into place, and then
    the old one is deleted. Should the process die between the two renames,
    loading ``NAME`` finds ``.NAME.old`` and loads it. ``meta.pt`` is written last:
    a directory without it is an interrupted save, never a checkpoint.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch


def is_local_path(path: Any) -> bool:
    """Whether ``path`` (a string as the user gave it: URLs keep their ``//``) is on the local filesystem.

    Decided on the string: ``Path("s3://b/x")`` would read ``s3:/b/x``, a local path."""
    text = str(path)
    try:
        from fsspec.core import url_to_fs
        from fsspec.implementations.local import LocalFileSystem
    except ImportError:  # without fsspec only local paths and file:// URLs are local
        return "://" not in text or text.startswith("file://")
    return isinstance(url_to_fs(text)[0], LocalFileSystem)


class TorchFileIO:
    """One checkpoint file through ``torch.save`` / ``torch.load``, for a loop without Lightning (Lightning's
    ``CheckpointIO`` plugins have the same three methods and are used in its place)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("TorchFileIO.save_checkpoint takes no storage_options; pass a CheckpointIO plugin that "
                            "writes to remote storage.")
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        torch.save(checkpoint, path)

    def load_checkpoint(self, path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        if not Path(path).exists():
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return torch.load(path, map_location="cpu", weights_only=True if weights_only is None else weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        remove_path(Path(path))


def partial_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial")


def aside_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.old")


def remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def commit(written: Path, path: Path) -> None:
    """Moves the complete checkpoint ``written`` to ``path``, replacing what was there (Note [atomic save])."""
    if written.is_file():
        with open(written, "rb") as f:
            os.fsync(f.fileno())
    old = aside_path(path)
    if path.is_dir() and not path.is_symlink():
        remove_path(old)
        os.rename(path, old)
        os.rename(written, path)
        _fsync_dir(path.parent)
        shutil.rmtree(old)
    else:
        os.replace(written, path)  # atomic for a file, and over a file or a symlink
        _fsync_dir(path.parent)


def resolve(path: Path) -> Path:
    """``path``, or the previous checkpoint a save interrupted between its two renames left aside."""
    if not path.exists() and aside_path(path).is_dir():
        return aside_path(path)
    return path
