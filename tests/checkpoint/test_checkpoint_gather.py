"""Full checkpoints gather the optimizer state to rank 0 without pickling a tensor.

``checkpoint.gather_named_state`` sends skeletons (names, shapes, dtypes,
hyperparameters) through ``gather_object`` and every tensor through
point-to-point tensor transfers, one at a time (Note [gathering a full
checkpoint]). Checked on 3 gloo ranks against one process:

- the merged state equals the single-process optimizer state, bitwise, dtypes and
  shapes included, with odd tensors (0-d, empty, bool, int64, bf16, complex,
  non-contiguous) and ``master_weights``, over the world group and a subgroup;
- no tensor passes through an object collective (``gather_object`` and the other
  ``*_object*`` functions are wrapped to inspect their payloads), and every
  point-to-point batch moves exactly one tensor.

Also: a sharded checkpoint reads back with ``weights_only=True`` semantics
(``meta.pt``, the Python objects in the DCP files, the DCP index), and an
object it refuses is named in a ``CheckpointError``.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lightning_layerwise as llw
from lightning_layerwise import checkpoint as ckpt
from _dist import reference_threads, run_distributed

# save_sharded / load_sharded in one process: torch.distributed.checkpoint says it assumes no process group.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

OBJECT_COLLECTIVES = ("gather_object", "all_gather_object", "broadcast_object_list", "scatter_object_list",
                      "send_object_list", "recv_object_list")


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16),
                         nn.LayerNorm(16), nn.Linear(16, 3))


def trained_state() -> tuple[dict, dict[str, torch.Tensor]]:
    """The named optimizer state of one process after two Muon + AdamW steps, and the parameters by name.

    The intra-op threads of the ranks of ``run_distributed``, so every process computes the same bits.
    """
    with reference_threads():
        return _trained_state()


def _trained_state() -> tuple[dict, dict[str, torch.Tensor]]:
    model = make_model()
    opt = llw.Muon(llw.muon_param_groups(model), lr=0.02, adamw_lr=1e-2, ns_dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(8, 6, generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    names = {p: n for n, p in model.named_parameters()}
    named = ckpt.named_optimizer_state(opt, names)
    # Odd tensors a state may hold: 0-d, empty, bool, int64, bf16, complex, non-contiguous.
    first = sorted(named["state"])[0]
    named["state"][first].update(
        flag=torch.tensor([True, False, True]), count=torch.arange(5), empty=torch.empty(0, 4),
        half=torch.linspace(-1, 1, 7).to(torch.bfloat16), scalar=torch.tensor(3.5, dtype=torch.float64),
        complex=torch.randn(3, generator=g, dtype=torch.complex64), transposed=torch.randn(4, 3, generator=g).T,
    )
    named["master_weights"] = {n: p.detach().double() for n, p in model.named_parameters()}
    return named, dict(model.named_parameters())


def owned_part(full: dict, rank: int, world: int) -> dict:
    """What rank ``rank`` of ``world`` contributes: the state of every world-th parameter, all param groups."""
    names = sorted(full["state"])
    owned = set(names[rank::world])
    return {
        "state": {n: v for n, v in full["state"].items() if n in owned},
        "param_groups": full["param_groups"],
        "master_weights": {n: v for n, v in full["master_weights"].items() if n in owned},
    }


def _contains_tensor(value) -> bool:
    if torch.is_tensor(value):
        return True
    if isinstance(value, dict):
        return any(_contains_tensor(k) or _contains_tensor(v) for k, v in value.items())
    if isinstance(value, (list, tuple, set)):
        return any(_contains_tensor(v) for v in value)
    return False


def _gather_worker(rank: int, world: int) -> dict:
    object_payloads: list[tuple[str, bool]] = []
    p2p_batches: list[list[tuple[str, int]]] = []
    originals = {name: getattr(dist, name) for name in OBJECT_COLLECTIVES + ("batch_isend_irecv",)}

    def spy(name):
        def wrapped(*args, **kwargs):
            payload = list(args[:2]) + list(kwargs.values())
            object_payloads.append((name, _contains_tensor(payload)))
            return originals[name](*args, **kwargs)
        return wrapped

    def spy_p2p(ops):
        p2p_batches.append([(op.op.__name__, op.tensor.numel() * op.tensor.element_size()) for op in ops])
        return originals["batch_isend_irecv"](ops)

    for name in OBJECT_COLLECTIVES:
        setattr(dist, name, spy(name))
    dist.batch_isend_irecv = spy_p2p
    try:
        full, _ = trained_state()
        merged = ckpt.gather_named_state(owned_part(full, rank, world))
        p2p_world = list(p2p_batches)
        # A subgroup of global ranks 1 and 2: its rank 0 is global rank 1.
        subgroup = dist.new_group([1, 2])
        sub = None
        if rank in (1, 2):
            sub = ckpt.gather_named_state(owned_part(full, rank - 1, 2), group=subgroup)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return {"merged": merged, "sub": sub, "object_payloads": object_payloads, "p2p_world": p2p_world}


def assert_same_state(got: dict, want: dict, merged: bool = True) -> None:
    """``got`` holds ``want``'s tensors, bitwise, on CPU; merged states are sorted by name."""
    order = sorted if merged else list
    assert list(got["state"]) == order(want["state"]), "state keyed by name"
    for name, entries in want["state"].items():
        assert set(got["state"][name]) == set(entries), name
        for key, value in entries.items():
            mine = got["state"][name][key]
            assert mine.device.type == "cpu" and mine.dtype == value.dtype and mine.shape == value.shape, (name, key)
            assert torch.equal(mine, value), (name, key)
    assert got["param_groups"] == want["param_groups"]
    assert list(got["master_weights"]) == order(want["master_weights"])
    for name, value in want["master_weights"].items():
        assert torch.equal(got["master_weights"][name], value), name


