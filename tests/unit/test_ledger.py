"""The prompt ledger and the producers around it: no prompt is lost or trained twice, and no run stalls,
whatever a generator does: dies mid-batch and never returns, comes and goes, refuses a prompt, or fails
in its engine."""

from __future__ import annotations

import itertools
import json
import random
import threading
import time

import grpc
import pytest
from fleet_fakes import DiesOnCall, FakeGenerator, RpcFailure, examples, make_parts, start_producers, train

from rlfleet.workers.controller.dispatch import MAX_TOO_LONG_IN_A_ROW, NoPromptFits, PromptFeed
from rlfleet.workers.controller.ledger import (
    OUTCOMES,
    PROMPTS_FILE,
    REFUSED,
    STALE,
    TOO_FEW,
    TOO_LONG,
    TRAINED,
    UNFINISHED,
    PromptLedger,
    restored_groups,
)
from rlfleet.workers.controller.producer import MAX_ENGINE_FAILURES
from rlfleet.workers.controller.rollouts import Group, Rollout, Stopped, split_stale
from rlfleet.workers.data.tasks import Example
from rlfleet.workers.wire import Misconfigured

from conftest import make_job, sampled


def _group(position: int, versions: list[list[int]], finished: bool = True) -> Group:
    example = Example(id=f"p{position}", prompt=f"{position}+0=", answer=str(position))
    rollouts = [Rollout(sample_id=f"s{position}-{g}", prompt=position, prompt_ids=[1, 2], answer=example.answer,
                        turns=sampled([5] * len(v), [-1.0] * len(v), v), finished=finished)
                for g, v in enumerate(versions)]
    return Group(position, example, rollouts)


def _lines(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / PROMPTS_FILE).read_text().splitlines()]


def _assert_each_prompt_once(run_dir, steps: int, per_step: int) -> list[dict]:
    lines = _lines(run_dir)
    positions = sorted(line["prompt"] for line in lines)
    assert positions == list(range(len(positions))), "a prompt was lost or written twice"
    assert {line["outcome"] for line in lines} <= set(OUTCOMES)
    generated = [line for line in lines if line["outcome"] not in (TOO_LONG, REFUSED, UNFINISHED)]
    assert all(sum(line["step"] == s for line in generated) == per_step for s in range(1, steps + 1))
    return lines


def test_settled_prompts_are_written_once_with_their_outcome(tmp_path):
    ledger = PromptLedger(tmp_path)
    groups = [_group(0, [[3], [3]]), _group(1, [[1], [3]]), _group(2, [[0], [1]])]
    for group in groups:
        ledger.opened(group)
    rollouts = [r for g in groups for r in g.rollouts]
    fresh, _ = split_stale(rollouts, step=3, max_staleness=1)
    ledger.settle(3, rollouts, fresh, trained=True)
    ledger.settle(4, [r for r in _group(7, [[4]]).rollouts], [], trained=True)
    lines = {line["prompt"]: line for line in _lines(tmp_path)}
    assert lines[0] == {"prompt": 0, "step": 4, "outcome": TRAINED, "samples_trained": 2, "samples_stale": 0}
    assert (lines[1]["outcome"], lines[1]["samples_trained"], lines[1]["samples_stale"]) == (TRAINED, 1, 1)
    assert (lines[2]["outcome"], lines[2]["samples_stale"]) == (STALE, 2)
    assert ledger.in_flight() == []


def test_a_batch_too_small_to_train_is_counted_not_trained(tmp_path):
    ledger = PromptLedger(tmp_path)
    group = _group(0, [[0]])
    ledger.settle(0, group.rollouts, group.rollouts, trained=False)
    assert _lines(tmp_path)[0]["outcome"] == TOO_FEW and _lines(tmp_path)[0]["samples_trained"] == 0


