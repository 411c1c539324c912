"""End-to-end: RL against a learned reward model moves the policy toward what that model prefers.

The test trains a tiny reward model itself, on synthetic (prompt, completion) pairs labelled by one rule: a
completion that contains the digit 7 is preferred. It never sees the rule again: the run's reward is the reward
model's score alone (the rule scorer's weight is 0), and the policy is judged by sampling from it before and after.
"""

from __future__ import annotations

import statistics

import pytest

from rlfleet.workers.models import default_cache_dir, materialize
from rlfleet.workers.models.tiny import build_tokenizer
from rlfleet.workers.report.runs import bubbles, load_run
from rlfleet.workers.reward_model.toy import PROMPTS, train_digit_preference
from rlfleet.workers.spec import load_job

from runs import job_file, metrics, rlfleet

pytestmark = [pytest.mark.integration, pytest.mark.slow]
STEPS = 40
MAX_NEW_TOKENS = 3


def prefers(completion: str) -> bool:
    return "7" in completion


def share_preferred(model_dir, samples: int = 400, seed: int = 0) -> float:
    """Share of sampled completions (temperature 1, as the run samples) that have the preferred property."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = [PROMPTS[n % len(PROMPTS)] for n in range(samples)]  # all of one length: no padding needed
    inputs = tokenizer(prompts, return_tensors="pt", add_special_tokens=False)
    with torch.random.fork_rng(devices=[]), torch.inference_mode():
        torch.manual_seed(seed)
        out = model.generate(**inputs, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=MAX_NEW_TOKENS, pad_token_id=tokenizer.pad_token_id)
    completions = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    return sum(prefers(c) for c in completions) / len(completions)


def test_rl_against_a_learned_reward_model_moves_the_policy_to_its_preference(tmp_path, model_cache):
    reward_dir = tmp_path / "reward-model"
    accuracy = train_digit_preference(reward_dir, "7", MAX_NEW_TOKENS)
    assert accuracy >= 0.95, f"the reward model did not learn the preference ({accuracy:.2f} on held-out pairs)"

    job = job_file(tmp_path, "rm-run", steps=STEPS, learningRate=0.001, generation={"maxNewTokens": MAX_NEW_TOKENS},
                   checkpoint={"everySteps": STEPS},
                   spec={"roles": {"rewardModel": {"path": str(reward_dir), "weight": 1.0}},
                         "scorers": [{"type": "math_answer", "weight": 0.0}],
                         "evaluation": {"everySteps": 0}})
    run_dir = tmp_path / "run"
    result = rlfleet("run", str(job), "--out", str(run_dir), timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr

    records = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(r["scorer_errors"] == 0 for r in records)
    # The reward is the reward model's score and nothing else.
    assert all(r["reward_mean"] == pytest.approx(r["reward_model_mean"], abs=1e-5) for r in records)
    first = statistics.mean(r["reward_mean"] for r in records[:10])
    last = statistics.mean(r["reward_mean"] for r in records[-10:])
    assert last >= first + 0.3, f"reward did not rise: first 10 steps {first:.3f}, last 10 {last:.3f}"

    # Judged by the rule itself, on the policy before and after: the preferred completions became common.
    spec = load_job(str(job)).spec
    before = share_preferred(materialize(spec.model, default_cache_dir()))
    after = share_preferred(run_dir / "checkpoints" / f"step-{STEPS:06d}")
    assert after >= before + 0.3, f"completions with a 7: {before:.2f} before RL, {after:.2f} after"
    # An executor like the others: its own process, log and bubble time (busy while it scored).
    assert (run_dir / "logs" / "rm-run-reward-0.log").is_file()
    assert bubbles(load_run(run_dir))["reward"].busy > 0