@pytest.fixture(scope="module")
def gathered():
    return run_distributed(_gather_worker, 3, timeout=120)


def test_gathered_state_equals_the_single_process_state(gathered):
    want, _ = trained_state()
    assert_same_state(gathered[0]["merged"], want)
    assert gathered[1]["merged"] is None and gathered[2]["merged"] is None
    # Over the subgroup [1, 2], its rank 0 (global rank 1) gets everything.
    assert gathered[0]["sub"] is None and gathered[2]["sub"] is None
    assert_same_state(gathered[1]["sub"], want)


def test_no_tensor_goes_through_an_object_collective(gathered):
    for rank, result in enumerate(gathered):
        calls = result["object_payloads"]
        assert calls, f"rank {rank}: the skeletons are expected to go through gather_object"
        pickled_tensors = [name for name, has_tensor in calls if has_tensor]
        assert not pickled_tensors, f"rank {rank}: tensors pickled through {pickled_tensors}"
    # Over the world group, every point-to-point batch moves one tensor's bytes, never a pack of several:
    # rank 0 receives, in order, exactly what ranks 1 and 2 send, one tensor per batch.
    want, _ = trained_state()
    expected = []
    for r in (1, 2):
        tensors: list[torch.Tensor] = []
        ckpt.split_tensors({k: v for k, v in owned_part(want, r, 3).items() if k != "param_groups"}, tensors)
        expected += [t.numel() * t.element_size() for t in tensors if t.numel()]  # empty ones are not sent
    received = gathered[0]["p2p_world"]
    sent = gathered[1]["p2p_world"] + gathered[2]["p2p_world"]
    assert all(len(batch) == 1 for batch in received + sent)
    assert [op for (op, _), in received] == ["irecv"] * len(expected)
    assert [op for (op, _), in sent] == ["isend"] * len(expected)
    assert [size for (_, size), in received] == [size for (_, size), in sent] == expected


def test_one_process_returns_its_state_on_cpu():
    want, _ = trained_state()
    assert_same_state(ckpt.gather_named_state(want), want, merged=False)


def test_tensor_skeleton_round_trip():
    want, _ = trained_state()
    tensors: list[torch.Tensor] = []
    skeleton = ckpt.split_tensors(want, tensors)
    assert not _contains_tensor(skeleton) and len(tensors) > 10
    pickle.loads(pickle.dumps(skeleton))  # picklable without a tensor in it
    assert_same_state(ckpt.fill_tensors(skeleton, tensors), want, merged=False)