def test_in_flight_prompts_survive_a_checkpoint_round_trip(tmp_path):
    ledger = PromptLedger(tmp_path)
    partial = _group(4, [[2, 3], []], finished=False)
    ledger.opened(partial)
    saved = json.loads(json.dumps(ledger.in_flight()))
    [back] = restored_groups(saved)
    assert back.position == 4 and back.example == partial.example
    assert [r.versions for r in back.rollouts] == [[2, 3], []]
    assert [r.completion_ids for r in back.rollouts] == [[5, 5], []]
    assert not back.finished and all(r.prompt == 4 for r in back.rollouts)


def test_a_rows_fields_survive_a_checkpoint_of_its_prompt_in_flight(tmp_path):
    """The python scorers of a resumed run get the fields of the row its open prompts came from."""
    ledger = PromptLedger(tmp_path)
    group = _group(4, [[2]], finished=False)
    group.example = Example(id="line-3", prompt="p", answer="1", fields={"tests": [[1, 2]], "level": "easy"})
    ledger.opened(group)
    [back] = restored_groups(json.loads(json.dumps(ledger.in_flight())))
    assert back.example.fields == {"tests": [[1, 2]], "level": "easy"}


def test_an_in_flight_chat_prompt_keeps_its_turns_through_a_checkpoint(tmp_path):
    ledger = PromptLedger(tmp_path)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "4+0="}]
    partial = _group(4, [[2]], finished=False)
    partial.example = Example(id="line-4", prompt="4+0=", answer="4", messages=chat)
    ledger.opened(partial)
    [back] = restored_groups(json.loads(json.dumps(ledger.in_flight())))
    assert back.example == partial.example and back.example.messages == chat


def test_open_prompts_at_the_end_are_written_as_unfinished(tmp_path):
    ledger = PromptLedger(tmp_path)
    ledger.opened(_group(3, [[1]], finished=False))
    ledger.close(9)
    assert _lines(tmp_path) == [{"prompt": 3, "step": 10, "outcome": UNFINISHED, "samples_trained": 0,
                                 "samples_stale": 0}]


@pytest.mark.parametrize("max_staleness", [0, 2])
def test_a_generator_lost_mid_batch_for_good_stalls_nothing(max_staleness, tmp_path):
    """The review's interleaving: replica 0 dies on batch 0 while replica 1 waits for the weights its
    next batch needs. The batch handed back must go to replica 1 (at maxStaleness 0 nothing else can
    make version 1), and the run must reach its last step with every prompt accounted for."""
    steps = 8
    job = make_job(algorithm={"maxStaleness": max_staleness, "steps": steps, "promptsPerStep": 2, "groupSize": 2},
                   generation={"maxNewTokens": 4, "segmentTokens": 1})
    # Replica 0 takes batch 0 first and fails on its 2nd segment, slowly enough for replica 1 to be waiting.
    generators = [DiesOnCall(1, tokens=3, seconds=0.2), FakeGenerator(tokens=3)]
    parts, fleet = make_parts(job, tmp_path, generators)
    start_producers(parts, generators, [0])
    assert generators[0].called.wait(10)
    start_producers(parts, generators, [1])
    trained = train(parts, fleet, range(steps), seconds=20)
    assert fleet.marked_down == [0] and not generators[0].alive
    assert [step for step, _ in trained] == list(range(steps))
    _assert_each_prompt_once(tmp_path, steps, per_step=2)


@pytest.mark.parametrize("seed", range(6))
def test_random_deaths_and_returns_never_stall_nor_lose_a_prompt(seed, tmp_path):
    """Replicas die and come back at random moments, mid-batch or idle; one always stays up."""
    steps, rng = 15, random.Random(seed)
    job = make_job(algorithm={"maxStaleness": rng.choice([0, 1, 2]), "steps": steps, "promptsPerStep": 3,
                              "groupSize": 2}, generation={"maxNewTokens": 3, "segmentTokens": 1})
    generators = [FakeGenerator(tokens=rng.randint(1, 3), seconds=0.002) for _ in range(3)]
    parts, fleet = make_parts(job, tmp_path, generators)
    start_producers(parts, generators)
    chaos = _Chaos(generators, rng)
    try:
        trained = train(parts, fleet, range(steps), seconds=20)
    finally:
        chaos.stop()
    assert [step for step, _ in trained] == list(range(steps))
    assert chaos.kills > 0
    _assert_each_prompt_once(tmp_path, steps, per_step=3)


