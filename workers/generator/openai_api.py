"""The generators' OpenAI-compatible endpoint: an agent program written against the `openai` client runs on the
policy unchanged, and every token it is served is recorded for training.

`POST /v1/chat/completions` (messages rendered with the model's chat template, `tools` passed to it),
`POST /v1/completions` (a prompt as text or token ids), `GET /v1/models`; n = 1, no streaming. Calls run through
GeneratorService.generate, at the same safe point as Generate: weights never load during one.

Sessions: a call carrying the header `X-Session-Id` is recorded under that id (record.Call: the prompt ids as
rendered, the sampled ids, their log mu and the policy version); `GET /v1/sessions/{id}` returns the calls,
`DELETE` frees them. The header, not OpenAI's `user` field (an end user's id, which agents may already set): an
agent sets it once, `OpenAI(default_headers=...)`. One episode talks to one generator (the caller picks the replica
and keeps it: its record lives there, and vLLM's prefix cache reuses the chat so far). The latest MAX_SESSIONS
sessions are kept; past that the least recently used is dropped, counted.

Every request needs the job's token as `Authorization: Bearer <token>` (401 otherwise); a bad one gets 400 with an
OpenAI-style error naming the field.
"""

from __future__ import annotations

import collections
import hmac
import json
import logging
import math
import re
import secrets
import threading
import time
import urllib.parse
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rlfleet.v1 import generator_pb2
from rlfleet.workers.environment.episode import render_chat
from rlfleet.workers.environment.record import Call
from rlfleet.workers.generator.config import Generation
from rlfleet.workers.generator.server import GeneratorService

log = logging.getLogger(__name__)
SESSION_HEADER = "X-Session-Id"
# Abandoned sessions (an episode that died before fetching its record) must not grow the generator without bound.
MAX_SESSIONS = 1024
MAX_SESSION_ID_CHARS = 256
# A chat of a whole context window is a few MB of JSON at most.
MAX_BODY_BYTES = 32 << 20
# OpenAI's bound on stop strings.
MAX_STOP_STRINGS = 4
# A client that stops sending mid-request frees its thread after this long.
SOCKET_TIMEOUT_SECONDS = 120
SESSION_PATH = re.compile(r"^/v1/sessions/([^/]+)$")