# --- what a sharded checkpoint holds is read with weights_only=True ---------------------------


class NotAllowed:
    """A class torch.load(weights_only=True) refuses."""


def _sharded(path, groups_extra=None, meta_extra=None):
    meta = {"layerwise": {"format": ckpt.FORMAT, "version": ckpt.FORMAT_VERSION}, "epoch": 1,
            "hyper_parameters": {"lr": 0.02, "ns_dtype": torch.bfloat16, "betas": (0.9, 0.95), "name": None},
            "callbacks": {"ModelCheckpoint": {"best_model_score": torch.tensor(0.5), "dirpath": "/x"}},
            **(meta_extra or {})}
    groups = [{"lr": 0.02, "ns_dtype": torch.bfloat16, "betas": (0.9, 0.95), "use_muon": True, "params": ["w"],
               **(groups_extra or {})}]
    state = {ckpt.MODEL_KEY: {"w": torch.arange(6.0).view(2, 3)},
             ckpt.optimizer_key(0): {"state": {"w": {"momentum_buffer": torch.ones(2, 3)}}, "param_groups": groups}}
    ckpt.save_sharded(path, state, meta)  # one process: no process group
    return meta, state


def _load(path, weights_only=None):
    meta, metadata = ckpt.read_sharded_metadata(path, weights_only)
    entries = {p: ckpt.empty_like_item(item) for p, item in ckpt.checkpoint_items(metadata).items()}
    state = ckpt.nest(entries)
    ckpt.load_sharded(path, state, weights_only=weights_only)
    return meta, state


def test_a_sharded_checkpoint_reads_back_with_weights_only(tmp_path):
    meta, state = _sharded(tmp_path / "ok")
    loaded_meta, loaded = _load(tmp_path / "ok")
    assert loaded_meta["hyper_parameters"] == meta["hyper_parameters"]
    assert torch.equal(loaded[ckpt.MODEL_KEY]["w"], state[ckpt.MODEL_KEY]["w"])
    assert loaded[ckpt.optimizer_key(0)]["param_groups"] == state[ckpt.optimizer_key(0)]["param_groups"]


def test_meta_pt_with_a_refused_object_raises_naming_it(tmp_path):
    _sharded(tmp_path / "c", meta_extra={"hyper_parameters": {"config": NotAllowed()}})
    with pytest.raises(ckpt.CheckpointError, match=r"meta.pt' holds an object of test_checkpoint_gather\.NotAllowed"
                                                    r", which torch.load\(weights_only=True\) does not load.*"
                                                    r"add_safe_globals.*weights_only=False"):
        ckpt.read_sharded_metadata(tmp_path / "c")
    meta, _ = _load(tmp_path / "c", weights_only=False)  # the caller's explicit choice
    assert isinstance(meta["hyper_parameters"]["config"], NotAllowed)


def test_a_saved_object_with_a_refused_class_raises_naming_it(tmp_path):
    _sharded(tmp_path / "c", groups_extra={"hook": NotAllowed()})
    with pytest.raises(ckpt.CheckpointError, match=r"entry 'optimizer_0.param_groups.0.hook' holds an object of "
                                                    r"test_checkpoint_gather\.NotAllowed"):
        _load(tmp_path / "c")
    _, state = _load(tmp_path / "c", weights_only=False)
    assert isinstance(state[ckpt.optimizer_key(0)]["param_groups"][0]["hook"], NotAllowed)


def test_an_index_with_a_foreign_global_raises(tmp_path):
    _sharded(tmp_path / "c")
    index_file = tmp_path / "c" / ckpt.DCP_METADATA_FILENAME
    with open(index_file, "rb") as f:
        index = pickle.load(f)
    index.storage_meta.modules = [NotAllowed()]
    with open(index_file, "wb") as f:
        pickle.dump(index, f)
    with pytest.raises(ckpt.CheckpointError, match=r"refers to test_checkpoint_gather\.NotAllowed, which a torch"):
        ckpt.read_sharded_metadata(tmp_path / "c")
    with pytest.raises(ckpt.CheckpointError, match=r"NotAllowed"):
        ckpt.load_sharded(tmp_path / "c", {ckpt.MODEL_KEY: {"w": torch.empty(2, 3)}})