class _Chaos:
    """Every few milliseconds kills or revives a random replica other than the last one standing."""

    def __init__(self, generators: list[FakeGenerator], rng: random.Random):
        self.generators, self.rng, self.kills = generators, rng, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.rng.uniform(0.005, 0.05)):
            generator = self.rng.choice(self.generators)
            if generator.alive and sum(g.alive for g in self.generators) > 1:
                generator.alive, self.kills = False, self.kills + 1
            elif not generator.alive:
                generator.alive = True

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


class RefusesLong(FakeGenerator):
    """Refuses any request holding a prompt of more than 2 tokens, as an engine refuses what exceeds it."""

    def Generate(self, request, timeout=None):
        if any(len(s.prompt_ids) > 2 for s in request.sequences):
            raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, "prompt exceeds the engine's budget")
        return super().Generate(request, timeout)


def _lengths(lengths: dict[int, int]):
    """Encodes the example at each position to `lengths[position]` tokens (default 1)."""
    return lambda example: [1] * lengths.get(int(example.id), 1)


def test_prompts_over_the_budget_are_filtered_at_the_feed_and_counted(tmp_path):
    steps = 3
    job = make_job(algorithm={"maxStaleness": 1, "steps": steps, "promptsPerStep": 2, "groupSize": 2})
    generators = [RefusesLong()]
    parts, fleet = make_parts(job, tmp_path, generators, max_prompt_tokens=2, encode=_lengths({1: 3, 4: 9}))
    start_producers(parts, generators)
    trained = train(parts, fleet, range(steps))
    lines = {line["prompt"]: line["outcome"] for line in _assert_each_prompt_once(tmp_path, steps, per_step=2)}
    assert lines[1] == lines[4] == TOO_LONG and list(lines.values()).count(TOO_LONG) == 2
    assert [batch.dropped.get(TOO_LONG, 0) for _, batch in trained] == [1, 1, 0]
    assert all(len(batch.rollouts) == 4 for _, batch in trained), "a filtered prompt is replaced, not missed"


def _cycle(size: int):
    """A train stream cycling over `size` examples, as a data file's does."""
    return (Example(id=str(n % size), prompt="", answer="0") for n in itertools.count())


def _too_long(example: Example) -> list[int]:
    """Every prompt over a budget of 4 tokens; example n has n + 5."""
    return [1] * (int(example.id) + 5)


def test_a_run_whose_prompts_never_fit_fails_naming_the_field_and_the_longest(tmp_path):
    """Not a silent hang writing the ledger for ever: at most MAX_TOO_LONG_IN_A_ROW drops, each written once."""
    job = make_job(algorithm={"maxStaleness": 1, "steps": 3, "promptsPerStep": 2, "groupSize": 2})
    generators = [FakeGenerator(), FakeGenerator()]
    parts, fleet = make_parts(job, tmp_path, generators, data=_cycle(50), max_prompt_tokens=4, encode=_too_long)
    start_producers(parts, generators)
    with pytest.raises(Stopped) as stopped:
        train(parts, fleet, range(3), seconds=30)
    message = str(stopped.value.__cause__)
    assert isinstance(stopped.value.__cause__, NoPromptFits), message
    assert "spec.generation.maxNewTokens" in message and "spec.data" in message, message
    assert f"{MAX_TOO_LONG_IN_A_ROW} prompts in a row" in message, message
    assert "example '49' at data position 49, has 54 tokens" in message, message
    lines = _lines(tmp_path)
    assert [line["prompt"] for line in lines] == list(range(MAX_TOO_LONG_IN_A_ROW))
    assert {line["outcome"] for line in lines} == {TOO_LONG}


