"""The OpenAI-compatible endpoint's bookkeeping without a model: sessions bounded (least recently used dropped,
counted), a stop string cuts the recorded completion after the token that completed it, calls without a session are
served and not recorded."""

from __future__ import annotations

from rlfleet.workers.engines.base import SegmentOut
from rlfleet.workers.environment.record import Call
from rlfleet.workers.generator.config import Generation
from rlfleet.workers.generator.openai_api import OpenAIEndpoint, Sessions
from rlfleet.workers.models.tiny import build_tokenizer


class OneSegment:
    """A generator service that samples `text` (one token a character) at policy version 3, whatever it is asked."""

    job_id = "t"

    def __init__(self, text: str, finished: bool = False):
        self.tokenizer = build_tokenizer()
        self.ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        self.finished = finished
        self.requests = []

    def problem(self, request):
        return None

    def generate(self, request):
        self.requests.append(request)
        return 3, [SegmentOut(self.ids, [-0.1 * (i + 1) for i in range(len(self.ids))], self.finished)]


def _endpoint(service: OneSegment, sessions: Sessions | None = None) -> OpenAIEndpoint:
    return OpenAIEndpoint(service, service.tokenizer, Generation(temperature=0.5, max_new_tokens=12), "t", sessions)


def _call(n: int) -> Call:
    return Call([n], [n], [0.0], 0)


def test_sessions_past_the_bound_drop_the_least_recently_used_and_count_it():
    dropped = []
    sessions = Sessions(limit=2, on_evict=lambda: dropped.append(1))
    sessions.record("a", _call(1))
    sessions.record("b", _call(2))
    sessions.record("a", _call(3))  # a is now the most recently used
    sessions.record("c", _call(4))
    assert (sessions.get("a"), sessions.get("b"), sessions.get("c")) == ([_call(1), _call(3)], None, [_call(4)])
    assert (sessions.evicted, len(dropped)) == (1, 1)
    assert sessions.delete("a") and not sessions.delete("a") and sessions.get("a") is None


def test_a_stop_string_ends_the_text_before_it_and_the_record_after_its_last_token():
    service = OneSegment("12 END 34")
    endpoint = _endpoint(service)
    reply = endpoint.chat({"model": "x", "messages": [{"role": "user", "content": "q"}], "stop": ["ND", "3"],
                           "logprobs": True}, "s")
    [choice] = reply["choices"]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("12 E", "stop")
    [call] = endpoint.sessions.get("s")
    assert service.tokenizer.decode(call.token_ids) == "12 END"
    assert call.logprobs == service.generate(None)[1][0].logprobs[:6]
    assert [entry["token"] for entry in choice["logprobs"]["content"]] == list("12 END")
    assert call.prompt_ids == service.tokenizer.apply_chat_template(
        [{"role": "user", "content": "q"}], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert (call.version, call.finish_reason) == (3, "stop")


def test_the_jobs_sampling_is_the_default_and_a_call_without_a_session_is_not_recorded():
    service = OneSegment("abc", finished=True)
    endpoint = _endpoint(service)
    reply = endpoint.completion({"model": "x", "prompt": "hi"}, None)
    assert (reply["choices"][0]["text"], reply["choices"][0]["finish_reason"]) == ("abc", "stop")
    [request] = service.requests
    assert (request.max_tokens, request.temperature, request.top_p) == (12, 0.5, 1.0)
    assert endpoint.sessions.get("s") is None and endpoint.sessions.evicted == 0
