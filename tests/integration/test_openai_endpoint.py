"""A real generator worker (torch engine) serves its OpenAI-compatible endpoint on loopback: an agent written against
the `openai` client runs an episode (two chat turns, a tool's answer between them), and the tokens and log-probs the
endpoint recorded are those a Generate call gives for the same prompt; no token is 401, a bad request 400."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import openai
import pytest
from transformers import AutoTokenizer

from rlfleet.v1 import generator_pb2, generator_pb2_grpc
from rlfleet.workers import wire
from rlfleet.workers.controller.rollouts import OBSERVATION, SAMPLED
from rlfleet.workers.environment.agent import run_agent_episode
from rlfleet.workers.environment.config import AgentEnvironment
from rlfleet.workers.environment.episode import render_chat
from rlfleet.workers.models import materialize

from conftest import make_job
from support import log_text, one_worker

pytestmark = pytest.mark.integration
MAX_TOKENS = 8
AGENT = '''
def run(client, example):
    """Asks, gets a tool's answer, asks again: the chat each time, as agents do."""
    messages = [{"role": "user", "content": example["question"]}]
    for tool_answer in ("42", None):
        reply = client.chat.completions.create(model="policy", messages=messages, seed=11, max_tokens=%d,
                                               logprobs=True)
        example["sent"].append(list(messages))
        example["replies"].append(reply)
        messages = messages + [{"role": "assistant", "content": reply.choices[0].message.content}]
        if tool_answer:
            messages.append({"role": "tool", "content": tool_answer})
    return 0.5
