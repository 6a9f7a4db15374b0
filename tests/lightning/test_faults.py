"""A rank that dies, hangs or leaves the job early ends the whole job with an error, and nothing is lost.

Two gloo ranks run ``tests/launch_script.py`` with ``strategy="layerwise"``. Global rank 1
(rank 0 in one test) dies with ``os._exit(1)`` or ``SIGKILL`` of itself in one phase:
inside the model's forward, inside a backward hook, inside ``optimizer.step``, with a
parameter all-gather in flight, while ``torch.distributed.checkpoint`` writes a sharded
checkpoint, or while rank 0 gathers the optimizer state for a full one. Every process
must exit non-zero within ``DEADLINE_S`` of the launch (a hang fails the test, with the
stacks of the process that hangs), and the survivor's stderr must name an error caused by
the lost peer. The strategy gets a short collective timeout (``--timeout_s``), so a
survivor blocked in a collective whose peer is gone fails in bounded time even where the
transport does not notice the closed connection; one test stops (SIGSTOPs) a rank instead,
keeping its connections open, and checks that the survivor fails after that timeout.

The ranks are started as two processes of one "two node" job on loopback (as
``test_two_nodes_on_loopback`` in test_launch.py does), so the test sees each rank's exit
code and stderr, and Lightning's child-process observer (which SIGKILLs the launcher
process within 5 s of a child's failure under the default launcher) cannot end a hang that
the strategy would otherwise leave. ``test_the_launcher_process_dying_ends_its_child``
uses the default launcher (``devices=2``, rank 1 a child of rank 0) with rank 0 dying, and
``test_a_dead_rank_ends_the_job_with_an_error`` the same launcher with rank 1 exiting hard.

A checkpoint written before the death (``step=2.ckpt``: ``ModelCheckpoint`` every 2 steps,
an epoch being 2 steps) must load, and a new 2-rank run resumed from it must end with the
parameters of an uninterrupted run of the same 6 steps. The interrupted save (at step 4)
must leave no checkpoint under its name.

A rank with fewer batches than the other (no ``DistributedSampler``) ends its ``fit`` and exits,
as a script does: the rank left in a training step's reduce-scatter, or in a validation step's
collective, fails naming the peer that is gone (docs/reliability.md lists both under "messages to
improve"). These two run on forked gloo ranks (``tests/_dist.py``) and are not marked slow; every
other test here is.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from torch import nn

from _dist import free_port, run_distributed
from helpers import (LAUNCH_SCRIPT as SCRIPT, ROOT, Tiny, clean_env, outcome, tiny_batches as batches,
                     tiny_trainer as trainer)


DEADLINE_S = 120  # from the launch to the exit of every process
TIMEOUT_S = 20  # the strategy's collective timeout in these runs
STEPS = 6
# 16 samples, batch 4, 2 ranks: an epoch is 2 steps, so the step-2 checkpoint is on an epoch boundary
# and a resumed run sees the batches the uninterrupted one sees. Small buckets: several per step.
COMMON = ["--max_steps", str(STEPS), "--samples", "16", "--bucket_size", "128", "--timeout_s", str(TIMEOUT_S),
          "--no-sync_log"]
# A lost peer, as gloo reports it, or the collective timeout.
PEER_LOST = re.compile(r"Connection reset by peer|Connection closed by peer|timed out|Timed out|timeout", re.I)


@dataclass
class Launch:
    outdir: Path
    args: list[str]
    returncodes: dict[int, int | None] = field(default_factory=dict)  # global rank -> exit code (None: unseen)
    exited_after_s: dict[int, float] = field(default_factory=dict)  # since the launch
    exited_at: dict[int, float] = field(default_factory=dict)  # time.time()
    hung: list[int] = field(default_factory=list)
    killed: list[int] = field(default_factory=list)  # killed by the test once the awaited ranks had exited

    def stderr(self, rank: int) -> str:
        return (self.outdir / f"stderr{rank}.txt").read_text(errors="replace")

    def died(self) -> dict | None:
        found = list(self.outdir.glob("died*.json"))
        return json.loads(found[0].read_text()) if found else None

    def records(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted(self.outdir.glob("rank*.json"))]


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _stop(procs: dict[int, subprocess.Popen], hung: list[int]) -> None:
    """Dumps the stacks of the processes still running (faulthandler on SIGUSR1), then kills them."""
    for rank in hung:
        procs[rank].send_signal(signal.SIGUSR1)
    time.sleep(3)
    for rank in hung:
        procs[rank].kill()
        procs[rank].wait()


def launch_ranks(outdir: Path, args: list[str], deadline_s: float = DEADLINE_S,
                 await_ranks: tuple[int, ...] = (0, 1)) -> Launch:
    """Starts global ranks 0 and 1 as two processes (two "nodes" on loopback) and waits until ``await_ranks``
    exited, or the deadline; then kills what still runs (after dumping its stacks if it was awaited)."""
    outdir.mkdir(parents=True, exist_ok=True)
    port = str(free_port())
    launch = Launch(outdir, args)
    procs: dict[int, subprocess.Popen] = {}
    start = time.monotonic()
    for rank in range(2):
        env = clean_env(NODE_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        with open(outdir / f"stderr{rank}.txt", "w") as err, open(outdir / f"stdout{rank}.txt", "w") as out:
            procs[rank] = subprocess.Popen(
                [sys.executable, SCRIPT, str(outdir), "--devices", "1", "--num_nodes", "2", *args],
                env=env, cwd=ROOT, stdout=out, stderr=err)
    while any(rank not in launch.returncodes for rank in await_ranks):
        for rank, proc in procs.items():
            if rank not in launch.returncodes and proc.poll() is not None:
                launch.returncodes[rank] = proc.returncode
                launch.exited_after_s[rank] = time.monotonic() - start
                launch.exited_at[rank] = time.time()
        if time.monotonic() - start > deadline_s:
            launch.hung = [rank for rank in await_ranks if rank not in launch.returncodes]
            _stop(procs, launch.hung)
            break
        time.sleep(0.05)
    for rank, proc in procs.items():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            launch.killed.append(rank)
    return launch


def death_args(phase: str, step: int, rank: int = 1, how: str = "exit", fmt: str = "sharded") -> list[str]:
    return [*COMMON, "--ckpt_every", "2", "--checkpoint_format", fmt, "--die_in", phase, "--die_at_step", str(step),
            "--die_rank", str(rank), "--die_how", how]


# phase -> (global step of the death, how the rank dies, checkpoint format)
DEATHS = {
    "forward": (2, "exit", "sharded"),
    "backward": (2, "sigkill", "sharded"),
    "optimizer_step": (2, "exit", "sharded"),
    "all_gather": (2, "sigkill", "full"),
    "save_sharded": (4, "exit", "sharded"),
    "save_full": (4, "exit", "full"),
}


def surfaced_in(stderr: str) -> str:
    """Where the survivor's first error surfaced: its innermost lightning_layerwise functions, without the
    wait helpers (``Collective.wait``, ``_wait``)."""
    first = stderr.split("During handling of the above exception", 1)[0]
    frames = [f"{module}.{function}" for module, function
              in re.findall(r'lightning_layerwise/([\w/]+)\.py", line \d+, in (\w+)', first)
              if (module, function) not in (("collectives", "wait"), ("data_parallel", "_wait"))]
    return " > ".join(frames[-2:]) if frames else "?"


def first_error(stderr: str) -> str:
    found = re.search(r"^(?:\[rank\d\]: )?(\w+(?:\.\w+)*(?:Error|Exception)): (.*)$", stderr, re.M)
    return f"{found.group(1)}: {found.group(2)[:200]}" if found else ""


def assert_every_rank_failed(launch: Launch, survivor: int, dead: int, phase: str) -> dict:
    """Both processes ended in time with non-zero codes, the dead one where it should, the survivor with an error."""
    assert not launch.hung, (f"{phase}: rank(s) {launch.hung} still ran {DEADLINE_S} s after the launch; where they "
                             f"blocked:\n" + "\n".join(launch.stderr(r)[-6000:] for r in launch.hung))
    died = launch.died()
    assert died is not None and died["rank"] == dead and died["phase"] == phase, (
        f"{phase}: rank {dead} did not die where intended ({died}); its stderr:\n{launch.stderr(dead)[-4000:]}")
    for rank, code in launch.returncodes.items():
        assert code not in (0, None), f"{phase}: rank {rank} exited with {code}:\n{launch.stderr(rank)[-4000:]}"
        assert launch.exited_after_s[rank] < DEADLINE_S
    err = launch.stderr(survivor)
    error = first_error(err)
    assert error, f"{phase}: the survivor (rank {survivor}) names no error:\n{err[-4000:]}"
    assert PEER_LOST.search(err), f"{phase}: the survivor's error is not the lost peer:\n{err[-4000:]}"
    assert not launch.records(), f"{phase}: a fit completed: {launch.records()}"
    if phase in ("forward", "backward", "optimizer_step", "all_gather"):
        # The wrapper names the phase of the failed collective, and teardown does not raise it a
        # second time on top of the original traceback (it abandons the failed collectives).
        assert re.search(r"CollectiveError: the (gradient reduce-scatter|parameter all-gather)", err), err[-4000:]
        assert "During handling of the above exception" not in err, err[-6000:]
    else:  # the checkpoint saves name what failed and that the previous checkpoint is intact
        assert re.search(r"CheckpointError: (saving the sharded checkpoint|gathering the optimizer state to rank 0 "
                         r"for a full checkpoint) .*failed on rank 0 of 2", err), err[-4000:]
    summary = {
        "phase": phase, "dead": dead, "where": died["where"],
        "exit_codes": launch.returncodes,
        "exited_after_launch_s": {r: round(t, 1) for r, t in launch.exited_after_s.items()},
        "survivor_exit_after_death_s": round(launch.exited_at[survivor] - died["time"], 2),
        "survivor_error": error, "surfaced_in": surfaced_in(err),
        "names_failed_rank": bool(re.search(rf"rank[ _]?{dead}\b", error, re.I)),
    }
    print(json.dumps(summary))
    # The survivor fails as soon as its next collective sees the closed connection; the collective
    # timeout bounds it otherwise. Either way within a few timeouts of the death.
    assert summary["survivor_exit_after_death_s"] < 3 * TIMEOUT_S, summary
    return summary


@pytest.fixture(scope="module")
def deaths(tmp_path_factory):
    """phase -> its Launch, run once per module (the resume tests reuse the runs of the phase tests)."""
    cache: dict[str, Launch] = {}

    def run(phase: str) -> Launch:
        if phase not in cache:
            step, how, fmt = DEATHS[phase]
            cache[phase] = launch_ranks(tmp_path_factory.mktemp(f"die_in_{phase}"), death_args(phase, step, how=how,
                                                                                                fmt=fmt))
        return cache[phase]

    return run


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """Rank 0's record after an uninterrupted run of STEPS steps (same data, layout, optimizer)."""
    launch = launch_ranks(tmp_path_factory.mktemp("uninterrupted"), COMMON)
    assert launch.returncodes == {0: 0, 1: 0}, launch.stderr(0)[-3000:] + launch.stderr(1)[-3000:]
    recs = launch.records()
    assert [r["global_step"] for r in recs] == [STEPS, STEPS]
    assert recs[0]["param_checksums"] == recs[1]["param_checksums"]
    return recs[0]


