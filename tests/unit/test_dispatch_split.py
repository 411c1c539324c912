"""A batch split among generator replicas by their measured throughput (dispatch.py, throughput.py): parts in
proportion, whole groups, one batch once all its parts are in, and every guarantee of whole batches kept: each
prompt once, a part handed back goes to a live replica, no stall at maxStaleness 0, restored groups resumed."""

from __future__ import annotations

import json
import threading
import time

from fleet_fakes import DiesOnCall, FakeGenerator, make_parts, start_producers, train

from rlfleet.workers.controller.ledger import PROMPTS_FILE
from rlfleet.workers.controller.rollouts import Batch, Group, Rollout, RolloutBuffer
from rlfleet.workers.controller.throughput import PRIOR, Throughput, part_sizes
from rlfleet.workers.data.tasks import Example

from conftest import make_job, sampled


class PerSequence(FakeGenerator):
    """Takes `seconds` per sequence of a call (an engine's time grows with its batch) and records what it made."""

    def __init__(self, seconds: float, **kwargs):
        super().__init__(**kwargs)
        self.per_sequence = seconds
        self.made: set[str] = set()
        self.lock = threading.Lock()

    def Generate(self, request, timeout=None):
        time.sleep(self.per_sequence * len(request.sequences))
        reply = super().Generate(request, timeout)
        with self.lock:
            self.made.update(s.sample_id for s in request.sequences)
        return reply


def _claim_all(dispatch, replicas: list[int]):
    """Each replica's claim, in turn: the first takes the new batch, the others its open parts."""
    return [dispatch.claim(replica) for replica in replicas]


def _three_to_one(tmp_path):
    """The dispatch of two replicas measured at 300 and 100 tokens a second, batches of 8 prompts."""
    job = make_job(algorithm={"maxStaleness": 1, "steps": 4, "promptsPerStep": 8, "groupSize": 2})
    parts, _ = make_parts(job, tmp_path, [FakeGenerator(), FakeGenerator()])
    parts.dispatch.throughput.observe(0, 300, 1.0)
    parts.dispatch.throughput.observe(1, 100, 1.0)
    return parts.dispatch


def test_part_sizes_follow_the_shares_in_whole_groups():
    assert part_sizes(16, [2 / 3, 1 / 3]) == [11, 5]
    assert part_sizes(16, [0.5, 0.5]) == [8, 8]
    assert part_sizes(3, [0.5, 0.5]) == [2, 1], "a remainder tie goes to the earlier"
    assert part_sizes(8, [0.6, 0.2, 0.2]) == [5, 2, 1], "the largest remainder gets the group left"
    assert part_sizes(7, [0.9, 0.05, 0.05]) == [5, 1, 1], "one group at least, so its rate is measured again"
    assert part_sizes(4, [0.95, 0.05]) == [3, 1]
    assert part_sizes(2, [0.1, 0.1, 0.8]) == [1, 1, 0], "too few groups: the earlier get one"
    assert part_sizes(0, [0.5, 0.5]) == [0, 0]
    assert part_sizes(1, [1.0]) == [1]


def test_throughput_is_smoothed_and_an_unmeasured_replica_counts_as_the_mean():
    rates = Throughput()
    assert rates.shares([0, 1]) == [0.5, 0.5] and rates.measured() == {}
    rates.observe(0, 300, 1.0)
    rates.observe(0, 0, 1.0)  # nothing generated (all refused): no measurement
    assert rates.shares([0, 1]) == [0.5, 0.5], "replica 1 is not measured yet: the mean of those that were"
    rates.observe(1, 100, 1.0)
    assert rates.shares([0, 1]) == [0.75, 0.25]
    rates.observe(1, 300, 1.0)
    assert rates.measured() == {0: 300.0, 1: 200.0}
    assert PRIOR > 0


def test_a_batch_is_split_in_proportion_to_throughput(tmp_path):
    dispatch = _three_to_one(tmp_path)
    slow, fast = _claim_all(dispatch, [1, 0])
    dispatch.replicas.stop()
    assert (len(fast.prompts), len(slow.prompts)) == (6, 2), "the taker keeps its own share, the other's is open"
    assert fast.index == slow.index == 0 and fast.parts == slow.parts == 2
    assert sorted(p.position for p in slow.prompts + fast.prompts) == list(range(8)), "each prompt in one part"
    assert fast.data_position == slow.data_position == 8
    assert sorted([slow.offset, fast.offset]) == [0, 2]