class BadRequest(Exception):
    """A request the endpoint refuses (400), naming the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class Sessions:
    """The recorded calls of the latest sessions, by id; past `limit` the least recently used is dropped."""

    def __init__(self, limit: int = MAX_SESSIONS, on_evict: Any = None):
        self.limit = limit
        self.on_evict = on_evict
        """Called once per session dropped for room (a metric's inc)."""
        self.evicted = 0
        self._calls: collections.OrderedDict[str, list[Call]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def record(self, session_id: str, call: Call) -> None:
        with self._lock:
            self._calls.setdefault(session_id, []).append(call)
            self._calls.move_to_end(session_id)
            while len(self._calls) > self.limit:
                self._calls.popitem(last=False)
                self.evicted += 1
                if self.on_evict:
                    self.on_evict()

    def get(self, session_id: str) -> list[Call] | None:
        with self._lock:
            calls = self._calls.get(session_id)
            return None if calls is None else list(calls)

    def delete(self, session_id: str) -> bool:
        with self._lock:
            return self._calls.pop(session_id, None) is not None


class OpenAIEndpoint:
    """OpenAI requests (parsed JSON) in, OpenAI responses out, through the generator's engine."""

    def __init__(self, service: GeneratorService, tokenizer: Any, generation: Generation, model: str,
                 sessions: Sessions | None = None):
        self.service = service
        self.tokenizer = tokenizer
        self.generation = generation
        """The job's sampling: what a request that names no max_tokens, temperature or top_p gets (the trainer
        applies the job's temperature and top-p: an agent sampling at others trains on another distribution's mu)."""
        self.model = model
        self.sessions = sessions or Sessions()

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                            "owned_by": "rlfleet"}]}

    def chat(self, body: dict[str, Any], session_id: str | None) -> dict[str, Any]:
        _refuse_unsupported(body, "top_logprobs")
        prompt_ids = self._render(_messages(body), _optional(body, "tools", list))
        call, text = self._complete(prompt_ids, body, session_id)
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": call.finish_reason, "logprobs": None}
        if _optional(body, "logprobs", bool):
            choice["logprobs"] = {"content": [
                {"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []}
                for token, logprob in zip(self._pieces(call.token_ids), call.logprobs)]}
        return self._response("chatcmpl", "chat.completion", choice, call)

    def completion(self, body: dict[str, Any], session_id: str | None) -> dict[str, Any]:
        logprobs = _optional(body, "logprobs", int)
        if logprobs not in (None, 0):
            raise BadRequest("logprobs", "only 0 (the sampled tokens' log-probs, no alternatives) is served")
        _refuse_unsupported(body, "echo", "suffix", "best_of")
        call, text = self._complete(self._prompt(body), body, session_id)
        choice = {"index": 0, "text": text, "finish_reason": call.finish_reason, "logprobs": None}
        if logprobs is not None:
            pieces = self._pieces(call.token_ids)
            offsets = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
            choice["logprobs"] = {"tokens": pieces, "token_logprobs": call.logprobs, "top_logprobs": None,
                                  "text_offset": offsets}
        return self._response("cmpl", "text_completion", choice, call)

    def _complete(self, prompt_ids: list[int], body: dict[str, Any], session_id: str | None) -> tuple[Call, str]:
        """Sample one completion of `prompt_ids` as the request asks; record it under the session."""
        request = self._generate_request(prompt_ids, body)
        if session_id is not None:
            self._trains_as_sampled(request)
        version, [segment] = self.service.generate(request)
        token_ids, text, stopped = self._cut_at_stop(segment.token_ids, _stop_strings(body))
        call = Call(prompt_ids, token_ids, list(segment.logprobs[:len(token_ids)]), version,
                    temperature=request.temperature, top_p=request.top_p,
                    finish_reason="stop" if stopped or segment.finished else "length")
        if session_id is not None:
            self.sessions.record(session_id, call)
        return call, text

    def _trains_as_sampled(self, request: generator_pb2.GenerateRequest) -> None:
        """A session's calls train: the trainer recomputes log pi at the job's temperature and top-p, so a call that
        samples at others would pair its mu with another distribution's pi."""
        job = generator_pb2.GenerateRequest(temperature=self.generation.temperature, top_p=self.generation.top_p)
        for field in ("temperature", "top_p"):
            if getattr(request, field) != getattr(job, field):  # both float32, as the wire holds them
                raise BadRequest(field, f"{field} {getattr(request, field):.4g}: a session's calls train, at the "
                                        f"job's {getattr(job, field):.4g} (spec.generation): leave it out")

    def _generate_request(self, prompt_ids: list[int], body: dict[str, Any]) -> generator_pb2.GenerateRequest:
        """The Generate request of this call, checked by the Generator service's own rules."""
        _refuse_unsupported(body, "stream")
        if _optional(body, "n", int) not in (None, 1):
            raise BadRequest("n", "only n = 1 is served: send one request per completion")
        _optional(body, "model", str, required=True)
        max_tokens = _optional(body, "max_completion_tokens", int)
        max_tokens = _optional(body, "max_tokens", int) if max_tokens is None else max_tokens
        temperature = _number(body, "temperature")
        top_p = _number(body, "top_p")
        seed = _optional(body, "seed", int)
        request = generator_pb2.GenerateRequest(
            job_id=self.service.job_id,
            max_tokens=self.generation.max_new_tokens if max_tokens is None else _int32(max_tokens, "max_tokens"),
            temperature=self.generation.temperature if temperature is None else temperature,
            top_p=self.generation.top_p if top_p is None else top_p,
            # Unseeded calls differ: the episodes of one prompt's group must not all sample alike.
            seed=secrets.randbits(63) if seed is None else _uint64(seed),
            sequences=[generator_pb2.Sequence(sample_id="openai", prompt_ids=prompt_ids)])
        problem = self.service.problem(request)
        if problem:
            field = problem.partition(":")[0]
            if field.startswith("sequences"):  # the one sequence is this request's prompt
                field = "messages" if "messages" in body else "prompt"
            raise BadRequest(field, problem)
        return request

    def _render(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> list[int]:
        try:
            return render_chat(self.tokenizer, messages, tools)
        except Exception as error:  # a template raises what it likes (jinja errors, ValueError, KeyError)
            raise BadRequest("messages", f"the model's chat template cannot render them: {str(error)[:200]}")

    def _prompt(self, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, str) and prompt:
            # As `template: plain` renders a prompt: the text's tokens, no special tokens added.
            return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return prompt
        raise BadRequest("prompt", "need one non-empty string or one list of token ids (one prompt per request)")

    def _cut_at_stop(self, token_ids: list[int], stops: list[str]) -> tuple[list[int], str, bool]:
        """The tokens up to the one that completes the first stop string, the text before that string, and whether
        one was found. Tokens sampled after it are dropped: the agent never sees them, so they are not trained."""
        text = self._text(token_ids)
        found = [(text.find(stop), stop) for stop in stops if stop in text]
        if not found:
            return list(token_ids), text, False
        start, stop = min(found)
        for count in range(1, len(token_ids) + 1):
            if len(self._text(token_ids[:count])) >= start + len(stop):
                return list(token_ids[:count]), text[:start], True
        return list(token_ids), text[:start], True

    def _text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _pieces(self, token_ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([token]) for token in token_ids]

    def _response(self, prefix: str, kind: str, choice: dict[str, Any], call: Call) -> dict[str, Any]:
        usage = {"prompt_tokens": len(call.prompt_ids), "completion_tokens": len(call.token_ids),
                 "total_tokens": len(call.prompt_ids) + len(call.token_ids)}
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
                "model": self.model, "choices": [choice], "usage": usage,
                "system_fingerprint": f"policy-v{call.version}"}


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages", "need a non-empty list of {role, content} objects")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{index}]", "need an object with a string role")
    return messages


