"""A number-guessing environment: the policy guesses the data row's answer, and each wrong guess gets "higher" or
"lower" back, until it finds the number (reward 1, less `cost` per wrong guess) or runs out of turns (maxTurns).

A data row: {"prompt": "", "answer": "37"}. The job names the class:

    roles:
      environment: {type: python, path: guess_env.py, class: Guess, kwargs: {high: 100}, maxTurns: 8}
"""

import re

from rlfleet.workers.environment.protocol import Environment, Step


class Guess(Environment):
    def __init__(self, high: int = 100, cost: float = 0.1):
        self.high = high
        self.cost = cost

    def reset(self, example):
        self.target = int(example.answer)
        self.wrong = 0
        return [{"role": "user", "content": f"I am thinking of a whole number from 1 to {self.high}. Guess it: "
                                            "answer with the number only."}]

    def step(self, reply):
        number = re.search(r"-?\d+", reply)
        if number is None:
            return Step(messages=[{"role": "user", "content": "Answer with a number."}])
        guess = int(number.group())
        if guess == self.target:
            return Step(reward=max(0.0, 1.0 - self.cost * self.wrong), done=True)
        self.wrong += 1
        hint = "higher" if guess < self.target else "lower"
        return Step(messages=[{"role": "user", "content": f"{guess} is wrong: {hint}."}])
