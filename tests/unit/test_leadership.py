"""The controller's leader election in one process (each acquisition opens the lock file anew, as another process
would): one leader at a time, and every leader's epoch larger than every earlier one's."""

from __future__ import annotations

import os

import pytest

from rlfleet.workers.controller.leadership import EPOCH_FILE, NotLeader, acquire


def test_every_leader_takes_a_larger_epoch_than_those_before_and_keeps_it_on_disk(tmp_path):
    epochs = []
    for _ in range(3):
        leader = acquire(tmp_path)
        epochs.append(leader.epoch)
        leader.release()
    assert epochs == [1, 2, 3]
    assert (tmp_path / EPOCH_FILE).read_text() == "3\n"


def test_a_contender_leads_only_once_the_leader_is_gone(tmp_path):
    leader = acquire(tmp_path)
    with pytest.raises(NotLeader, match=rf"held after 0.3 s by pid {os.getpid()} on .*, epoch 1: another controller"):
        acquire(tmp_path, timeout=0.3)
    leader.release()
    leader.release()  # a second release is harmless
    assert acquire(tmp_path, timeout=5).epoch == 2, "the contender that gave up took no epoch"


def test_an_epoch_file_that_holds_no_epoch_is_refused_naming_it(tmp_path):
    (tmp_path / EPOCH_FILE).write_text("seven\n")
    with pytest.raises(ValueError, match=rf"{EPOCH_FILE} holds 'seven', not a leader epoch"):
        acquire(tmp_path)
    (tmp_path / EPOCH_FILE).write_text("41\n")
    assert acquire(tmp_path).epoch == 42, "the refused acquisition must not hold the lock"