def test_a_feed_fails_once_a_whole_pass_over_the_data_is_too_long(tmp_path):
    ledger = PromptLedger(tmp_path)
    feed = PromptFeed(_cycle(50), 0, 3, 2, 0, encode=_too_long, max_prompt_tokens=4, ledger=ledger, pass_size=50)
    for index in range(2):  # the batch that failed, and any later one
        with pytest.raises(NoPromptFits, match=r"50 prompts in a row \(a whole pass over the data\)"):
            feed.take(index)
    assert [line["prompt"] for line in _lines(tmp_path)] == list(range(50)), "each prompt of the pass, once"


def test_a_prompt_that_fits_restarts_the_count(tmp_path):
    """Long prompts here and there, more in all than a pass but never a pass in a row: the run goes on."""
    ledger = PromptLedger(tmp_path)
    stream = (Example(id=str(n), prompt="", answer="0") for n in itertools.count())
    feed = PromptFeed(stream, 0, 100, 1, 0, encode=lambda example: [1] * (1 if int(example.id) % 5 == 4 else 9),
                      max_prompt_tokens=4, ledger=ledger, pass_size=5)
    assert [feed.take(index).prompts[0].position for index in range(20)] == list(range(4, 100, 5))


def test_prompts_are_read_outside_the_dispatch_lock(tmp_path):
    """A slow tokenizer must not hold up the receivers: a push acknowledged while a batch's prompts are read lands."""
    job = make_job(algorithm={"maxStaleness": 1, "steps": 1, "promptsPerStep": 1, "groupSize": 2})
    acknowledged = []

    def encode(example):
        ack = threading.Thread(target=parts.dispatch.replicas.advance, args=(0, 1))
        ack.start()
        ack.join(10)  # a deadlock guard, not a timing bound: under the lock the acknowledgement waits for us
        acknowledged.append(not ack.is_alive())
        return [1]

    parts, fleet = make_parts(job, tmp_path, [FakeGenerator()], encode=encode)
    parts.dispatch.claim(0)
    assert acknowledged == [True]
    assert parts.dispatch.replicas.version(0) == 1


def test_a_prompt_the_generator_refuses_is_dropped_once_and_the_run_goes_on(tmp_path):
    """A prompt past the feed's check that the engine still refuses (INVALID_ARGUMENT): only it is lost."""
    steps = 3
    job = make_job(algorithm={"maxStaleness": 1, "steps": steps, "promptsPerStep": 3, "groupSize": 2})
    generators = [RefusesLong(), RefusesLong()]
    parts, fleet = make_parts(job, tmp_path, generators, max_prompt_tokens=100, encode=_lengths({2: 5, 7: 5}))
    start_producers(parts, generators)
    trained = train(parts, fleet, range(steps))
    lines = {line["prompt"]: line["outcome"] for line in _lines(tmp_path)}
    assert sorted(lines) == list(range(9)) and len(_lines(tmp_path)) == 9
    assert lines[2] == lines[7] == REFUSED and list(lines.values()).count(REFUSED) == 2
    assert [batch.dropped.get(REFUSED, 0) for _, batch in trained] == [1, 0, 1]
    assert not fleet.marked_down, "a refused request says nothing about the replica's health"


class RefusesThenDies(RefusesLong):
    """Refuses a batch and its long prompt alone, then is lost while asked for the next prompt alone."""

    def __init__(self):
        super().__init__()
        self.requests = 0

    def Generate(self, request, timeout=None):
        self.requests += 1
        self.alive = self.requests < 3
        return super().Generate(request, timeout)


