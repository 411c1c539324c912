"""The prompt ledger: every prompt handed out is trained once or dropped for a reason, in writing.

`prompts.jsonl` in the run directory gets one line per prompt once its fate is settled: the step that
trained it, with how many of its samples trained and how many were too stale, or why it was not
trained. Prompts still open (being generated, with partial rollouts, or waiting in the buffer)
are held here as well, so a checkpoint can save the partial rollouts in flight and a resumed run
finishes them instead of losing them.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path
from typing import Any

from rlfleet.workers.controller.rollouts import Group, Rollout, Turn, sampled_turn
from rlfleet.workers.data.tasks import Example

PROMPTS_FILE = "prompts.jsonl"
# Outcomes; every one but "trained" is a counted reason for a prompt not to be trained.
TRAINED, STALE, TOO_FEW, UNFINISHED = "trained", "dropped_stale", "dropped_too_few_fresh", "unfinished_at_end"
# Never generated: longer than the generators' prompt budget (filtered at the feed), or refused by a
# generator as a request it can never serve (INVALID_ARGUMENT).
TOO_LONG, REFUSED = "dropped_too_long", "dropped_refused"
OUTCOMES = (TRAINED, STALE, TOO_FEW, UNFINISHED, TOO_LONG, REFUSED)
_SAVED = ("sample_id", "prompt_ids", "finished")


class PromptLedger:
    """Open prompts by data position, and the settled ones appended to prompts.jsonl.

    Producers change rollouts only while holding `lock`, so a checkpoint reads consistent ones.
    """

    def __init__(self, run_dir: Path):
        self.path = run_dir / PROMPTS_FILE
        self.lock = threading.RLock()
        self._open: dict[int, Group] = {}

    def opened(self, group: Group) -> None:
        """A group is being generated; a re-issued prompt replaces its earlier attempt."""
        with self.lock:
            self._open[group.position] = group

    def settle(self, step: int, rollouts: list[Rollout], fresh: list[Rollout], trained: bool) -> None:
        """Write down the prompts of the batch of `step` (0-based): trained or why not."""
        fresh_ids = {id(r) for r in fresh}
        by_prompt: dict[int, list[Rollout]] = {}
        for rollout in rollouts:
            by_prompt.setdefault(rollout.prompt, []).append(rollout)
        lines = []
        for position, group in by_prompt.items():
            used = sum(id(r) in fresh_ids for r in group)
            outcome = STALE if not used else TRAINED if trained else TOO_FEW
            lines.append(_line(position, step, outcome, used if outcome == TRAINED else 0, len(group) - used))
        with self.lock:
            for position in by_prompt:
                self._open.pop(position, None)
        _append(self.path, lines)

    def dropped(self, position: int, step: int, outcome: str) -> None:
        """The prompt at `position` (of the batch for `step`) will never be generated."""
        with self.lock:
            self._open.pop(position, None)
        _append(self.path, [_line(position, step, outcome, 0, 0)])

    def in_flight(self) -> list[dict[str, Any]]:
        """Open prompts with their partial rollouts, as JSON: a resumed run goes on with them."""
        with self.lock:
            return [_saved(g) for _, g in sorted(self._open.items())]

    def close(self, last_step: int) -> None:
        """The run is over after `last_step`: prompts still open are written down as unfinished."""
        with self.lock:
            lines = [_line(position, last_step, UNFINISHED, 0, 0) for position in sorted(self._open)]
            self._open.clear()
        _append(self.path, lines)


def restored_groups(saved: list[dict[str, Any]]) -> list[Group]:
    """The groups a checkpoint saved with `in_flight`, ready to be generated further."""
    groups = []
    for item in saved:
        example = Example(**item["example"])
        rollouts = [Rollout(prompt=item["position"], answer=example.answer, turns=_turns(r),
                            **{k: r[k] for k in _SAVED}) for r in item["rollouts"]]
        groups.append(Group(item["position"], example, rollouts))
    return groups


def _turns(saved: dict[str, Any]) -> list[Turn]:
    if "turns" not in saved:  # a checkpoint from before turns: its rollouts in flight were sampled
        return [sampled_turn(saved["completion_ids"], saved["gen_logprobs"], saved["versions"])] \
            if saved["completion_ids"] else []
    return [Turn(t["kind"], tuple(t["token_ids"]), tuple(t["versions"]), tuple(t["logprobs"]))
            for t in saved["turns"]]


def _saved(group: Group) -> dict[str, Any]:
    # Taken under the lock: producers keep extending the rollouts (a turn itself never changes).
    return {"position": group.position, "example": dataclasses.asdict(group.example),
            "rollouts": [{"turns": [dataclasses.asdict(t) for t in r.turns], **{k: getattr(r, k) for k in _SAVED}}
                         for r in group.rollouts]}


def _line(position: int, step: int, outcome: str, trained: int, stale: int) -> dict[str, Any]:
    # Steps are 0-based in the code; prompts.jsonl, like metrics.jsonl, counts them from 1.
    return {"prompt": position, "step": step + 1, "outcome": outcome, "samples_trained": trained, "samples_stale": stale}


def _append(path: Path, lines: list[dict[str, Any]]) -> None:
    if lines:
        with open(path, "a", encoding="utf-8") as handle:
            handle.write("".join(json.dumps(line) + "\n" for line in lines))