def _stop_strings(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS or not all(
            isinstance(s, str) and s for s in stops):
        raise BadRequest("stop", f"need a non-empty string or a list of at most {MAX_STOP_STRINGS} of them")
    return stops


def _optional(body: dict[str, Any], name: str, kind: Any, required: bool = False) -> Any:
    """body[name] if it has the JSON type `kind`, None if absent or null (unless required); else BadRequest."""
    value = body.get(name)
    if value is None and not required:
        return None
    # JSON true is no number here, though Python's bool is an int.
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise BadRequest(name, f"need {_kind_name(kind)}, got {json.dumps(value)[:40]}")
    return value


def _number(body: dict[str, Any], name: str) -> float | None:
    value = _optional(body, name, (int, float))
    if value is not None and not math.isfinite(float(value)):  # json reads 1e999 as inf
        raise BadRequest(name, f"need a finite number, got {value}")
    return value


def _kind_name(kind: Any) -> str:
    return {bool: "true or false", int: "an integer", str: "a string", list: "a list"}.get(kind, "a number")


def _refuse_unsupported(body: dict[str, Any], *names: str) -> None:
    for name in names:
        if body.get(name) not in (None, False, 0):
            raise BadRequest(name, f"{name} is not served by this endpoint")


def _int32(value: int, name: str) -> int:
    if not -(1 << 31) <= value < 1 << 31:
        raise BadRequest(name, f"{value} is out of range")
    return value


def _uint64(value: int) -> int:
    if not 0 <= value < 1 << 64:
        raise BadRequest("seed", "need an integer in [0, 2**64)")
    return value



class Handler(BaseHTTPRequestHandler):
    """Routes one HTTP request to the endpoint (the server's `endpoint` and `expected` bearer header)."""

    protocol_version = "HTTP/1.1"  # keep-alive: agents make many calls
    timeout = SOCKET_TIMEOUT_SECONDS
    server: Any

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def _serve(self, method: str) -> None:
        try:
            body = self._body() if method == "POST" else {}
            if not self._authorized():
                self._error(HTTPStatus.UNAUTHORIZED, "missing or wrong bearer token (the job's token)",
                            code="invalid_api_key")
                return
            self._reply(HTTPStatus.OK, self._route(method, body))
        except BadRequest as error:
            self._error(HTTPStatus.BAD_REQUEST, str(error), param=error.param)
        except NotFound as error:
            self._error(HTTPStatus.NOT_FOUND, str(error), kind="not_found_error")
        except TooLarge as error:
            self.close_connection = True  # the body was not read
            self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, str(error))
        except Exception:  # the engine failed: this call fails, the endpoint keeps serving
            log.exception("openai endpoint: %s %s failed", method, self.path[:80])
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, "the generator failed on this request", kind="server_error")

    def _route(self, method: str, body: dict[str, Any]) -> dict[str, Any]:
        endpoint: OpenAIEndpoint = self.server.endpoint
        path = self.path.split("?", 1)[0]
        session = SESSION_PATH.match(path)
        session_id = urllib.parse.unquote(session.group(1)) if session else ""
        if (method, path) == ("POST", "/v1/chat/completions"):
            return endpoint.chat(body, self._session_id())
        if (method, path) == ("POST", "/v1/completions"):
            return endpoint.completion(body, self._session_id())
        if (method, path) == ("GET", "/v1/models"):
            return endpoint.models()
        if session and method == "GET":
            calls = endpoint.sessions.get(session_id)
            if calls is None:
                raise NotFound(f"no session {session_id[:80]!r} here (never recorded, deleted or evicted)")
            return {"id": session_id, "object": "session", "calls": [call.to_json() for call in calls]}
        if session and method == "DELETE":
            if not endpoint.sessions.delete(session_id):
                raise NotFound(f"no session {session_id[:80]!r} here")
            return {"id": session_id, "object": "session", "deleted": True}
        raise NotFound(f"no route {method} {path[:80]}")

    def _session_id(self) -> str | None:
        session_id = self.headers.get(SESSION_HEADER)
        if session_id is None:
            return None  # served, not recorded
        if not 0 < len(session_id) <= MAX_SESSION_ID_CHARS or "/" in session_id:
            raise BadRequest(SESSION_HEADER, f"need 1..{MAX_SESSION_ID_CHARS} characters without '/'")
        return session_id

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            raise TooLarge(f"request body of {length} bytes exceeds {MAX_BODY_BYTES}")
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw or b"null")
        except ValueError as error:
            raise BadRequest("body", f"not JSON: {error}")
        if not isinstance(body, dict):
            raise BadRequest("body", "need a JSON object")
        return body

    def _authorized(self) -> bool:
        given = self.headers.get("Authorization") or ""
        # Constant time, as wire.RequireToken: a byte-by-byte comparison would leak the token's prefix.
        return hmac.compare_digest(given.encode(), self.server.expected)

    def _error(self, status: HTTPStatus, message: str, param: str | None = None, code: str | None = None,
               kind: str = "invalid_request_error") -> None:
        self._reply(status, {"error": {"message": message, "type": kind, "param": param, "code": code}})

    def _reply(self, status: HTTPStatus, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("openai endpoint: " + format, *args)


class NotFound(Exception):
    pass


class TooLarge(Exception):
    pass


def serve_openai(endpoint: OpenAIEndpoint, port: int, host: str = "0.0.0.0", *, token: str) -> ThreadingHTTPServer:
    """Serve `endpoint` on host:port from a daemon thread; every request must carry `token`."""
    if not token:
        raise ValueError("the OpenAI-compatible endpoint needs the job's token: it never serves unauthenticated")
    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    server.endpoint = endpoint
    server.expected = f"Bearer {token}".encode()
    threading.Thread(target=server.serve_forever, name="openai-endpoint", daemon=True).start()
    log.info("OpenAI-compatible endpoint on %s:%d/v1", host, port)
    return server
