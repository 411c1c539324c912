"""The text summary of a run: speed, reward, staleness and the bubble ratio of each executor."""

from __future__ import annotations

import statistics

from rlfleet.workers.report.runs import Run, bubbles, evaluations, held_out_key

ROLE_ORDER = ("generator", "scorer", "trainer")


def summarize(run: Run) -> str:
    lines = [f"{run.name} ({run.path})"]
    steps = run.steps
    if steps:
        tokens = sum(r["tokens_generated"] for r in steps)
        lines.append(f"  {len(steps)} steps in {run.seconds:.1f} s of loop ({run.seconds / len(steps):.2f} s/step), "
                     f"{tokens / max(run.seconds, 1e-9):,.0f} generated tok/s, "
                     f"max staleness {max(r['max_staleness'] for r in steps)}")
        lines.append(f"  reward: first step {steps[0]['reward_mean']:.3f}, last step {steps[-1]['reward_mean']:.3f}, "
                     f"mean of the last fifth {_last_fifth(steps):.3f}")
    if steps and "turns_mean" in steps[0]:
        lines += _episodes(steps)
    scored = evaluations(run)
    if scored:
        lines += _held_out(scored)
    found = bubbles(run)
    if not found:
        lines.append("  no spans files: no bubble ratios (was the run made before spans were written?)")
        return "\n".join(lines)
    # Step 1 carries one-off warm-up (first generate call, the scorer's child process): shown apart.
    warm = bubbles(run, after=steps[0]["time"]) if len(steps) > 1 and "time" in steps[0] else {}
    lines.append("  bubble ratio = idle / (idle + busy), summed over ranks; whole loop"
                 + (", after step 1" if warm else "") + ", then each idle reason's share of the whole loop:")
    for role in sorted(found, key=lambda r: (ROLE_ORDER.index(r) if r in ROLE_ORDER else 99, r)):
        bubble = found[role]
        total = bubble.busy + sum(bubble.idle.values())
        reasons = ", ".join(f"{reason} {seconds / total:.2f}" for reason, seconds in
                            sorted(bubble.idle.items(), key=lambda item: -item[1]) if seconds > 0)
        after = f"  {warm[role].ratio:.2f}" if role in warm else ""
        lines.append(f"    {role:<10} {bubble.ratio:.2f}{after}" + (f"  ({reasons})" if reasons else ""))
    return "\n".join(lines)


def _episodes(steps: list[dict]) -> list[str]:
    """A job with an environment: turns and tool use, first and last step, and the episodes' counts over the run."""
    first, last = steps[0], steps[-1]
    tools = sorted({key.partition("/")[2] for r in steps for key in r if key.startswith("tool_calls/")})
    by_tool = ", ".join(f"{tool} {sum(r.get(f'tool_calls/{tool}', 0) for r in steps)} "
                        f"({sum(r.get(f'tool_errors/{tool}', 0) for r in steps)} failed)" for tool in tools)
    counts = ", ".join(f"{key.removeprefix('episodes_').replace('_', ' ')} {sum(r[key] for r in steps)}"
                       for key in ("episodes_across_versions", "episodes_drifted", "episodes_restarted",
                                   "episodes_truncated", "environment_errors"))
    return [f"  episodes: {first['turns_mean']:.2f} -> {last['turns_mean']:.2f} turns, a tool called in "
            f"{first['tool_episode_share']:.2f} -> {last['tool_episode_share']:.2f} of them, environment "
            f"{statistics.mean(r['environment_seconds_mean'] for r in steps) * 1000:.1f} ms an episode",
            f"  tool calls: {sum(r['tool_calls'] for r in steps)} ({sum(r['tool_errors'] for r in steps)} failed)"
            + (f": {by_tool}" if by_tool else ""),
            f"  episodes over the run: {counts}"]


def _held_out(scored: list[dict]) -> list[str]:
    """The first, last and best evaluation in the loop, and the last one's mean reward under each scorer."""
    key = held_out_key(scored)
    first, last = scored[0], scored[-1]
    best = max(scored, key=lambda r: r[key])
    counted = f" ({last['eval_correct']}/{last['eval_total']})" if key == "eval_accuracy" else ""
    lines = [f"  held-out {key.removeprefix('eval_').replace('_', ' ')} (greedy): {first[key]:.3f} at version "
             f"{first['eval_policy_version']}, {last[key]:.3f} at version {last['eval_policy_version']}{counted}, "
             f"best {best[key]:.3f} at version {best['eval_policy_version']}"]
    means = ", ".join(f"{name.removeprefix('eval_')} {value:.3f}" for name, value in last.items()
                      if name.startswith(("eval_scorer/", "eval_reward/")))
    if means:
        lines.append(f"  held-out reward at version {last['eval_policy_version']}: {last['eval_reward_mean']:.3f} "
                     f"({means})")
    return lines


def _last_fifth(steps: list[dict]) -> float:
    tail = steps[-max(1, len(steps) // 5):]
    return statistics.mean(r["reward_mean"] for r in tail)