# --- every phase ends the job ------------------------------------------------------------
# Observed on 2 CPU cores (gloo, torch 2.13): the survivor fails within about a second of the
# death in every phase, through gloo noticing the closed TCP connection, never through the
# collective timeout. Its error is gloo's
#   RuntimeError: [.../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:PORT: Connection reset
#   by peer. This is typically caused by a remote worker hanging or bugs in the application. ...
# (or pair.cc:553 "Connection closed by peer [127.0.0.1]:PORT"): it names the peer's address, not its
# rank, and not the phase; the phase shows only in the traceback (the innermost lightning_layerwise
# frame, noted per test below).


@pytest.mark.slow
def test_a_rank_dying_in_forward_ends_the_job(deaths):
    # Rank 1 exits in a forward pre-hook of the second Linear. Rank 0 finishes its forward and backward
    # and fails waiting for the gradient reduce-scatter: data_parallel.finish_grad_sync ->
    # collectives.Collective.wait, "Read error [127.0.0.1]:PORT: Connection reset by peer".
    assert_every_rank_failed(deaths("forward"), survivor=0, dead=1, phase="forward")


@pytest.mark.slow
def test_a_rank_dying_in_backward_ends_the_job(deaths):
    # Rank 1 SIGKILLs itself in a gradient hook of the first layer's weight (after the later buckets'
    # reduce-scatters were dispatched). Rank 0 fails in data_parallel.finish_grad_sync, "Connection reset
    # by peer".
    assert_every_rank_failed(deaths("backward"), survivor=0, dead=1, phase="backward")


