"""A read of a sharded parameter that cannot be served, in a plain loop: every rank ends with the same error.

Between steps a rank holds only its shard, and a plain torch loop has no place where every rank is known to
read alike (Note [sharded reads] in ``engine/sharded.py``), so a read there of a parameter the rank does not
step raises :class:`ShardedParameterReadError`, worded for :class:`LayerwiseSession`. When rank 0 alone reads,
the other ranks go on into the next step and wait in its all-gather for rank 0: they learn its error from the
board (Note [failing together] in ``engine/collective_reads.py``) and raise it too, within 60 s, at 2 and 3
ranks, with ``nn.MultiheadAttention`` in the model, also under the timing fuzzer.
"""

from __future__ import annotations

import time

import pytest
import torch

import lightning_layerwise as llw
from _dist import LATE_MS, run_distributed
from helpers import (sharded_batches as batches, sharded_loss as loss_of, sharded_model as make_model,
                     sharded_optimizer as make_optimizer)


def _one_rank_reads_worker(rank, world):
    session = llw.LayerwiseSession(llw.LayerwiseConfig(shard_parameters=True, bucket_size=1000))
    model = make_model("attention")
    opt = make_optimizer("adamw", model)
    wrapped = session.wrap(model, opt)
    not_mine = next(n for n, p in model.named_parameters() if not wrapped.records.owns(p))
    start = time.monotonic()
    try:
        for step, (idx, target) in enumerate(batches("attention")):
            opt.zero_grad()
            session.backward(loss_of(wrapped, idx.chunk(world)[rank], target.chunk(world)[rank]))
            session.step(opt)
            if step == 1 and rank == 0:
                model.get_parameter(not_mine).sum()  # rank 0 alone, between steps
    except llw.ShardedParameterReadError as error:
        session.release()  # inside the handler: a failed run issues no collective
        return not_mine if rank == 0 else None, str(error), time.monotonic() - start
    session.release()
    return None, "no error", time.monotonic() - start


@pytest.mark.slow
@pytest.mark.parametrize("late", [None, LATE_MS], ids=["now", "late"])
@pytest.mark.parametrize("world", [2, 3])
def test_a_read_between_steps_on_one_rank_ends_every_rank_with_its_error(world, late):
    results = run_distributed(_one_rank_reads_worker, world, late_ms=late, timeout=120)
    name = results[0][0]
    for rank, (_, message, seconds) in enumerate(results):
        assert seconds < 60, (rank, seconds)
        assert message.startswith(f"{name!r} was read by ") and "sum on rank 0 while its bucket" in message, message
        assert "outside the forward of the model that session.wrap returned" in message, message
        assert "After session.release() the module holds every parameter again." in message, message
        assert "trainer" not in message.lower() and "fabric" not in message.lower(), message
        assert rank == 0 or "(raised on rank 0;" in message, message


class _Work:
    """A collective's handle that completes when ``done`` is set."""

    def __init__(self, done) -> None:
        self.done = done

    def wait(self, timeout=None):
        if not self.done.wait(timeout.total_seconds() if timeout is not None else None):
            raise RuntimeError("timed out")

    def is_completed(self) -> bool:
        return self.done.is_set()


def _board_pair():
    import torch.distributed as dist

    from lightning_layerwise.engine.collective_reads import FailureBoard

    store = dist.HashStore()
    return FailureBoard(store, 0, 2), FailureBoard(store, 1, 2)


def test_a_rank_posting_sees_the_error_another_rank_posts_at_the_same_read_before_it_goes_on():
    """Rank 1 posts first; rank 0, raising at the same read, posts its own error in the moment between rank 1
    reading how many errors there are and finding its own seen by every rank. Rank 1 must count rank 0's error
    as seen before its post returns: left unseen, a later wait of rank 1 (after a collective issued before the
    read completed) raised it as another rank's failure (a run of the suite ended so)."""
    import threading
    import time

    board0, board1 = _board_pair()
    posted = threading.Event()

    class RacingStore:  # rank 1's view of the store: rank 0 posts just as rank 1 first reads its acknowledgement
        def __init__(self, store) -> None:
            self.store, self.fired = store, False

        def add(self, key, amount):
            if key == "seen/1" and amount == 0 and not self.fired:
                self.fired = True
                threading.Thread(target=lambda: (board0.post("rank 0's read"), posted.set())).start()
                while board0.seen < 2:  # rank 0 has posted and seen both errors
                    time.sleep(0.001)
            return self.store.add(key, amount)

        def __getattr__(self, name):
            return getattr(self.store, name)

    board1.store = RacingStore(board1.store)
    board1.post("rank 1's read")
    assert posted.wait(10), "rank 0's post returned once rank 1 had seen its error"
    assert board1.seen == 2 and board1.unseen() is None


def test_ranks_that_each_raise_and_go_on_do_not_end_on_each_others_error():
    """Both ranks read outside the rules, each raises and catches it (Note [failing together]); rank 1 posts
    only after rank 0 has left its post (the order a loaded machine gives). Rank 0, waiting in the next
    collective, must not raise rank 1's error: it went past the same failure. A rank that did not raise still
    does (the one-rank case above)."""
    import threading

    from lightning_layerwise.engine.collective_reads import ShardedParameterReadError

    for rank0_raised in (True, False):
        board0, board1 = _board_pair()
        if rank0_raised:
            board0.store.add("errors", 1)
            board0.store.set("error/1", "0\nrank 0's read")
            board0.store.add("seen/1", 2)  # seen by both: rank 0's post returned
            board0.seen, board0.raised, board1.seen = 1, True, 1
        done = threading.Event()

        def rank1():
            board1.post("rank 1's read")  # returns once rank 0 has seen it
            done.set()  # rank 1 goes on into the collective rank 0 waits in

        thread = threading.Thread(target=rank1)
        thread.start()
        try:
            if rank0_raised:
                board0.wait(_Work(done))
                assert not board0.raised, "a completed collective ends what rank 0 went past"
            else:
                with pytest.raises(ShardedParameterReadError, match="rank 1's read"):
                    board0.wait(_Work(done))
        finally:
            done.set()
            thread.join()
