"""gRPC plumbing shared by every worker: servers with health and reflection, and client channels.

Every call carries the job's token (`auth`) as `authorization: Bearer <token>`; servers refuse calls without it
(UNAUTHENTICATED), except grpc.health.v1: Kubernetes' gRPC probes cannot send metadata, and health reveals
nothing. Channels are plaintext and gRPC call credentials need TLS, so a client interceptor adds the header.

The controller's calls also carry its leader epoch (`x-rlfleet-epoch: N`, controller/leadership.py), and servers
fence them (`Fence`): a call that changes state, from a controller older than the newest one the server has
heard from, is refused with FAILED_PRECONDITION, so a deposed controller's late calls cannot act beside its
successor's. Its client raises `Fenced`, which is never retried: a deposed controller stops.
"""

from __future__ import annotations

import collections
import functools
import hmac
import logging
import os
import threading
from concurrent import futures
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)

# Weights never travel over gRPC; calls that grow with a batch (prompts x samples x tokens) are split to fit this
# (message_budget).
MAX_MESSAGE_BYTES = 64 << 20
OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# A peer that stops answering (SIGSTOP, a hung node, a lost network) keeps its TCP connection open; only
# HTTP/2 pings notice. A call in flight on such a channel fails UNAVAILABLE within about
# KEEPALIVE_SECONDS + KEEPALIVE_TIMEOUT_SECONDS, long before a generous call deadline.
KEEPALIVE_SECONDS = 10
KEEPALIVE_TIMEOUT_SECONDS = 10
CLIENT_OPTIONS = OPTIONS + [
    ("grpc.keepalive_time_ms", KEEPALIVE_SECONDS * 1000),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_SECONDS * 1000),
    # Newer gRPC cores wait for a ping's answer this long instead (1 minute by default once keepalive is on).
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_SECONDS * 1000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # A peer that comes back (a restarted pod) is reached within seconds: gRPC's reconnect backoff grows
    # to 2 minutes by default, and calls fail at once while it lasts.
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 5000),
]
# Servers must accept those pings: by default gRPC answers pings more often than every 5 minutes with
# GOAWAY (too_many_pings), which would fail every long Generate call.
# Waiting for a server that is still starting (a vLLM generator takes half a minute): by default gRPC retries the
# connection after 1, 2.6, 5.2, 9.3, 16, 26, 43 s, seeing a server up at 28 s only at 43 s.
READY_OPTIONS = OPTIONS + [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]
SERVER_OPTIONS = OPTIONS + [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_SECONDS * 1000 // 2),
    ("grpc.http2.max_ping_strikes", 0),
]
AUTH_HEADER = "authorization"
OPEN_METHODS_PREFIX = f"/{health.SERVICE_NAME}/"
EPOCH_HEADER = "x-rlfleet-epoch"
"""The caller's leader epoch (controller/leadership.py): on a call, the controller's; on a fenced refusal's trailing
metadata, the newest the server has heard from."""
# Fenced: every call of our services but these, which only read (the operator and the CLI read status too, and a
# deposed controller reading changes nothing). Fencing by default keeps a new method that changes state fenced.
FENCED_PREFIX = "/rlfleet.v1."
READ_ONLY_METHODS = frozenset({"/rlfleet.v1.Generator/Status", "/rlfleet.v1.Controller/Status"})
# Epochs are int64 wherever they are stored or shown.
MAX_EPOCH = (1 << 63) - 1
# Where a worker's servers keep the newest leader epoch they have seen, a file per port, so that a restarted worker
# still refuses a deposed leader (cli.py sets it to the worker's own folder of its run directory).
FENCE_DIR_ENV = "RLFLEET_FENCE_DIR"