def test_a_prompt_refused_before_its_replica_is_lost_is_dropped_once(tmp_path):
    """The batch goes back without it: the replica that takes it over does not refuse it and count it again."""
    steps = 2
    job = make_job(algorithm={"maxStaleness": 1, "steps": steps, "promptsPerStep": 3, "groupSize": 2})
    generators = [RefusesThenDies(), RefusesLong()]
    parts, fleet = make_parts(job, tmp_path, generators, max_prompt_tokens=100, encode=_lengths({0: 5}))
    start_producers(parts, generators, replicas=[0])  # alone, so it takes batch 0
    deadline = time.monotonic() + 30
    while not fleet.marked_down:
        assert time.monotonic() < deadline, "replica 0 was never lost"
        time.sleep(0.01)
    start_producers(parts, generators, replicas=[1])
    trained = train(parts, fleet, range(steps))
    lines = [line for line in _lines(tmp_path) if line["outcome"] == REFUSED]
    assert [line["prompt"] for line in lines] == [0], "the refused prompt was written down more than once"
    assert [batch.dropped.get(REFUSED, 0) for _, batch in trained] == [1, 0]


class EngineError(FakeGenerator):
    def Generate(self, request, timeout=None):
        self.calls += 1
        raise RpcFailure(grpc.StatusCode.UNKNOWN, "CUDA out of memory")


def test_a_batch_that_keeps_failing_in_the_engine_fails_the_run_with_the_error(tmp_path):
    job = make_job(algorithm={"maxStaleness": 1, "steps": 3, "promptsPerStep": 1, "groupSize": 2})
    generators = [EngineError()]
    parts, fleet = make_parts(job, tmp_path, generators)
    start_producers(parts, generators)
    with pytest.raises(Stopped) as stopped:
        train(parts, fleet, range(3), seconds=10)
    assert "failed in the generators' engine 3 times" in str(stopped.value.__cause__)
    assert "CUDA out of memory" in str(stopped.value.__cause__)
    assert generators[0].calls == MAX_ENGINE_FAILURES


class WrongToken(FakeGenerator):
    def Generate(self, request, timeout=None):
        raise RpcFailure(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")


def test_a_call_refused_for_its_credentials_stops_the_run(tmp_path):
    job = make_job(algorithm={"maxStaleness": 1, "steps": 2, "promptsPerStep": 1, "groupSize": 2})
    parts, fleet = make_parts(job, tmp_path, [WrongToken()])
    start_producers(parts, [WrongToken()])
    with pytest.raises(Stopped) as stopped:
        train(parts, fleet, range(2), seconds=10)
    assert isinstance(stopped.value.__cause__, Misconfigured)
    assert not fleet.marked_down, "marking it down would only loop: down, rejoin, refused again"


def test_a_restarted_feed_finishes_restored_prompts_first(tmp_path):
    job = make_job(algorithm={"maxStaleness": 8, "steps": 2, "promptsPerStep": 1, "groupSize": 2},
                   generation={"maxNewTokens": 4, "segmentTokens": 1})
    restored = restored_groups(json.loads(json.dumps([
        {"position": 1, "example": {"id": "1", "prompt": "1+0=", "answer": "1"},
         "rollouts": [{"sample_id": "0-0-0", "prompt_ids": [1], "completion_ids": [7, 8], "gen_logprobs": [-1.0, -1.0],
                       "versions": [0, 1], "finished": False},
                      {"sample_id": "0-0-1", "prompt_ids": [1], "completion_ids": [7], "gen_logprobs": [-1.0],
                       "versions": [0], "finished": True}]}])))
    # As the controller resumes at step 1, data position 1: the prompt at position 1 was half generated.
    generator = FakeGenerator(tokens=3)
    parts, fleet = make_parts(job, tmp_path, [generator], restored=restored, first=1, position=1,
                              data=examples(1))
    start_producers(parts, [generator])
    batch = parts.buffer.take(1, timeout=30)
    parts.dispatch.replicas.stop()
    assert [r.sample_id for r in batch.rollouts] == ["0-0-0", "0-0-1"], "the saved group, not a new one"
    resumed = batch.rollouts[0]
    assert resumed.completion_ids[:2] == [7, 8] and resumed.versions[:2] == [0, 1] and len(resumed.versions) == 3
    assert batch.rollouts[1].completion_ids == [7], "a finished rollout is not generated again"