@pytest.mark.slow
def test_a_rank_dying_in_optimizer_step_ends_the_job(deaths):
    # Rank 1 exits inside optimizer.step, after the closure (gradients reduced), before updating. Rank 0
    # steps, dispatches its all-gathers and fails in the next forward's pre-hook:
    # data_parallel._wait_oldest_gather, "Connection reset by peer".
    assert_every_rank_failed(deaths("optimizer_step"), survivor=0, dead=1, phase="optimizer_step")


@pytest.mark.slow
def test_a_rank_dying_with_an_all_gather_in_flight_ends_the_job(deaths):
    # Rank 1 SIGKILLs itself right after dispatching the first all-gather of start_param_sync. Rank 0
    # fails waiting for a bucket in the next forward's pre-hook: data_parallel._wait_oldest_gather,
    # "Connection reset by peer".
    assert_every_rank_failed(deaths("all_gather"), survivor=0, dead=1, phase="all_gather")


@pytest.mark.slow
def test_a_rank_dying_while_saving_sharded_ends_the_job(deaths):
    # Rank 1 exits after writing its torch.distributed.checkpoint data file of step=4.ckpt. Rank 0
    # fails in DCP's gather of the write results (checkpoint.save_sharded ->
    # torch.distributed.checkpoint.utils.gather_object), "Connection reset by peer".
    launch = deaths("save_sharded")
    assert_every_rank_failed(launch, survivor=0, dead=1, phase="save_sharded")
    saved = sorted(p.name for p in (launch.outdir / "checkpoints").iterdir())
    assert "step=2.ckpt" in saved and "step=4.ckpt" not in saved, saved  # the interrupted save stays aside


