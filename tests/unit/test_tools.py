"""Tool calls and the built-in tool environment: parsing the policy's calls, the calculator's answers and refusals,
and episodes of the environment, as messages and as the tokens the trainer gets."""

from __future__ import annotations

import json
from unittest.mock import ANY

import pytest

from rlfleet.workers.data.tasks import Example, chat
from rlfleet.workers.environment.calculator import MAX_INTEGER_BITS, CalculatorError, calculate
from rlfleet.workers.environment.config import TOOL_NAMES, Sandbox, ToolEnvironment
from rlfleet.workers.environment.episode import Conversation
from rlfleet.workers.environment.tools import MAX_CALLS_PER_TURN, Call, ToolUse, built_in_tools, parse_hermes


def hermes(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def example(prompt: str = "What is 123 * 456?") -> Example:
    return Example(id="1", prompt=prompt, answer="56088")


def test_several_calls_with_text_around_them_parse_in_order():
    reply = f"First {hermes('calculator', expression='1+1')} then\n{hermes('python', code='print(2)')} done"
    assert parse_hermes(reply) == [Call("calculator", {"expression": "1+1"}), Call("python", {"code": "print(2)"})]


def test_a_reply_without_calls_has_none():
    assert parse_hermes("The answer is 42. No <tool_call here.") == []


def test_a_last_call_without_its_closing_tag_still_parses():
    reply = 'ok <tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n'
    assert parse_hermes(reply) == [Call("calculator", {"expression": "2*3"})]


@pytest.mark.parametrize("body, name, error", [
    ('{"name": "calculator", "arguments": {"expression": "1+1"', None, "not JSON"),
    ("", None, "not JSON"),
    ('["calculator"]', None, "a call is"),
    ('{"arguments": {"expression": "1"}}', None, "a call is"),
    ('{"name": "calculator", "arguments": "1+1"}', "calculator", "arguments must be a JSON object"),
])
def test_a_malformed_call_says_why(body, name, error):
    (call,) = parse_hermes(f"<tool_call>{body}</tool_call>")
    assert call.name == name and error in call.error


def test_the_calculator_is_exact():
    assert calculate("123456789 * 987654321") == str(123456789 * 987654321)
    assert calculate("-(3 + 4) * 2 ** 3 - 7 // 2 + 7 % 3") == str(-(3 + 4) * 2 ** 3 - 7 // 2 + 7 % 3)
    assert calculate("1.5 * 4 / 3") == "2.0"
    assert calculate("sqrt(144)") == "12.0"


@pytest.mark.parametrize("expression, why", [
    ("x + 1", "not allowed"),
    ("__import__('os').system('true')", "not allowed"),
    ("(1).real", "not allowed"),
    ("abs(-1)", "not allowed"),
    ("sqrt(4, 2)", "not allowed"),
    ("True + 1", "not allowed"),
    ("'a' * 3", "not allowed"),
    ("[1] * 3", "not allowed"),
    ("2 ^ 10", r"write \*\*"),
    ("9 ** 9 ** 9", "too large"),
    ("10 ** 10 ** 100", "too large"),
    ("(2 ** 4000) * (2 ** 4000)", "too large"),
    ("2.0 ** 100000", "too large"),
    ("1e400", "too large"),
    ("1 / 0", "division by zero"),
    ("5 // 0", "by zero"),
    ("5 % 0", "by zero"),
    ("2 ** -(2 ** 4000)", "too large"),
    ("(-8) ** 0.5", "not a real number"),
    ("sqrt(-1)", "math domain error"),
    ("1 +", "not an arithmetic expression"),
    ("(" * 300 + "1" + ")" * 300, "not an arithmetic expression"),
    ("1" * 1001, "longer than"),
])
def test_the_calculator_refuses(expression, why):
    with pytest.raises(CalculatorError, match=why):
        calculate(expression)


def test_the_calculator_goes_up_to_its_bound():
    assert calculate(f"2 ** {MAX_INTEGER_BITS - 1}") == str(2 ** (MAX_INTEGER_BITS - 1))


def test_the_built_in_tools_are_the_configs():
    tools = built_in_tools(Sandbox())
    assert tuple(tools) == TOOL_NAMES
    # The python tool's schema, without running it (the sandbox is its own module).
    function = tools["python"].schema()["function"]
    assert function["name"] == "python" and function["parameters"] == {
        "type": "object", "properties": {"code": {"type": "string", "description": ANY}}, "required": ["code"]}


def test_reset_opens_with_the_tools_and_the_call_format():
    environment = ToolUse(ToolEnvironment(tools=["calculator"]))
    system, user = environment.reset(example())
    assert user == {"role": "user", "content": "What is 123 * 456?"}
    assert system["role"] == "system" and json.dumps(environment.tools[0]) in system["content"]
    assert "<tool_call>" in system["content"] and '"python"' not in system["content"]
    assert [tool["function"]["name"] for tool in environment.tools] == ["calculator"]


def test_reset_keeps_the_examples_own_system_message_first():
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 * 3?"}]
    system, user = ToolUse(ToolEnvironment()).reset(Example(id="1", prompt="2 * 3?", answer="6", messages=chat))
    assert system["content"].startswith("Be brief.\n\nYou can call tools.") and user == chat[1]


def test_an_episode_runs_the_calls_and_ends_on_the_first_reply_without_one():
    environment = ToolUse(ToolEnvironment(tools=["calculator"]))
    environment.reset(example())
    step = environment.step("Let me compute. " + hermes("calculator", expression="123 * 456")
                            + hermes("calculator", expression="1 / 0"))
    assert step.messages == [{"role": "tool", "content": "56088"},
                             {"role": "tool", "content": "error: division by zero"}]
    assert not step.done and step.tool_calls == {"calculator": 2} and step.tool_errors == {"calculator": 1}
    last = environment.step("123 * 456 = 56088")
    assert last.done and last.messages == [] and last.reward == 0.0 and last.tool_calls == {}


def test_calls_that_cannot_run_are_answered_and_counted():
    environment = ToolUse(ToolEnvironment(tools=["calculator"]))
    step = environment.step(hermes("calculator", expression=12) + hermes("calculator")
                            + hermes("calculator", expression="1", precision=3) + hermes("python", code="1")
                            + hermes("search", query="x") + "<tool_call>{oops}</tool_call>")
    contents = [message["content"] for message in step.messages]
    assert contents[0] == "error: argument expression must be a string, not 12 (calling calculator)"
    assert contents[1] == "error: missing argument expression (calling calculator)"
    assert contents[2].startswith("error: unknown argument precision")
    assert contents[3] == "error: unknown tool 'python'; the tools are: calculator"
    assert contents[4] == "error: unknown tool 'search'; the tools are: calculator"
    assert contents[5].startswith("error: the call is not JSON")
    assert step.tool_calls == step.tool_errors == {"calculator": 3, "unknown": 2, "malformed": 1}
    assert not step.done


def test_calls_past_the_turns_limit_are_not_run():
    environment = ToolUse(ToolEnvironment(tools=["calculator"]))
    step = environment.step(hermes("calculator", expression="2 * 2") * (MAX_CALLS_PER_TURN + 1))
    assert [message["content"] for message in step.messages[-2:]] == [
        "4", f"error: not run: at most {MAX_CALLS_PER_TURN} calls a turn"]
    assert step.tool_calls == {"calculator": MAX_CALLS_PER_TURN + 1} and step.tool_errors == {"calculator": 1}


def test_an_episode_renders_with_the_tiny_tokenizer_and_keeps_the_policys_tokens():
    from rlfleet.workers.models.tiny import build_tokenizer

    tokenizer = build_tokenizer(tool_calls=True)  # a tool-calling tiny model's: tags, braces and quotes
    environment = ToolUse(ToolEnvironment(tools=["calculator"]))
    conversation = Conversation(tokenizer, environment.reset(example()), environment.tools)
    prompt = list(conversation.ids)
    assert tokenizer.decode(prompt).startswith("system: You can call tools.")

    # The policy ends its turn with its end-of-text token, as its template ends an assistant turn.
    sampled = tokenizer(hermes("calculator", expression="123*456"), add_special_tokens=False)["input_ids"] + \
        [tokenizer.eos_token_id]
    step = environment.step(conversation.reply(sampled))
    appended = conversation.observe(step.messages)

    assert appended.restart_ids == [] and tokenizer.decode(appended.token_ids) == "\ntool: 56088\nassistant: "
    assert conversation.ids == prompt + sampled + appended.token_ids


@pytest.mark.parametrize("name", ["calculator", pytest.param("python", marks=pytest.mark.integration)])
def test_a_demonstration_shows_a_call_of_the_first_tool_that_parses_and_its_true_result(name):
    environment = ToolUse(ToolEnvironment(tools=[name], demonstration=True))
    system, question, call, result, answer, asked = environment.reset(example())
    assert (system["role"], question["role"], call["role"], result["role"], answer["role"]) == (
        "system", "user", "assistant", "tool", "assistant")
    [parsed] = parse_hermes(call["content"])
    assert parsed.name == name and environment.run(parsed) == (result["content"], False)
    assert asked == chat(example())[-1]


def test_a_call_reward_comes_once_an_episode_for_a_call_that_runs():
    environment = ToolUse(ToolEnvironment(tools=["calculator"], call_reward=0.25))
    environment.reset(example())
    assert environment.step(hermes("calculator", expression="2 +")).reward == 0.0  # a call that failed
    assert environment.step(hermes("calculator", expression="2 + 2")).reward == 0.25
    assert environment.step(hermes("calculator", expression="3 + 3")).reward == 0.0  # once an episode
