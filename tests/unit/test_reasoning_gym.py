"""reasoning-gym tasks: prompts and held-out problems from its datasets, graded by each dataset's own check."""

from __future__ import annotations

import itertools

import pytest
import yaml
from bad_jobs import job

from rlfleet.workers import cli
from rlfleet.workers.data.tasks import task_for
from rlfleet.workers.scorer.batch import Scoring
from rlfleet.workers.scorer.config import ReasoningGym
from rlfleet.workers.spec import parse_job

# Sums and differences of two one-digit numbers: 200 problems, so 300 training draws repeat held-out ones.
SMALL = {"chain_sum": {"weight": 1, "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}}


def gym_job(**data) -> dict:
    return job(data={"type": "reasoning_gym", **data}, scorers=[{"type": "reasoning_gym"}])


def gym_task(**data):
    return task_for(parse_job(gym_job(**data)).spec.data)


def prompts(task, count: int, start: int = 0) -> list[str]:
    return [example.prompt for example in itertools.islice(task.train(start), count)]


def test_problems_are_a_function_of_the_seed_and_the_position():
    mix = {"chain_sum": 1, "word_sorting": 1}
    first, again = (gym_task(datasets=mix, size=20, heldOut=5, seed=3) for _ in range(2))
    assert list(itertools.islice(first.train(), 25)) == list(itertools.islice(again.train(), 25))
    assert first.held_out() == again.held_out()
    assert prompts(first, 5, start=7) == prompts(first, 12)[7:]
    assert prompts(first, 20) != prompts(gym_task(datasets=mix, size=20, heldOut=5, seed=4), 20)


def test_the_mix_follows_the_weights():
    sources = [example.fields["metadata"]["source_dataset"]
               for example in itertools.islice(gym_task(datasets={"chain_sum": 1, "word_sorting": 3}).train(), 200)]
    assert 0.6 < sources.count("word_sorting") / len(sources) < 0.9
    assert sources.count("chain_sum") + sources.count("word_sorting") == len(sources)


def test_held_out_problems_are_distinct_and_never_trained_on():
    task = gym_task(datasets=SMALL, size=300, heldOut=40)
    held_out = [example.prompt for example in task.held_out()]
    assert 20 < len(held_out) == len(set(held_out)) <= 40
    assert not set(prompts(task, 300)) & set(held_out)


def test_each_problem_carries_what_its_check_needs():
    example = gym_task(datasets=SMALL, size=5, heldOut=0).example(0)
    assert example.fields["metadata"]["source_dataset"] == "chain_sum"
    assert example.fields["dataset_config"] == SMALL["chain_sum"]["config"]
    assert example.id == "gym:chain_sum:0"


def test_the_question_is_asked_through_the_template():
    chat = gym_task(datasets=SMALL, size=5, heldOut=0).example(0)
    assert chat.messages[0]["role"] == "system" and "<answer>" in chat.messages[0]["content"]
    assert chat.messages[1] == {"role": "user", "content": chat.prompt}
    assert chat.prompt.startswith("State the final answer")
    assert gym_task(datasets=SMALL, size=5, heldOut=0, systemPrompt="").example(0).messages == []
    plain = gym_task(datasets=SMALL, size=5, heldOut=0, template="plain", systemPrompt="Just the number.").example(0)
    assert plain.prompt == f"Just the number.\n\n{chat.prompt}" and plain.messages == []


def wrong_answer(example) -> str:
    """A wrong answer of the same kind as the right one."""
    metadata = example.fields["metadata"]
    if metadata["source_dataset"] == "chain_sum":
        return str(int(example.answer) + 1)
    if metadata["source_dataset"] == "knights_knaves":  # every inhabitant's role flipped
        knight, knave = metadata["knight_knave_terms"]["knight"], metadata["knight_knave_terms"]["knave"]
        return example.answer.replace(knight, "\0").replace(knave, knight).replace("\0", knave)
    return ", ".join(reversed(example.answer.split(", ")))  # word_sorting: the other order


@pytest.mark.parametrize("dataset", ["chain_sum", "knights_knaves", "word_sorting"])
def test_the_scorer_grades_by_the_datasets_own_check(dataset):
    examples = gym_task(datasets={dataset: 1}, size=5, heldOut=3).held_out()
    completions = [("Let me think. <answer>{}</answer>", lambda e: e.answer),
                   ("<answer>{}</answer>", wrong_answer),
                   ("{}", lambda e: e.answer)]  # no tags: no answer
    items = [(text.format(answer(e)), e.answer, e.prompt, e.fields) for text, answer in completions for e in examples]
    with Scoring([ReasoningGym()]) as scoring:
        scores = [item.scores["reasoning_gym"] for item in scoring.score(items)]
    right, wrong, untagged = scores[:3], scores[3:6], scores[6:]
    assert right == [1.0, 1.0, 1.0]
    assert all(score < 1.0 for score in wrong)
    assert untagged == [0.0, 0.0, 0.0]


def test_without_an_answer_tag_the_whole_completion_is_the_answer():
    example = gym_task(datasets=SMALL, size=5, heldOut=1).held_out()[0]
    items = [(f" {example.answer}\n", example.answer, example.prompt, example.fields),
             (wrong_answer(example), example.answer, example.prompt, example.fields)]
    with Scoring([ReasoningGym(answer_tag=None)]) as scoring:
        assert [item.reward for item in scoring.score(items)] == [1.0, 0.0]


@pytest.mark.parametrize("datasets, message", [
    ({"chain_summ": 1}, "data.datasets.chain_summ: no such reasoning-gym dataset (106 exist): did you mean chain_sum"),
    ({"chain_sum": {"config": {"maxTerms": 3}}},
     "data.datasets.chain_sum.config: no option maxTerms (it has: min_terms, max_terms,"),
    ({"chain_sum": {"config": {"min_terms": 0}}}, "data.datasets.chain_sum.config: min_terms must be positive"),
])
def test_validate_refuses_a_dataset_or_option_that_does_not_exist(tmp_path, datasets, message):
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(gym_job(datasets=datasets)))
    with pytest.raises(SystemExit) as refused:
        cli.main(["validate", str(tmp_path / "job.yaml")])
    assert message in str(refused.value.code)
