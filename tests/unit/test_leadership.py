"""The controller's leader election in one process (each acquisition opens the lock file anew, as another process
would): one leader at a time, and every leader's epoch larger than every earlier one's, even one of another run
directory before (a new pod's)."""

from __future__ import annotations

import os
import time

import pytest

from rlfleet.workers.controller.leadership import EPOCH_FILE, EPOCH_STRIDE, NotLeader, acquire


def test_every_leader_takes_a_larger_epoch_than_those_before_and_keeps_it_on_disk(tmp_path):
    epochs = []
    for _ in range(3):
        leader = acquire(tmp_path)
        epochs.append(leader.epoch)
        leader.release()
    assert epochs[0] < epochs[1] < epochs[2]
    assert (tmp_path / EPOCH_FILE).read_text() == f"{epochs[2]}\n"


def test_a_leader_of_a_new_run_directory_outranks_the_leaders_before(tmp_path):
    """A trainer pod rescheduled with an emptyDir starts with no epoch file, while its generators live on and know
    the old leader's epoch: from 1 again, the new leader would be fenced until it had restarted past it."""
    for name in ("old", "new"):
        (tmp_path / name).mkdir()
    old = acquire(tmp_path / "old")
    old.release()
    assert acquire(tmp_path / "new").epoch > old.epoch
    assert old.epoch >= time.time_ns() // 1_000 - 60_000_000, "an epoch from the clock, in microseconds"


def test_a_contender_leads_only_once_the_leader_is_gone(tmp_path):
    leader = acquire(tmp_path)
    with pytest.raises(NotLeader, match=rf"held after 0.3 s by pid {os.getpid()} on .*, epoch {leader.epoch}: another controller"):
        acquire(tmp_path, timeout=0.3)
    assert (tmp_path / EPOCH_FILE).read_text() == f"{leader.epoch}\n", "the contender that gave up took no epoch"
    leader.release()
    leader.release()  # a second release is harmless
    assert acquire(tmp_path, timeout=5).epoch > leader.epoch


def test_an_epoch_file_that_holds_no_epoch_is_refused_naming_it(tmp_path):
    (tmp_path / EPOCH_FILE).write_text("seven\n")
    with pytest.raises(ValueError, match=rf"{EPOCH_FILE} holds 'seven', not a leader epoch"):
        acquire(tmp_path)
    ahead = time.time_ns() // 1_000 + 3_600_000_000  # an epoch ahead of the clock is counted on from
    (tmp_path / EPOCH_FILE).write_text(f"{ahead}\n")
    assert acquire(tmp_path).epoch == ahead + EPOCH_STRIDE, "the refused acquisition must not hold the lock"
