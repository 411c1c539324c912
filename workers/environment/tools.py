"""Tools the policy calls in its turns, and the built-in tool environment (`type: tools`).

The policy writes its calls in a chat-template format (CALL_FORMATS: Hermes's `<tool_call>{json}</tool_call>`);
each call runs and its result is the next turn, one `tool` message per call, in order. A call that cannot run
(not JSON, an unknown tool, missing or ill-typed arguments) answers with an error the policy reads, and is counted
by tool name: "unknown" for a name that is no tool (the policy's made-up names would be unbounded metric labels),
"malformed" when no name parses. The first turn without a call is the final answer, which the job's scorers grade.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

from rlfleet.workers.data.tasks import chat
from rlfleet.workers.environment.calculator import CalculatorError, calculate
from rlfleet.workers.environment.config import Sandbox, ToolEnvironment
from rlfleet.workers.environment.protocol import Environment, Message, Step

MAX_CALLS_PER_TURN = 8
"""Calls past this many in one turn answer with an error instead of running: each python call may take the
sandbox's whole timeout, and the step must end before the environment's step timeout."""
JSON_TYPES = {"string": str, "number": (int, float), "integer": int, "boolean": bool, "object": dict,
              "array": list}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    """JSON schema of the arguments object, as chat templates take it under `tools=`."""
    run: Callable[[dict[str, Any]], tuple[str, bool]]
    """Runs one call whose arguments fit `parameters`: the text the policy reads, and whether it is an error."""
    example: tuple[str, dict[str, Any], str] = ("", {}, "")
    """A worked example of a call (a question, the call's arguments, the answer given its result): what
    `demonstration` shows."""

    def schema(self) -> dict[str, Any]:
        """The tool as chat templates take it (`apply_chat_template(tools=[...])`)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


def run_calculator(arguments: dict[str, Any]) -> tuple[str, bool]:
    try:
        return calculate(arguments["expression"]), False
    except CalculatorError as error:
        return str(error), True


def run_python(arguments: dict[str, Any], limits: Sandbox) -> tuple[str, bool]:
    # Imported on the first call: the sandbox is needed only by jobs that use the python tool.
    from rlfleet.workers.environment.sandbox import run_code

    return run_code(arguments, limits)


def built_in_tools(sandbox: Sandbox) -> dict[str, Tool]:
    """Every built-in tool by name (config.TOOL_NAMES), the python tool's runs bounded by `sandbox`."""
    return {
        "calculator": Tool(
            "calculator", "Evaluates an arithmetic expression exactly: numbers, + - * / // % ** (power), "
            "parentheses and sqrt().",
            {"type": "object", "properties": {"expression": {"type": "string", "description": "e.g. 1234 * 5678"}},
             "required": ["expression"]},
            run_calculator, ("What is 12 * 34?", {"expression": "12 * 34"}, "12 * 34 = 408")),
        "python": Tool(
            "python", "Runs a Python program in a sandbox (no network, no files of yours, a few seconds) and "
            "returns what it prints.",
            {"type": "object", "properties": {"code": {"type": "string", "description": "The program; print the "
                                                                                        "results you need."}},
             "required": ["code"]},
            partial(run_python, limits=sandbox),
            ("How many days are in 12 weeks?", {"code": "print(12 * 7)"}, "12 weeks have 84 days.")),
    }


def argument_error(parameters: dict[str, Any], arguments: dict[str, Any]) -> str:
    """Why `arguments` do not fit the schema `parameters` (required names, no others, their types); empty if
    they do."""
    properties = parameters.get("properties", {})
    missing = [name for name in parameters.get("required", []) if name not in arguments]
    if missing:
        return f"missing argument {', '.join(missing)}"
    unknown = [name for name in arguments if name not in properties]
    if unknown:
        return f"unknown argument {', '.join(unknown)}; the arguments are: {', '.join(properties)}"
    for name, value in arguments.items():
        expected = properties[name]["type"]
        # bool is an int in Python, not in JSON.
        if not isinstance(value, JSON_TYPES[expected]) or (isinstance(value, bool) and expected != "boolean"):
            return f"argument {name} must be a {expected}, not {json.dumps(value)[:80]}"
    return ""


@dataclass(frozen=True)
class Call:
    """One tool call as the policy wrote it."""

    name: str | None
    """The tool's name as written; None when none parses."""
    arguments: dict[str, Any]
    error: str = ""
    """Why the call does not parse; empty when it does."""


# vLLM's hermes parser's rule: the last call may lack its closing tag (a stop string or the token limit ate it).
HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
HERMES_SHAPE = '{"name": <tool name>, "arguments": <arguments as a JSON object>}'


def parse_hermes(reply: str) -> list[Call]:
    """The calls in a turn, Hermes/Qwen style: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any
    number, text around them allowed."""
    return [hermes_call(closed or unclosed) for closed, unclosed in HERMES_CALL.findall(reply)]


def hermes_call(body: str) -> Call:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as error:
        return Call(None, {}, f"the call is not JSON ({error}); write {HERMES_SHAPE}")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return Call(None, {}, f"a call is {HERMES_SHAPE}")
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        return Call(call["name"], {}, "arguments must be a JSON object")
    return Call(call["name"], arguments)


def hermes_instructions(schemas: list[dict[str, Any]]) -> str:
    # Short: every episode carries it (a template that renders `tools`, such as Qwen's, adds its own wording too).
    tools = "\n".join(json.dumps(schema) for schema in schemas)
    return (f"You can call tools. To call one, write <tool_call>{HERMES_SHAPE}</tool_call>; you may make several "
            "calls. Their results come back in the next turn. When you know the answer, reply with it and no tool "
            f"call.\nThe tools, as JSON schemas:\n{tools}")


def hermes_call_text(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@dataclass(frozen=True)
class CallFormat:
    parse: Callable[[str], list[Call]]
    instructions: Callable[[list[dict[str, Any]]], str]
    """The system prompt's text: the tools (their schemas) and how to call them."""
    write: Callable[[str, dict[str, Any]], str]
    """A call as the policy writes it (a demonstration's)."""


CALL_FORMATS = {"hermes": CallFormat(parse_hermes, hermes_instructions, hermes_call_text)}


class ToolUse(Environment):
    """The built-in tool environment: the example's chat under a system prompt that describes the tools; each
    turn's calls run and their results are the next turn; the first turn without a call ends the episode."""

    def __init__(self, spec: ToolEnvironment, call_format: str = "hermes"):
        every = built_in_tools(spec.sandbox)
        self.by_name = {name: every[name] for name in spec.tools}
        self.demonstration = spec.demonstration
        self.call_reward = spec.call_reward
        self.rewarded = False
        self.tools = [tool.schema() for tool in self.by_name.values()]
        self.format = CALL_FORMATS[call_format]

    def reset(self, example: Any) -> list[Message]:
        """The system prompt (kept in text: templates such as SmolLM2's render no `tools`), then the example's
        chat; a system message of the example's own gets the tools after its text."""
        opening = chat(example)
        system = self.format.instructions(self.tools)
        if opening[0]["role"] == "system":
            system, opening = f"{opening[0]['content']}\n\n{system}", opening[1:]
        return [{"role": "system", "content": system}, *(self.shown() if self.demonstration else []), *opening]

    def shown(self) -> list[Message]:
        """The first tool's worked example, as a finished exchange before the example's chat."""
        tool = next(iter(self.by_name.values()))
        question, arguments, answer = tool.example
        result, _ = tool.run(arguments)
        return [{"role": "user", "content": question},
                {"role": "assistant", "content": self.format.write(tool.name, arguments)},
                {"role": "tool", "content": result}, {"role": "assistant", "content": answer}]

    def step(self, reply: str) -> Step:
        calls = self.format.parse(reply)
        if not calls:
            return Step(done=True)
        messages, counted, failed = [], Counter(), Counter()
        for index, call in enumerate(calls):
            if index < MAX_CALLS_PER_TURN:
                text, error = self.run(call)
            else:
                text, error = f"not run: at most {MAX_CALLS_PER_TURN} calls a turn", True
            name = self.counted_name(call)
            counted[name] += 1
            failed[name] += error
            messages.append({"role": "tool", "content": f"error: {text}" if error else text})
        reward = 0.0
        if self.call_reward and not self.rewarded and sum(counted.values()) > sum(failed.values()):
            reward, self.rewarded = self.call_reward, True
        return Step(messages=messages, reward=reward, tool_calls=dict(counted), tool_errors=dict(+failed))

    def run(self, call: Call) -> tuple[str, bool]:
        """One call's result, or why it cannot run."""
        if call.error:
            return call.error, True
        tool = self.by_name.get(call.name)
        if tool is None:
            return f"unknown tool {call.name!r}; the tools are: {', '.join(self.by_name)}", True
        error = argument_error(tool.parameters, call.arguments)
        if error:
            return f"{error} (calling {tool.name})", True
        return tool.run(call.arguments)

    def counted_name(self, call: Call) -> str:
        """What the call is counted under in tool_calls and tool_errors."""
        if call.name is None:
            return "malformed"
        return call.name if call.name in self.by_name else "unknown"