@pytest.mark.slow
def test_a_rank_dying_while_rank0_gathers_a_full_checkpoint_ends_the_job(deaths):
    # Rank 1 exits after sending rank 0 the first optimizer-state tensor for step=4.ckpt. Rank 0 fails
    # receiving the next one: checkpoint.gather_named_state -> receive_tensor -> _exchange,
    # "Connection closed by peer [127.0.0.1]:PORT".
    launch = deaths("save_full")
    assert_every_rank_failed(launch, survivor=0, dead=1, phase="save_full")
    saved = sorted(p.name for p in (launch.outdir / "checkpoints").iterdir())
    assert saved == ["step=2.ckpt"], saved  # rank 0 never got to write step=4


@pytest.mark.slow
def test_the_launcher_process_dying_ends_its_child(tmp_path):
    """Default launcher (devices=2): rank 0, the launcher and host of the rendezvous store, SIGKILLs itself
    in backward. Rank 1, its child, is orphaned (Lightning's observer thread died with rank 0) and must end
    on its own; its exit code cannot be seen (it is no child of the test), so it is checked to be gone."""
    port = str(free_port())
    start = time.monotonic()
    with open(tmp_path / "stderr.txt", "w") as err:
        result = subprocess.run([sys.executable, SCRIPT, str(tmp_path), "--devices", "2",
                                 *death_args("backward", 2, rank=0, how="sigkill")],
                                env=clean_env(MASTER_PORT=port), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err,
                                timeout=DEADLINE_S)
    assert result.returncode == -signal.SIGKILL
    child = json.loads((tmp_path / "started1.json").read_text())["pid"]
    while _pid_alive(child) and time.monotonic() - start < DEADLINE_S:
        time.sleep(0.1)
    if _pid_alive(child):
        os.kill(child, signal.SIGUSR1)  # its stacks, into the shared stderr
        time.sleep(3)
        os.kill(child, signal.SIGKILL)
        pytest.fail("rank 1 still ran after rank 0 died:\n" + (tmp_path / "stderr.txt").read_text()[-6000:])
    ended = time.monotonic() - start
    err = (tmp_path / "stderr.txt").read_text(errors="replace")  # rank 1 inherited the launcher's stderr
    assert re.search(r"^\[rank1\]: \w*Error: ", err, re.M) and PEER_LOST.search(err), err[-4000:]
    # Observed: rank 1 fails in data_parallel.finish_grad_sync, "Connection reset by peer", and exits
    # about a second after rank 0.
    print(json.dumps({"phase": "backward (rank 0, default launcher)", "child_gone_after_launch_s": round(ended, 1),
                      "survivor_error": first_error(err), "surfaced_in": surfaced_in(err)}))
    assert not list(tmp_path.glob("rank*.json"))


