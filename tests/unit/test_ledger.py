"""The prompt ledger and the producers around it: no prompt is lost or trained twice, even when a
generator fails mid-batch or the run resumes from a checkpoint."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import grpc

from rlfleet.workers.controller.ledger import PROMPTS_FILE, STALE, TOO_FEW, TRAINED, UNFINISHED, PromptLedger, restored_groups
from rlfleet.workers.controller.links import VersionGate
from rlfleet.workers.controller.producer import PromptFeed, RolloutProducer
from rlfleet.workers.controller.rollouts import Group, Rollout, RolloutBuffer, split_stale
from rlfleet.workers.data.tasks import Example

from conftest import make_job
from test_staleness import SegmentedGenerator, parts_for


def _group(position: int, versions: list[list[int]], finished: bool = True) -> Group:
    example = Example(id=f"p{position}", prompt=f"{position}+0=", answer=str(position))
    rollouts = [Rollout(sample_id=f"s{position}-{g}", prompt=position, prompt_ids=[1, 2], answer=example.answer,
                        completion_ids=[5] * len(v), gen_logprobs=[-1.0] * len(v), versions=v, finished=finished)
                for g, v in enumerate(versions)]
    return Group(position, example, rollouts)


def _lines(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / PROMPTS_FILE).read_text().splitlines()]


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


def test_open_prompts_at_the_end_are_written_as_unfinished(tmp_path):
    ledger = PromptLedger(tmp_path)
    ledger.opened(_group(3, [[1]], finished=False))
    ledger.close(10)
    assert _lines(tmp_path) == [{"prompt": 3, "step": 10, "outcome": UNFINISHED, "samples_trained": 0,
                                 "samples_stale": 0}]


class Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE


class DyingGenerator(SegmentedGenerator):
    """Answers `calls` Generate calls, then fails as a killed process's channel does."""

    def __init__(self, calls: int):
        super().__init__()
        self.calls = calls
        self.called = threading.Event()

    def Generate(self, request):
        self.called.set()
        if self.calls == 0:
            raise Unavailable()
        self.calls -= 1
        return super().Generate(request)


def test_a_failed_generators_batch_goes_to_the_other(tmp_path):
    steps = 6
    job = make_job(algorithm={"maxStaleness": 8, "steps": steps, "promptsPerStep": 2, "groupSize": 2},
                   generation={"maxNewTokens": 4, "segmentTokens": 1})
    examples = [SimpleNamespace(prompt=str(n), answer="1") for n in range(100)]
    gates, buffer = [VersionGate(0), VersionGate(0)], RolloutBuffer()
    parts = parts_for(job, examples, gates, buffer, tmp_path, steps, 2)
    # Replica 0 dies on its 2nd call, in the middle of its first batch; replica 1 must do the rest.
    dying = DyingGenerator(1)
    producers = [RolloutProducer(parts, dying, 0), RolloutProducer(parts, SegmentedGenerator(), 1)]
    producers[0].start()
    assert dying.called.wait(10)
    producers[1].start()
    for step in range(steps):
        batch = buffer.take(step, timeout=30)
        assert batch is not None, f"batch {step} never came"
        parts.ledger.settle(step, batch.rollouts, batch.rollouts, trained=True)
    parts.ledger.close(steps)
    for gate in gates:
        gate.stop()
    assert parts.links.down and parts.links.down[0][0] == 0
    lines = _lines(tmp_path)
    positions = sorted(line["prompt"] for line in lines)
    assert positions == list(range(len(positions))), "a prompt was lost or written twice"
    trained = [line for line in lines if line["outcome"] == TRAINED]
    assert len(trained) == steps * 2


def test_a_restarted_feed_finishes_restored_prompts_first(tmp_path):
    job = make_job(algorithm={"maxStaleness": 8, "steps": 2, "promptsPerStep": 1, "groupSize": 2},
                   generation={"maxNewTokens": 4, "segmentTokens": 1})
    restored = restored_groups(json.loads(json.dumps([
        {"position": 1, "example": {"id": "a", "prompt": "0+0=", "answer": "0"},
         "rollouts": [{"sample_id": "0-0-0", "prompt_ids": [1], "completion_ids": [7, 8], "gen_logprobs": [-1.0, -1.0],
                       "versions": [0, 1], "finished": False},
                      {"sample_id": "0-0-1", "prompt_ids": [1], "completion_ids": [7], "gen_logprobs": [-1.0],
                       "versions": [0], "finished": True}]}])))
    examples = [SimpleNamespace(prompt=str(n), answer="1") for n in range(1, 10)]
    parts = parts_for(job, examples, [VersionGate(1)], RolloutBuffer(), tmp_path, 2, 1)
    # As the controller resumes at step 1, data position 1: the prompt at position 1 was half generated.
    parts.feed = PromptFeed(iter(examples), 1, 2, 1, 1, restored=restored)
    producer = RolloutProducer(parts, SegmentedGenerator(), 0)
    thread = threading.Thread(target=producer.run, daemon=True)
    thread.start()
    batch = parts.buffer.take(1, timeout=30)
    parts.links.gates[0].stop()
    assert [r.sample_id for r in batch.rollouts] == ["0-0-0", "0-0-1"], "the saved group, not a new one"
    resumed = batch.rollouts[0]
    assert resumed.completion_ids[:2] == [7, 8] and resumed.versions[:2] == [0, 1] and len(resumed.versions) == 3
    assert batch.rollouts[1].completion_ids == [7], "a finished rollout is not generated again"
