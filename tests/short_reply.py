"""An HTTP server on loopback that dies mid-reply: it promises a body and closes after a few bytes of it, as a
worker or an API server killed while answering does (http.client raises IncompleteRead, which is no OSError)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def short_reply_server() -> Iterator[str]:
    """Its base URL; it answers one request so."""
    listener = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        connection, _ = listener.accept()
        with connection:
            connection.recv(65536)
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15758\r\n"
                               b"\r\n{\"kind\"")

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()