@pytest.mark.slow
def test_a_hung_rank_fails_the_survivor_after_the_collective_timeout(tmp_path):
    """Rank 1 stops (SIGSTOP) right after dispatching an all-gather: it hangs with its connections open, so
    nothing tells rank 0 it is gone. Rank 0 must fail after the strategy's collective timeout, not hang."""
    launch = launch_ranks(tmp_path, death_args("all_gather", 2, how="stop"), await_ranks=(0,))
    assert not launch.hung, "rank 0 still ran; where it blocked:\n" + launch.stderr(0)[-6000:]
    assert launch.killed == [1]  # still stopped: the test ends it
    died = launch.died()
    assert died is not None and died["phase"] == "all_gather"
    assert launch.returncodes[0] not in (0, None), launch.stderr(0)[-4000:]
    err = launch.stderr(0)
    # Observed: data_parallel._wait_oldest_gather (next forward's pre-hook) raises, about 21 s after the
    # stop, CollectiveError naming the all-gather, chained to gloo's timeout, which gloo words either
    # "[.../gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 20000ms for send operation to
    # complete" or "Application timeout caused pair closure" (seen in both forms, run to run).
    assert re.search(r"Timed out waiting \d+ms|Application timeout caused pair closure", err), err[-4000:]
    assert re.search(r"CollectiveError: the parameter all-gather", err), err[-4000:]
    after = launch.exited_at[0] - died["time"]
    print(json.dumps({"phase": "all_gather, rank 1 hung", "survivor_exit_after_stop_s": round(after, 2),
                      "survivor_error": first_error(err), "surfaced_in": surfaced_in(err)}))
    assert TIMEOUT_S * 0.9 <= after < 3 * TIMEOUT_S, after


# --- a checkpoint written before the death resumes to the uninterrupted result -----------


# A death at step 2 in the forward, the backward, the step or an all-gather leaves the same step=2 checkpoint,
# written by the same code before it (sharded; full for the all-gather's run, as the save_full run's step=2 is):
# one of them resumes here. The deaths while saving leave their own: the previous checkpoint intact beside a
# partial one.
@pytest.mark.slow
@pytest.mark.parametrize("phase", ["backward", "save_sharded", "save_full"])
def test_resuming_after_a_death_matches_the_uninterrupted_run(tmp_path, deaths, uninterrupted, phase):
    death = deaths(phase)
    assert death.died() is not None, f"rank 1 did not die in {phase}"
    checkpoint = death.outdir / "checkpoints" / "step=2.ckpt"
    assert checkpoint.exists(), sorted(p.name for p in checkpoint.parent.iterdir())
    resumed = launch_ranks(tmp_path, [*COMMON, "--ckpt_path", str(checkpoint)])
    assert resumed.returncodes == {0: 0, 1: 0}, resumed.stderr(0)[-3000:] + resumed.stderr(1)[-3000:]
    recs = resumed.records()
    assert [r["global_step"] for r in recs] == [STEPS, STEPS]
    expected = uninterrupted["param_checksums"]
    for r in recs:
        assert sorted(r["param_checksums"]) == sorted(expected)
        errors = {name: max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["param_checksums"][name], sums))
                  for name, sums in expected.items()}
        worst = max(errors.values())
        print(json.dumps({"phase": phase, "rank": r["global_rank"], "checksum": r["checksum"],
                          "uninterrupted": uninterrupted["checksum"], "max_relative_error": worst,
                          "exact": r["param_checksums"] == expected}))
        assert worst <= 1e-5 and math.isfinite(r["checksum"]), (phase, r["global_rank"], errors)