def serve(
    port: int,
    add_servicers: Iterable[Callable[[grpc.Server], None]],
    service_names: Iterable[str],
    host: str = "0.0.0.0",
    threads: int = 8,
    *,
    token: str,
) -> tuple[grpc.Server, health.HealthServicer]:
    """Start a server on host:port with our services, grpc.health.v1 (SERVING) and reflection.

    Every call but health checks must carry `token`: there is no unauthenticated server. Every call that changes
    state is fenced by the caller's leader epoch (Fence).
    """
    # The token first: a call that is refused it never reaches the fence, so it cannot move the fence's epoch.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads), options=SERVER_OPTIONS,
                         interceptors=[RequireToken(token), Fence(_fence_file(port))])
    for add in add_servicers:
        add(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    for name in names + [""]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(names + [health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise OSError(f"cannot bind gRPC port {host}:{port}")
    server.start()
    return server, health_servicer


def channel(address: str, token: str, epoch: int | None = None) -> grpc.Channel:
    """A channel whose every call carries `token` and, from a leading controller, its leader `epoch`."""
    return grpc.intercept_channel(grpc.insecure_channel(address, options=CLIENT_OPTIONS), AttachToken(token, epoch))


def wait_ready(address: str, timeout: float) -> None:
    """Block until the server at address answers health checks with SERVING (health needs no token)."""
    with grpc.insecure_channel(address, options=READY_OPTIONS) as chan:
        grpc.channel_ready_future(chan).result(timeout=timeout)
        stub = health_pb2_grpc.HealthStub(chan)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            raise RuntimeError(f"{address} is not serving")


# Codes a call may fail with while its server restarts or is busy: worth retrying within a budget, for a call that
# is read-only or idempotent only (a DEADLINE_EXCEEDED call may still be running on the server).
TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# Sequences one request may carry: a trainer batch is promptsPerStep x groupSize (at most 64 Ki by the spec's bounds).
MAX_SEQUENCES = 65536


class Misconfigured(RuntimeError):
    """A call refused for a reason retrying cannot fix (wrong token, no such method): the run must stop."""


class Fenced(Misconfigured):
    """A call refused by the fence: a newer controller leads, so this one is deposed and must stop, not retry."""


# Codes that say the caller talks to the wrong server or with the wrong credentials.
MISCONFIGURED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED)


def raise_if_misconfigured(error: grpc.RpcError, what: str, *also: grpc.StatusCode) -> None:
    """Fenced for a fence's refusal; Misconfigured for a MISCONFIGURED code (or one of `also`); otherwise nothing."""
    raise_if_fenced(error, what)
    if error.code() in MISCONFIGURED + also:
        raise Misconfigured(f"{what}: {error.code().name}: {error.details()}") from error


def raise_if_fenced(error: grpc.RpcError, what: str) -> None:
    """Fenced for a fence's refusal (FAILED_PRECONDITION with the newest epoch in its trailing metadata, which tells
    it from a method's own FAILED_PRECONDITION); otherwise nothing."""
    trailing = getattr(error, "trailing_metadata", lambda: None)() or ()
    if error.code() == grpc.StatusCode.FAILED_PRECONDITION and any(key == EPOCH_HEADER for key, _ in trailing):
        raise Fenced(f"{what}: {error.details()}") from error


def invalid(context: grpc.ServicerContext, message: str) -> None:
    """Refuse a bad request with INVALID_ARGUMENT (aborts the call)."""
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)


def sequences_problem(sequences: Sequence[Any], max_len: int, vocab_size: int) -> str | None:
    """What is wrong with a request's (prompt_ids, completion_ids) sequences, for INVALID_ARGUMENT; None if nothing."""
    if not sequences or len(sequences) > MAX_SEQUENCES:
        return f"sequences: need 1..{MAX_SEQUENCES}, got {len(sequences)}"
    for index, seq in enumerate(sequences):
        ids = list(seq.prompt_ids) + list(seq.completion_ids)
        if not seq.prompt_ids or not seq.completion_ids:
            return f"sequences[{index}]: needs prompt_ids and completion_ids"
        if len(ids) > max_len:
            return f"sequences[{index}]: {len(ids)} tokens exceed {max_len}"
        if min(ids) < 0 or max(ids) >= vocab_size:
            return f"sequences[{index}]: token ids must be in [0, {vocab_size})"
    return None


def _bearer(token: str) -> str:
    if not token:
        raise ValueError("a gRPC token is required: workers never serve or call gRPC unauthenticated")
    return f"Bearer {token}"


class RequireToken(grpc.ServerInterceptor):
    """Refuses every call but health checks unless it carries the bearer token (UNAUTHENTICATED)."""

    def __init__(self, token: str):
        self._expected = _bearer(token).encode()

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        if details.method.startswith(OPEN_METHODS_PREFIX) or self._authorized(details.invocation_metadata):
            return continuation(details)
        # Refused alike whether the method exists or not: without the token, nothing is revealed.
        return _refusal(continuation(details))

    def _authorized(self, metadata: Any) -> bool:
        given = next((value for key, value in metadata or () if key == AUTH_HEADER), None)
        # Constant time: a byte-by-byte comparison would leak the token's prefix through timing.
        return isinstance(given, str) and hmac.compare_digest(given.encode(), self._expected)


class Fence(grpc.ServerInterceptor):
    """Refuses a deposed controller's calls. Every call of our services but READ_ONLY_METHODS is fenced: the server
    keeps the highest leader epoch (EPOCH_HEADER) it has been called with, and refuses a fenced call with a lower
    one (FAILED_PRECONDITION, naming both, the newest in the trailing metadata); a higher one becomes the newest.

    A fenced call without the header is served while the server has heard of no epoch, so a standalone server still
    answers tools, benchmarks and tests, and refused once it has: after a leader called, only leaders may. The epoch
    is checked as the call starts to run, not as it arrives: a call that waited for a thread while a newer leader
    called is refused.
    The newest epoch is kept in `kept` (a worker's: FENCE_DIR_ENV), read as the fence starts and rewritten as it
    rises, so a restarted worker goes on refusing the leaders it had refused; without it, in memory only.
    """

    def __init__(self, kept: Path | None = None):
        self._kept = kept
        self._newest: int | None = _read_epoch(kept) if kept else None
        self._lock = threading.Lock()

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None or not details.method.startswith(FENCED_PREFIX) or details.method in READ_ONLY_METHODS:
            return handler
        name, make = _kind(handler)
        checked = functools.partial(self._checked, details.method, getattr(handler, name))
        return make(checked, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)

    def _checked(self, method: str, behavior: Callable, request: Any, context: grpc.ServicerContext) -> Any:
        given = next((value for key, value in context.invocation_metadata() or () if key == EPOCH_HEADER), None)
        epoch = _epoch(given)
        if epoch is None and given is not None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{EPOCH_HEADER}: {given!r} is not a leader epoch (an integer in 1..{MAX_EPOCH})")
        newest = self._admit(epoch)
        if newest is not None:
            context.set_trailing_metadata([(EPOCH_HEADER, str(newest))])
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, _fenced_message(method, epoch, newest))
        return behavior(request, context)

    def _admit(self, epoch: int | None) -> int | None:
        """The newest epoch if it fences a call with `epoch`; None, with the newest raised to `epoch`, if not."""
        with self._lock:
            newest = self._newest
            if newest is not None and (epoch is None or epoch < newest):
                return newest
            self._newest = newest if epoch is None else epoch
            if self._kept and self._newest != newest:
                store_epoch(self._kept, self._newest)
        if epoch is not None and (newest is None or epoch > newest):
            log.info("fence: controller epoch %d leads (before it: %s)", epoch, "none" if newest is None else newest)
        return None