def test_a_slower_replica_never_takes_the_part_of_a_faster_one_that_may_start_it(tmp_path):
    """It would be the straggler of that step: it starts the next batch instead, and takes the part only once the
    faster replica is down."""
    dispatch = _three_to_one(tmp_path)
    slow = dispatch.claim(1)
    assert (slow.index, slow.owner, len(slow.prompts)) == (0, 1, 2)
    ahead = dispatch.claim(1)
    assert (ahead.index, ahead.owner, len(ahead.prompts)) == (1, 1, 2), "not the fast replica's part of batch 0"
    dispatch.replicas.set_down(0)
    taken = dispatch.claim(1)
    assert (taken.index, taken.owner, len(taken.prompts)) == (0, 0, 6), "a down replica's part is anyone's"
    dispatch.replicas.set_up(0, 0)
    fast = dispatch.claim(0)
    assert (fast.index, fast.owner, len(fast.prompts)) == (1, 0, 6)
    dispatch.replicas.stop()


def test_an_idle_faster_replica_takes_a_slower_ones_part(tmp_path):
    dispatch = _three_to_one(tmp_path)
    first, second = _claim_all(dispatch, [0, 0])
    dispatch.replicas.stop()
    assert [(c.index, c.owner, len(c.prompts)) for c in (first, second)] == [(0, 0, 6), (0, 1, 2)]


def test_one_replica_that_may_start_a_batch_takes_it_whole(tmp_path):
    job = make_job(algorithm={"maxStaleness": 0, "steps": 4, "promptsPerStep": 4, "groupSize": 2})
    parts, _ = make_parts(job, tmp_path, [FakeGenerator(), FakeGenerator()])
    dispatch = parts.dispatch
    dispatch.replicas.set_down(1)
    claim = dispatch.claim(0)
    dispatch.replicas.stop()
    assert (len(claim.prompts), claim.parts) == (4, 1)


def test_the_buffer_assembles_a_batch_once_all_its_parts_are_in():
    buffer = RolloutBuffer()

    def part(replica: int, positions: list[int], dropped: dict) -> Batch:
        rollouts = [Rollout(f"0-{p}-0", p, [1], "1") for p in positions]
        return Batch(0, rollouts, 6, visits=len(positions), resumed=1, dropped=dropped, replica=replica, parts=2,
                     shares={replica: len(rollouts)})

    buffer.put(part(1, [4, 0, 5], {"too_long": 1}))
    assert buffer.take(0, timeout=0.01) is None and buffer.depth() == 0, "half a batch never trains"
    buffer.put(part(0, [2, 1], {"refused": 1}))
    batch = buffer.take(0, timeout=0.01)
    assert [r.prompt for r in batch.rollouts] == [0, 1, 2, 4, 5], "in data order"
    assert (batch.replica, batch.shares, batch.visits, batch.resumed) == (1, {1: 3, 0: 2}, 3, 2)
    assert batch.dropped == {"too_long": 1, "refused": 1} and batch.data_position == 6


def test_a_slower_replica_generates_its_share_of_every_step_at_staleness_0(tmp_path):
    """At maxStaleness 0 one batch is open at a time: whole batches would leave a replica idle every step. Every
    step here is generated by both, the faster making more, and each prompt is trained once."""
    steps, per_step = 6, 4
    job = make_job(algorithm={"maxStaleness": 0, "steps": steps, "promptsPerStep": per_step, "groupSize": 2},
                   generation={"maxNewTokens": 4, "segmentTokens": 1})
    generators = [PerSequence(0.01, tokens=3), PerSequence(0.03, tokens=3)]
    parts, fleet = make_parts(job, tmp_path, generators)
    start_producers(parts, generators)
    trained = train(parts, fleet, range(steps), seconds=20)
    assert [step for step, _ in trained] == list(range(steps))
    for step, batch in trained:
        ids = {r.sample_id for r in batch.rollouts}
        assert len(ids) == per_step * 2
        assert all(ids & generator.made for generator in generators), f"step {step}: a replica made none of it"
    later = [batch.shares for _, batch in trained[2:]]
    assert all(shares[0] > shares[1] for shares in later), f"the faster replica's share is larger: {later}"
    lines = [json.loads(line) for line in (tmp_path / PROMPTS_FILE).read_text().splitlines()]
    assert sorted(line["prompt"] for line in lines) == list(range(steps * per_step)), "each prompt once"