# --- the default launcher: rank 1 exits hard mid-training ------------------------------------------------


@pytest.mark.slow
def test_a_dead_rank_ends_the_job_with_an_error(tmp_path):
    """Rank 1 exits hard mid-training: rank 0 must fail with an error instead of hanging."""
    result = subprocess.run([sys.executable, SCRIPT, str(tmp_path), "--strategy", "layerwise", "--devices", "2",
                             "--die_at_step", "2"], env=clean_env(MASTER_PORT=str(free_port())), cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "Connection" in result.stderr or "Error" in result.stderr
    assert not list(tmp_path.glob("rank*.json")), "the fit must not complete"


# --- data: ranks with different numbers of batches --------------------------------------------------------------


class StepLogged(Tiny):
    """Logs the validation loss with a collective on every validation step."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True, on_step=True, on_epoch=False)


def _uneven_worker(rank, world, outdir, phase):
    """Rank 0 gets 3 batches, rank 1 gets 2 (no DistributedSampler); each records its outcome and exits at once,
    as a script ends after ``fit`` (the other rank then sees the connection close instead of a timeout)."""
    t = trainer(devices=2, use_distributed_sampler=False, num_sanity_val_steps=0,
                max_steps=-1 if phase == "train" else 2, max_epochs=1,
                **({"val_check_interval": 2} if phase == "validation" else {}))
    uneven = batches(6 if rank == 0 else 4)
    if phase == "train":
        result = outcome(lambda: t.fit(Tiny(), uneven))
    else:
        result = outcome(lambda: t.fit(StepLogged(), batches(8), uneven))
    with open(os.path.join(outdir, f"rank{rank}.txt"), "w") as f:
        f.write(f"{t.global_step}\n{result}")
    os._exit(0)


def _uneven(tmp_path, phase) -> list[tuple[int, str]]:
    with pytest.raises(RuntimeError, match="died without a result"):  # both ranks exit without returning
        run_distributed(_uneven_worker, 2, str(tmp_path), phase, timeout=60)
    found = [(tmp_path / f"rank{r}.txt").read_text().split("\n", 1) for r in range(2)]
    return [(int(step), text) for step, text in found]


# gloo's words for "the other process is gone", whichever socket operation notices it first.
PEER_GONE = r"^RuntimeError: \[.*gloo.*\] .*(Connection (closed|reset) by peer|Broken pipe)"  # Lightning's own
PEER_GONE_IN_WRAPPER = (r"^CollectiveError: the gradient reduce-scatter \(end of backward\) failed on rank 0 of 2: another rank "
             r"died, hung past the collective timeout, or left the job \(RuntimeError: \[.*gloo.*\] .*"
             r"(Connection (closed|reset) by peer|Broken pipe)")


def test_a_rank_with_more_training_batches_waits_for_a_peer_that_has_finished(tmp_path):
    (steps0, result0), (steps1, result1) = _uneven(tmp_path, "train")
    assert (steps1, result1) == (2, "ok"), "the rank with fewer batches ends its fit without a word"
    assert steps0 == 2, "the other never completes its third step"
    assert re.match(PEER_GONE_IN_WRAPPER, result0), result0


def test_a_collective_per_validation_step_with_uneven_validation_batches(tmp_path):
    (_, result0), (steps1, result1) = _uneven(tmp_path, "validation")
    assert (steps1, result1) == (2, "ok")
    assert re.match(PEER_GONE, result0), result0