def _fence_file(port: int) -> Path | None:
    folder = os.environ.get(FENCE_DIR_ENV)
    return Path(folder) / f"{port}.epoch" if folder else None


def _read_epoch(path: Path) -> int | None:
    try:
        return _epoch(path.read_text().strip())
    except FileNotFoundError:
        return None


def store_epoch(path: Path, epoch: int) -> None:
    """Whole or not at all, and durably: written under a temporary name, synced and renamed, the rename synced too, so
    a crash or a power loss leaves the epoch before or this one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "w", encoding="utf-8") as handle:
        handle.write(f"{epoch}\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _fenced_message(method: str, epoch: int | None, newest: int) -> str:
    if epoch is None:
        return (f"{method} without {EPOCH_HEADER}: controller epoch {newest} leads, and only a leader's calls change "
                f"this server's state")
    return (f"{method} from a deposed controller (epoch {epoch}): the current leader is epoch {newest}; the deposed "
            f"one must stop")


def _epoch(value: Any) -> int | None:
    """The epoch a header's value names, or None (absent, or not a leader epoch)."""
    if not isinstance(value, str) or not value.isdigit():  # gRPC header values are ASCII
        return None
    epoch = int(value)
    return epoch if 1 <= epoch <= MAX_EPOCH else None


def _kind(handler: grpc.RpcMethodHandler | None) -> tuple[str, Callable[..., grpc.RpcMethodHandler]]:
    """The name of `handler`'s behaviour and the maker of handlers of its streaming kind (unary-unary for an unknown
    method's None)."""
    streaming = (handler.request_streaming, handler.response_streaming) if handler else (False, False)
    return {
        (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
        (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
        (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
        (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
    }[streaming]


def _refuse(_request: Any, context: grpc.ServicerContext) -> None:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")


def _refusal(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as `handler` that refuses the call (reading nothing of its request)."""
    return _kind(handler)[1](_refuse)


class _CallDetails(
    collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                                            "compression")),
    grpc.ClientCallDetails,
):
    pass


class AttachToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                  grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the bearer token, and a leader's epoch if given, to every call made on the channel it wraps."""

    def __init__(self, token: str, epoch: int | None = None):
        self._headers = [(AUTH_HEADER, _bearer(token))] + ([] if epoch is None else [(EPOCH_HEADER, str(epoch))])

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        ours = {key for key, _ in self._headers}
        metadata = [item for item in details.metadata or () if item[0] not in ours] + self._headers
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._details(details), requests)
