"""Note [checkpoint ownership]: which entries a rank writes and reads, without a process group."""

from __future__ import annotations

import torch
from types import SimpleNamespace

from torch import nn

from lightning_layerwise import ProcessGroups
from lightning_layerwise import checkpoint as ckpt
from lightning_layerwise.layout import param_specs, plan_layout


class FakeRecords:
    """What Ownership.of asks of ``wrapper.records``: this rank's piece of a parameter, and what it steps of it."""

    def __init__(self, wrapper: "FakeWrapper"):
        self._wrapper = wrapper

    def piece_of(self, p):
        return self._wrapper.piece_of(p)

    def __getitem__(self, p):
        return SimpleNamespace(unit=self._wrapper.unit_of(p))


class FakeWrapper:
    """What Ownership.of asks of a LayerwiseDataParallel: the layout, what this rank steps, its pieces."""

    def __init__(self, module: nn.Module, owned: set[str], rank: int = 0, layout=None, shards=None):
        self.named = dict(module.named_parameters())
        self.owned = owned
        self.ranks = SimpleNamespace(owner_rank=rank, expert_dp_rank=rank, layout_rank=rank, replicas=1,
                                     expert_parallel_size=1)
        self.grad_sync = SimpleNamespace(layout_group=None)
        self.records = FakeRecords(self)
        self.param_sync = SimpleNamespace(names={p: n for n, p in self.named.items() if p.requires_grad})
        self.process_groups = ProcessGroups.single()
        self.expert_names = frozenset()
        self.shards = shards or {}  # name -> this rank's piece parameter
        self.layout = layout or SimpleNamespace(params={n: SimpleNamespace(split=False) for n in self.named})

    def named_owned_parameters(self):
        yield from ((n, self.named[n]) for n in self.owned)
        yield from self.shards.items()

    def unit_of(self, p):
        name = next(n for n, q in self.named.items() if q is p)
        return SimpleNamespace(piece=self.layout.params[name].piece_of(self.ranks.owner_rank))

    def piece_of(self, p):
        return next((s for n, s in self.shards.items() if self.named[n] is p), None)


def model():
    m = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    m[2].bias.requires_grad_(False)  # frozen: outside the layout, written by rank 0
    return m


def test_owner_writes_its_parameters_rank0_the_rest():
    m = model()
    names = {p: n for n, p in m.named_parameters()}
    tensors = m.state_dict(keep_vars=True)
    state = {k: v.detach() for k, v in tensors.items()}
    master = nn.Parameter(torch.zeros(4, 3))
    rank0 = ckpt.Ownership.of(FakeWrapper(m, {"0.weight"}), names, is_global_zero=True, masters=[master])
    rank1 = ckpt.Ownership.of(FakeWrapper(m, {"0.bias", "1.weight", "1.bias", "2.weight"}), names,
                              is_global_zero=False)
    written0 = set(ckpt.model_entries_to_write(state, tensors, rank0))
    written1 = set(ckpt.model_entries_to_write(state, tensors, rank1))
    assert written0 == {"0.weight", "1.running_mean", "1.running_var", "1.num_batches_tracked", "2.bias"}
    assert written1 == {"0.bias", "1.weight", "1.bias", "2.weight"}
    assert not written0 & written1 and written0 | written1 == set(state)  # every entry once
    # Reads: the owned parameters, and everything outside the layout (buffers, frozen) on every rank.
    assert {k for k, t in tensors.items() if rank1.reads(t)} == written1 | {
        "1.running_mean", "1.running_var", "1.num_batches_tracked", "2.bias"}
    assert rank0.reads(master) and rank0.owned_names == {"0.weight"}


def test_without_a_wrapper_a_rank_owns_everything():
    m = model()
    names = {p: n for n, p in m.named_parameters()}
    tensors = m.state_dict(keep_vars=True)
    alone = ckpt.Ownership.of(None, names, is_global_zero=True)
    assert set(ckpt.model_entries_to_write({k: 0 for k in tensors}, tensors, alone)) == set(tensors)
    assert all(alone.reads(t) for t in tensors.values()) and alone.owned_names == set(names.values())
    other = ckpt.Ownership.of(None, names, is_global_zero=False)
    assert ckpt.model_entries_to_write({k: 0 for k in tensors}, tensors, other) == {}


def test_a_split_parameter_is_written_once_and_read_by_every_rank_stepping_a_piece():
    """Note [pieces in checkpoints]: the full value by the first piece's owner; state per piece."""
    m = nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 8))
    layout = plan_layout(param_specs(m, elementwise=lambda n, p: n.startswith("0.")), 3)
    emb = layout.params["0.weight"]
    assert emb.split and len(emb.pieces) == 3
    names = {p: n for n, p in m.named_parameters()}
    tensors = m.state_dict(keep_vars=True)
    state = {k: v.detach() for k, v in tensors.items()}
    ranks = []
    for rank in range(3):
        piece = emb.piece_of(rank)
        shards = {"0.weight": nn.Parameter(torch.zeros(piece.numel))}
        owned = {n for n in layout.owned_by(rank) if not layout.params[n].split}
        ranks.append(ckpt.Ownership.of(FakeWrapper(m, owned, rank, layout, shards), names, is_global_zero=rank == 0))
    written = [set(ckpt.model_entries_to_write(state, tensors, o)) for o in ranks]
    assert sum("0.weight" in w for w in written) == 1 and "0.weight" in written[emb.pieces[0].owner]
    assert all(o.reads(tensors["0.weight"]) and "0.weight" in o.owned_names for o in ranks)
    assert [o.piece("0.weight") for o in ranks] == [emb.piece_of(r) for r in range(3)]
