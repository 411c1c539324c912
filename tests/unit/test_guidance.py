"""Off-policy guidance (algorithm.guidance: answer): a group that scored nothing gets its reference answer as its last
completion, scored like any other, as an unsampled turn that trains; everything else is left as it was."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from conftest import make_job, sampled
from fleet_fakes import FakeGenerator, make_parts, start_producers, train
from rlfleet.v1 import scorer_pb2
from rlfleet.workers import spec
from rlfleet.workers.controller.guidance import Guidance, guide_for
from rlfleet.workers.controller.producer import extend_rollout
from rlfleet.workers.controller.record import GeneratorTimes, step_record
from rlfleet.workers.controller.rollouts import GUIDE, Group, Rollout, set_kl_penalties
from rlfleet.workers.data.tasks import Example
from rlfleet.workers.rl.config import KlPenalty
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


def guided_job(guidance: str = "answer"):
    return make_job(algorithm={"guidance": guidance, "groupSize": 3}, generation={"maxNewTokens": 10})


def group(position: int, answer: str, completions: list[str], solution: str = "") -> Group:
    rollouts = [Rollout(sample_id=f"0-{position}-{n}", prompt=position, prompt_ids=[1, 2], answer=answer,
                        turns=sampled(ids_of(c), [-1.0] * len(ids_of(c)), [3 + n] * len(ids_of(c))), finished=True)
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


def guides_in(stages: list, groups: list[Group]) -> int:
    """How many of `groups` the stages guide."""
    for stage in stages:
        stage.annotate(0, groups)
    return sum(is_guide(g.rollouts[-1]) for g in groups)


def is_guide(rollout: Rollout) -> bool:
    return [turn.kind for turn in rollout.turns] == [GUIDE]


def test_a_group_that_scored_nothing_gets_its_answer_as_its_last_completion(tmp_path):
    [wrong] = guided(tmp_path, [group(0, "12", ["1", "2", "3"])])
    first, guide = wrong.rollouts[:2], wrong.rollouts[-1]
    assert [text(r.completion_ids) for r in first] == ["1", "2"] and [r.reward for r in first] == [0.0, 0.0]
    assert guide.completion_ids == ids_of("12") and guide.reward == 1.0 and guide.sample_id == "0-0-2"
    assert guide.sampled == [False] * 3 and guide.trained == [True] * 3 and guide.gen_logprobs == [0.0] * 3
    # As fresh as the newest token of its group: a guide never makes a group stale.
    assert guide.versions == [5, 5, 5] and guide.version == 5 and guide.finished and is_guide(guide)
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
        record = step_record(step, batch, batch.rollouts, [], {}, 0.0, GeneratorTimes([], "t"))
        assert record["guides"] == 3 and record["reward_mean"] == 0.0


def test_auto_guides_only_while_three_quarters_of_the_newest_groups_scored_nothing(tmp_path):
    """guidance auto over a window of 32 groups: it guides while the policy's own share of groups that scored
    nothing is at least three quarters (guides never count as solving), stops once the policy solves more groups
    itself, and starts again when it loses them."""
    job = guided_job("auto")
    parts, _ = make_parts(job, tmp_path, [FakeGenerator()])
    stages = guided_stages(job, parts)
    wrong = lambda n: [group(k, "12", ["1", "2", "3"]) for k in range(n)]  # noqa: E731
    right = lambda n: [group(k, "12", ["1", "12", "3"]) for k in range(n)]  # noqa: E731
    assert guides_in(stages, wrong(4)) == 4  # 4 of 4 scored nothing
    assert guides_in(stages, wrong(2) + right(2)) == 2  # 6 of 8, though the guides of the first batch scored
    assert guides_in(stages, right(8)) == 0  # 6 of 16
    assert guides_in(stages, wrong(4)) == 0  # all of this batch, but 10 of 20: one batch does not decide
    assert guides_in(stages, wrong(12)) == 0 and guides_in(stages, wrong(4)) == 0  # 22 of 32, twice
    assert guides_in(stages, wrong(4)) == 4  # 24 of 32: the policy lost its rewards, guiding starts again
    assert guides_in(stages, right(4)) == 0  # solved groups leave the window as well: 24 of 32
    assert guides_in(stages, wrong(1) + right(3)) == 1  # 25 of 32 (of all 48 seen, 31: it would not guide)


def test_answer_guides_every_group_that_scored_nothing(tmp_path):
    """The same batches as above under guidance answer: no share decides."""
    job = guided_job("answer")
    parts, _ = make_parts(job, tmp_path, [FakeGenerator()])
    stages = guided_stages(job, parts)
    solved = [group(k, "12", ["1", "12", "3"]) for k in range(12)]
    assert guides_in(stages, solved) == 0 and guides_in(stages, [group(0, "12", ["1", "2", "3"])]) == 1


def test_guidance_answer_refuses_a_kl_penalty_in_the_reward():
    with pytest.raises(SpecError, match="algorithm.guidance answer cannot go with algorithm.kl.use reward"):
        make_job(algorithm={"guidance": "answer", "kl": {"use": "reward"}})


@pytest.mark.parametrize("settings, guides", [
    ({"algorithm": {"guidance": "auto"}}, True),
    ({"algorithm": {"guidance": "auto", "kl": {"use": "reward"}}}, False),
    ({"algorithm": {"guidance": "auto"}, "roles": {"environment": {"type": "tools"}}}, False),
    ({"algorithm": {"guidance": "auto"}, "roles": {"rewardModel": {"path": "/models/reward"}}}, False),
    ({"algorithm": {"guidance": "answer"}, "roles": {"rewardModel": {"path": "/models/reward"}}}, True),
    ({"algorithm": {"guidance": "none"}}, False),
])
def test_auto_is_accepted_everywhere_and_stays_off_where_a_guide_cannot_go(settings, guides):
    """A job may leave auto on with any other setting: it turns itself off where answer is refused, and with a
    learned reward model, whose score at or below 0 is no sign that nothing was found."""
    assert spec.guided(make_job(**settings).spec) is guides


def test_the_kl_penalty_of_a_guide_is_finite():
    """Its tokens were not sampled, so they have no log mu to take a KL of: its penalty sums no token (before turns,
    its NaN log mu made it NaN; the spec refuses the combination, test above). A sample's counts its own tokens."""
    rollouts = [Rollout(sample_id=f"0-0-{n}", prompt=0, prompt_ids=[1, 2], answer="12") for n in range(2)]
    for rollout in rollouts:
        extend_rollout(rollout, SimpleNamespace(token_ids=[7, 8], logprobs=[-1.0, -2.0], finished=True), 3, 10)
    guide = guide_for(Group(0, Example(id="0", prompt="q0", answer="12"), rollouts), ids_of("12"))
    rollouts[0].ref_logprobs, guide.ref_logprobs = [-1.5, -1.0], [-1.0] * 3
    found = set_kl_penalties([rollouts[0], guide], KlPenalty(coef=0.1, estimator="k1", use="reward"))
    assert rollouts[0].kl_penalty == pytest.approx(0.1 * (0.5 - 1.0)) and guide.kl_penalty == 0.0
    assert found == {"kl_penalty_mean": pytest.approx(-0.025)}


def test_a_solution_ends_as_a_generated_completion_does():
    """The controller's encoding of a solution: its tokens, then the end-of-text token a finished completion ends on."""
    from rlfleet.workers.controller.loop import completion_ids
    from rlfleet.workers.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    ids = completion_ids(tokenizer, "3 - 14 = -11")
    assert ids[-1] == tokenizer.eos_token_id and tokenizer.decode(ids[:-1]) == "3 - 14 = -11"
