"""Checkpoints keyed by parameter name, in two formats, written so that a crash loses nothing.

Every trainable parameter has exactly one owner and a name, so a checkpoint
never needs to know the world size, the bucket size or the layout that wrote
it: it is a set of named tensors. The package, by layer: what each rank writes
and reads (``ownership``), optimizer state in named form and its gathering to one
rank (``named_state``), files written atomically (``files``), the sharded
``torch.distributed.checkpoint`` directory (``sharded``), and the two formats the
session saves and loads through (``formats``), whichever front door (Trainer,
Fabric, a plain loop) drives it.
"""

from .files import TorchFileIO, aside_path, commit, is_local_path, partial_path, resolve
from .named_state import (fill_tensors, gather_named_state, local_optimizer_state, named_optimizer_state,
                          split_tensors, to_cpu)
from .ownership import (MODEL_KEY, CheckpointError, Ownership, join_pieces, mark_pieces, model_entries_to_write,
                        optimizer_key, pieces_as_sharded_tensors)
from .sharded import (CONSOLIDATE_COMMAND, DCP_METADATA_FILENAME, FORMAT, FORMAT_VERSION, META_FILENAME,
                      README_FILENAME, checkpoint_items, consolidate, empty_like_item, load_meta, load_sharded,
                      nest, read_sharded_checkpoint, read_sharded_metadata, save_sharded)

__all__ = [
    "CONSOLIDATE_COMMAND", "DCP_METADATA_FILENAME", "FORMAT", "FORMAT_VERSION", "META_FILENAME", "MODEL_KEY",
    "README_FILENAME", "CheckpointError", "Ownership", "TorchFileIO", "aside_path", "checkpoint_items", "commit",
    "consolidate", "empty_like_item", "fill_tensors", "gather_named_state", "is_local_path", "join_pieces",
    "load_meta", "load_sharded", "local_optimizer_state", "mark_pieces", "model_entries_to_write",
    "named_optimizer_state", "nest", "optimizer_key", "partial_path", "pieces_as_sharded_tensors",
    "read_sharded_checkpoint", "read_sharded_metadata", "resolve", "save_sharded", "split_tensors", "to_cpu",
]