''' % MAX_TOKENS


@pytest.fixture(scope="module")
def generator(tmp_path_factory, model_cache):
    """(gRPC address, base URL, token, tokenizer, child) of one generator process for the module's tests."""
    job = make_job(roles={"generator": {"engine": "torch"}})
    with one_worker(job, tmp_path_factory.mktemp("openai-run"), "generator") as (child, endpoints, token):
        base_url = f"http://{endpoints.http_of('generator')[0]}/v1"
        _wait_http(base_url, token, child)
        tokenizer = AutoTokenizer.from_pretrained(materialize(job.spec.model, model_cache))
        yield endpoints.of("generator")[0], base_url, token, tokenizer, child


def _wait_http(base_url: str, token: str, child, seconds: float = 60.0) -> None:
    """The endpoint starts right after the gRPC server, whose health start_workers waited for."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            _call(base_url + "/models", token)
            return
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline:
                raise AssertionError(f"no HTTP endpoint at {base_url}:\n{log_text(child)}")
            time.sleep(0.2)


def _call(url: str, token: str | None, body: dict | bytes | None = None, method: str | None = None):
    """(status, JSON reply) of one request."""
    data = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def _generate(address: str, token: str, prompt_ids: list[int], temperature: float = 0.0, seed: int = 1):
    request = generator_pb2.GenerateRequest(
        job_id="t", max_tokens=MAX_TOKENS, temperature=temperature, top_p=1.0, seed=seed,
        sequences=[generator_pb2.Sequence(sample_id="s", prompt_ids=prompt_ids)])
    with wire.channel(address, token) as chan:
        reply = generator_pb2_grpc.GeneratorStub(chan).Generate(request, timeout=120)
    [segment] = reply.segments
    return list(segment.token_ids), list(segment.logprobs), reply.policy_version


def test_an_openai_agent_episode_records_what_generate_samples(generator, tmp_path):
    address, base_url, token, tokenizer, _ = generator
    agent_file = tmp_path / "agent.py"
    agent_file.write_text(AGENT)
    example = {"question": "what is 6*7?", "sent": [], "replies": []}
    samples, reward = run_agent_episode(AgentEnvironment(path=str(agent_file)), example, base_url, token, "ep-1")
    assert reward == 0.5
    first_prompt, second_prompt = (render_chat(tokenizer, sent) for sent in example["sent"])
    first_ids, first_logprobs, version = _generate(address, token, first_prompt, temperature=1.0, seed=11)
    # The tiny model's template writes a reply as sampled (no end token within MAX_TOKENS): one sample, the tool's
    # turn unsampled between the policy's two.
    assert second_prompt[:len(first_prompt) + len(first_ids)] == first_prompt + first_ids
    second_ids, second_logprobs, _ = _generate(address, token, second_prompt, temperature=1.0, seed=11)
    [sample] = samples
    assert sample.prompt_ids == first_prompt
    assert [turn.kind for turn in sample.turns] == [SAMPLED, OBSERVATION, SAMPLED]
    policy, tool, again = sample.turns
    assert list(policy.token_ids) == first_ids and list(again.token_ids) == second_ids
    assert list(policy.logprobs) == pytest.approx(first_logprobs, abs=1e-5)
    assert list(again.logprobs) == pytest.approx(second_logprobs, abs=1e-5)
    assert list(tool.token_ids) == second_prompt[len(first_prompt) + len(first_ids):]
    assert tool.logprobs == () and set(policy.versions + tool.versions + again.versions) == {version}
    # What the agent was served is what was recorded.
    served = [[entry.logprob for entry in reply.choices[0].logprobs.content] for reply in example["replies"]]
    assert served == [list(policy.logprobs), list(again.logprobs)]
    assert example["replies"][0].choices[0].message.content == tokenizer.decode(first_ids, skip_special_tokens=True)
    # The episode's record was freed.
    assert _call(f"{base_url}/sessions/ep-1", token)[0] == 404


def test_a_seeded_sampled_completion_is_what_generate_samples_and_its_session_keeps_it(generator):
    address, base_url, token, tokenizer, _ = generator
    prompt = tokenizer("12+30=", add_special_tokens=False)["input_ids"]
    client = openai.OpenAI(base_url=base_url, api_key=token, default_headers={"X-Session-Id": "seeded"},
                           max_retries=0)
    reply = client.completions.create(model="policy", prompt=prompt, temperature=1.0, seed=7, max_tokens=MAX_TOKENS,
                                      logprobs=0)
    ids, logprobs, _ = _generate(address, token, prompt, temperature=1.0, seed=7)
    assert reply.choices[0].logprobs.token_logprobs == pytest.approx(logprobs, abs=1e-5)
    status, record = _call(f"{base_url}/sessions/seeded", token)
    assert status == 200
    [call] = record["calls"]
    assert (call["prompt_ids"], call["token_ids"], call["version"]) == (prompt, ids, 0)
    assert _call(f"{base_url}/sessions/seeded", token, method="DELETE") == (
        200, {"id": "seeded", "object": "session", "deleted": True})
    assert _call(f"{base_url}/sessions/seeded", token)[0] == 404


def test_a_sessions_call_samples_at_the_jobs_temperature_and_top_p(generator):
    """A session's calls train, and the trainer recomputes log pi at the job's sampling: another is refused."""
    _, base_url, token, _, _ = generator
    for field, value in (("temperature", 0.5), ("top_p", 0.9)):
        body = {"model": "policy", "messages": [{"role": "user", "content": "a"}], field: value}
        request = urllib.request.Request(base_url + "/chat/completions", data=json.dumps(body).encode(), headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {token}", "X-Session-Id": "s"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=60)
        assert refused.value.code == 400 and json.load(refused.value)["error"]["param"] == field
        assert _call(base_url + "/chat/completions", token, body)[0] == 200  # outside a session: served


def test_no_token_or_a_wrong_one_is_401(generator):
    _, base_url, token, _, _ = generator
    chat = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for given in (None, token[:-1], token + "x"):
        for url, body in ((base_url + "/models", None), (base_url + "/chat/completions", chat),
                          (base_url + "/sessions/ep-1", None)):
            status, reply = _call(url, given, body)
            assert (status, reply["error"]["code"]) == (401, "invalid_api_key"), (url, given)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base_url, api_key="not-the-token", max_retries=0).models.list()


@pytest.mark.parametrize("path, body, param", [
    ("/chat/completions", {"model": "policy"}, "messages"),
    ("/chat/completions", {"model": "policy", "messages": [{"content": "no role"}]}, "messages[0]"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "a"}]}, "model"),
    ("/chat/completions", {"model": "policy", "messages": [{"role": "user", "content": "a"}], "n": 2}, "n"),
    ("/chat/completions", {"model": "policy", "messages": [{"role": "user", "content": "a"}], "stream": True},
     "stream"),
    ("/chat/completions", {"model": "policy", "messages": [{"role": "user", "content": "a"}], "temperature": 0.001},
     "temperature"),
    ("/chat/completions", {"model": "policy", "messages": [{"role": "user", "content": "a"}], "top_p": 0},
     "top_p"),
    ("/chat/completions", {"model": "policy", "messages": [{"role": "user", "content": "a"}], "max_tokens": 0},
     "max_tokens"),
    ("/chat/completions", {"model": "policy", "messages": [{"role": "user", "content": "a"}],
                           "max_tokens": "8"}, "max_tokens"),
    ("/chat/completions", {"model": "policy", "messages": [{"role": "user", "content": "a"}], "stop": [""]},
     "stop"),
    ("/completions", {"model": "policy", "prompt": ["two", "prompts"]}, "prompt"),
    ("/completions", {"model": "policy", "prompt": [1, 10 ** 6]}, "prompt"),
    ("/completions", {"model": "policy", "prompt": "abc", "logprobs": 3}, "logprobs"),
    ("/completions", b"{not json", "body"),
], ids=["no-messages", "message-without-role", "no-model", "n-2", "stream", "temperature-below-vllm-floor",
        "top-p-0", "max-tokens-0", "max-tokens-string", "empty-stop", "prompt-batch", "token-past-vocab",
        "top-logprobs", "not-json"])
def test_a_bad_request_is_400_naming_the_field_and_the_endpoint_keeps_serving(generator, path, body, param):
    _, base_url, token, _, child = generator
    status, reply = _call(base_url + path, token, body)
    assert (status, reply["error"]["param"], reply["error"]["type"]) == (400, param, "invalid_request_error"), reply
    assert child.process.poll() is None, log_text(child)
    assert _call(base_url + "/models", token)[0] == 200
