"""The host's way to the cluster's API server: a TCP relay from 127.0.0.1 on the host to the API server inside
the cluster's network namespace. The host gets no route into that namespace, so nothing addressed to the
cluster can ever leave this machine, even after the cluster is gone (127.0.0.1 then refuses).

    python scripts/kube/relay.py NETNS_PATH TARGET_HOST TARGET_PORT PORT_FILE
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import socket
import sys
from pathlib import Path

CLONE_NEWNET = 0x40000000
CHUNK = 1 << 16


def enter_netns(path: str) -> None:
    """Sockets made from now on (by this thread) live in that namespace; the listener made before stays."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), f"setns {path}")
    os.close(fd)


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()


async def relay(listener: socket.socket, host: str, port: int) -> None:
    async def connect(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(host, port)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(pipe(client_reader, server_writer), pipe(server_reader, client_writer),
                             return_exceptions=True)

    server = await asyncio.start_server(connect, sock=listener)
    async with server:
        await server.serve_forever()


def main(netns: str, host: str, port: str, port_file: str) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    enter_netns(netns)
    # Renamed into place: whoever waits for the file never reads half of it.
    Path(port_file + ".part").write_text(str(listener.getsockname()[1]))
    os.replace(port_file + ".part", port_file)
    asyncio.run(relay(listener, host, int(port)))


if __name__ == "__main__":
    main(*sys.argv[1:])
