"""An environment that gives a wrong answer one more try: "Not quite. Try again." The reward stays the scorers'.

With the tiny model's plain chat template, the chat rendered with that turn is not an exact prefix of the policy's
tokens (its template ends an assistant turn with a newline, the policy with its end-of-text token), and in a job with
a critic or a reference an episode that drifts ends there (docs/environments.md): metrics.jsonl counts them
(episodes_drifted). A template that writes the policy's turns as sampled (a real model's, or `toolCalls: true`'s)
plays the second try.
"""

import re

from rlfleet.workers.environment.protocol import Environment, Step


class SecondTry(Environment):
    def reset(self, example):
        self.answer = example.answer.strip()
        self.tries = 0

    def step(self, reply):
        self.tries += 1
        numbers = re.findall(r"-?\d+", reply)
        if self.tries > 1 or (numbers and numbers[-1] == self.answer):
            return Step(done=True)
        return Step(messages=[{"role": "user", "content": "Not quite. Try again."}])