def test_a_part_handed_back_goes_to_the_other_replica(tmp_path):
    """Replica 1 takes batch 0, keeps its part and dies on it; replica 0 makes its own part and that one too, at
    maxStaleness 0 where nothing else could make the version the next batch needs."""
    steps = 3
    job = make_job(algorithm={"maxStaleness": 0, "steps": steps, "promptsPerStep": 4, "groupSize": 2},
                   generation={"maxNewTokens": 4, "segmentTokens": 1})
    generators = [FakeGenerator(tokens=3), DiesOnCall(1, tokens=3)]
    parts, fleet = make_parts(job, tmp_path, generators)
    start_producers(parts, generators, [1])
    assert generators[1].called.wait(10)
    start_producers(parts, generators, [0])
    trained = train(parts, fleet, range(steps), seconds=20)
    assert fleet.marked_down == [1]
    assert [(step, batch.shares) for step, batch in trained] == [(0, {0: 8}), (1, {0: 8}), (2, {0: 8})]
    assert all(len(r.completion_ids) == 3 for _, batch in trained for r in batch.rollouts)
    lines = [json.loads(line) for line in (tmp_path / PROMPTS_FILE).read_text().splitlines()]
    assert sorted(line["prompt"] for line in lines) == list(range(steps * 4)), "each prompt once"


def test_a_restored_group_in_a_split_batch_resumes_once(tmp_path):
    job = make_job(algorithm={"maxStaleness": 8, "steps": 2, "promptsPerStep": 2, "groupSize": 2},
                   generation={"maxNewTokens": 4, "segmentTokens": 1})
    # As a checkpoint saved it: one rollout two tokens in (versions 0 and 1), the other finished.
    rollouts = [Rollout("0-3-0", 3, [1], "3", turns=sampled([7, 8], [-1.0, -1.0], [0, 1])),
                Rollout("0-3-1", 3, [1], "3", turns=sampled([7], [-1.0], [0]), finished=True)]
    restored = [Group(3, Example(id="3", prompt="3+0=", answer="3"), rollouts)]
    generators = [FakeGenerator(tokens=3, seconds=0.05), FakeGenerator(tokens=3, seconds=0.05)]
    parts, fleet = make_parts(job, tmp_path, generators, restored=restored, first=1, position=2)
    start_producers(parts, generators)
    batch = parts.buffer.take(1, timeout=30)
    parts.dispatch.replicas.stop()
    assert sorted(batch.shares) == [0, 1], "split between the two replicas"
    assert [r.sample_id for r in batch.rollouts] == ["1-2-0", "1-2-1", "0-3-0", "0-3-1"], "the saved group, once"
    resumed = batch.rollouts[2]
    assert resumed.completion_ids[:2] == [7, 8] and resumed.versions[:2] == [0, 1] and len(resumed.versions) == 3
    assert batch.rollouts[3].completion_ids == [7], "a finished rollout is not generated again"


def test_whole_batches_when_splitting_is_off(tmp_path):
    """The benchmark's baseline (RLFLEET_WHOLE_BATCHES): each batch goes whole to the replica that takes it."""
    job = make_job(algorithm={"maxStaleness": 1, "steps": 4, "promptsPerStep": 4, "groupSize": 2})
    parts, _ = make_parts(job, tmp_path, [FakeGenerator(), FakeGenerator()])
    parts.dispatch.split = False
    first, second = _claim_all(parts.dispatch, [0, 1])
    parts.dispatch.replicas.stop()
    assert [(c.index, len(c.prompts), c.parts) for c in (first, second)] == [(0, 4, 1), (1, 4, 1)]
