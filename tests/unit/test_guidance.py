"""Off-policy guidance (algorithm.guidance: answer): a group that scored nothing gets its reference answer as its last
completion, scored like any other, with NaN sampling log-probs; everything else is left as it was."""

from __future__ import annotations

import math

import pytest

from conftest import make_job
from fleet_fakes import FakeGenerator, make_parts, start_producers, train
from rlfleet.v1 import scorer_pb2
from rlfleet.workers.controller.guidance import Guidance, is_guide
from rlfleet.workers.controller.record import Clock, step_record
from rlfleet.workers.controller.rollouts import Group, Rollout
from rlfleet.workers.data.tasks import Example
from rlfleet.workers.scorer.stage import RuleScoring
from rlfleet.workers.spec import SpecError

EOS = 0


def text(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids if i != EOS)


def ids_of(answer: str) -> list[int]:
    return [ord(c) for c in answer] + [EOS]


class RightAnswers:
    """A scorer: 1 for a completion whose last word is the answer (never for a negative one, as a scorer may refuse
    a guide)."""

    def Score(self, request, timeout=None):
        return scorer_pb2.ScoreResponse(scores=[
            scorer_pb2.Score(sample_id=i.sample_id, reward=float(i.completion.split(" ")[-1] == i.answer != "-4"))
            for i in request.items])


def guided_job():
    return make_job(algorithm={"guidance": "answer", "groupSize": 3}, generation={"maxNewTokens": 10})


def group(position: int, answer: str, completions: list[str], solution: str = "") -> Group:
    rollouts = [Rollout(sample_id=f"0-{position}-{n}", prompt=position, prompt_ids=[1, 2], answer=answer,
                        completion_ids=ids_of(c), gen_logprobs=[-1.0] * len(ids_of(c)),
                        versions=[3 + n] * len(ids_of(c)), finished=True)
                for n, c in enumerate(completions)]
    return Group(position, Example(id=str(position), prompt=f"q{position}", answer=answer, solution=solution), rollouts)


def guided_stages(job, parts) -> list:
    """The scoring and guidance stages a guided job's batches go through."""
    scoring = RuleScoring(job, [RightAnswers()], text)
    return [scoring, Guidance(job, [scoring], parts.ledger, ids_of)]


def guided(tmp_path, groups: list[Group]) -> list[Group]:
    job = guided_job()
    parts, _ = make_parts(job, tmp_path, [FakeGenerator()])
    for stage in guided_stages(job, parts):
        stage.annotate(0, groups)
    return groups


def test_a_group_that_scored_nothing_gets_its_answer_as_its_last_completion(tmp_path):
    [wrong] = guided(tmp_path, [group(0, "12", ["1", "2", "3"])])
    first, guide = wrong.rollouts[:2], wrong.rollouts[-1]
    assert [text(r.completion_ids) for r in first] == ["1", "2"] and [r.reward for r in first] == [0.0, 0.0]
    assert guide.completion_ids == ids_of("12") and guide.reward == 1.0 and guide.sample_id == "0-0-2"
    assert all(math.isnan(x) for x in guide.gen_logprobs) and len(guide.gen_logprobs) == 3
    # As fresh as the newest token of its group: a guide never makes a group stale.
    assert guide.versions == [5, 5, 5] and guide.finished and is_guide(guide)
    assert not any(is_guide(r) for r in first)


def test_the_guide_is_the_examples_worked_solution_where_it_has_one(tmp_path):
    [wrong] = guided(tmp_path, [group(0, "8", ["1", "2", "3"], solution="5 + 3 = 8")])
    assert wrong.rollouts[-1].completion_ids == ids_of("5 + 3 = 8") and wrong.rollouts[-1].reward == 1.0


def test_groups_with_a_reward_or_without_a_usable_answer_are_left_as_they_were(tmp_path):
    solved = group(0, "12", ["1", "12", "3"])
    too_long = group(1, "1234567890", ["1", "2", "3"])  # 11 tokens with its end, past maxNewTokens 10
    refused = group(2, "-4", ["1", "2", "3"])  # the scorers give the answer itself no reward
    before = [[(r.completion_ids, r.gen_logprobs) for r in g.rollouts] for g in (solved, too_long, refused)]
    guided(tmp_path, [solved, too_long, refused])
    assert [[(r.completion_ids, r.gen_logprobs) for r in g.rollouts] for g in (solved, too_long, refused)] == before
    assert [r.reward for r in solved.rollouts] == [0.0, 1.0, 0.0]


def test_a_guided_run_trains_every_step_and_its_record_counts_the_guides_apart(tmp_path):
    """Through the producers: every generated completion is wrong, so each group holds one guide, and the
    record's reward is the samples' (0), not the guides'."""
    job = make_job(algorithm={"guidance": "answer", "groupSize": 2, "promptsPerStep": 3, "steps": 3})
    generators = [FakeGenerator()]
    parts, fleet = make_parts(job, tmp_path, generators)
    parts.stages = guided_stages(job, parts)
    start_producers(parts, generators)
    for step, batch in train(parts, fleet, range(3)):
        assert [is_guide(r) for r in batch.rollouts] == [False, True] * 3
        record = step_record(step, batch, batch.rollouts, [], {}, 0.0, Clock([], "t"))
        assert record["guides"] == 3 and record["reward_mean"] == 0.0


def test_guidance_refuses_a_kl_penalty_in_the_reward():
    with pytest.raises(SpecError, match="algorithm.guidance answer cannot go with algorithm.kl.use reward"):
        make_job(algorithm={"guidance": "answer", "kl": {"use": "reward"}})


def test_a_solution_ends_as_a_generated_completion_does():
    """The controller's encoding of a solution: its tokens, then the end-of-text token a finished completion ends on."""
    from rlfleet.workers.controller.loop import completion_ids
    from rlfleet.workers.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    ids = completion_ids(tokenizer, "3 - 14 = -11")
    assert ids[-1] == tokenizer.eos_token_id and tokenizer.decode(ids[:-1]) == "3 - 14 = -11"
