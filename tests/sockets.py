"""The sockets a process listens on, read from /proc (Linux), for tests of where servers bind."""

from __future__ import annotations

import ipaddress
import os

LISTEN = "0A"  # a socket's state in /proc/net/tcp


def listening(pid: int | str = "self") -> set[tuple[str, int]]:
    """(address, port) of every socket process `pid` listens on, from /proc/net/tcp and tcp6."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table, encoding="ascii") as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                if fields[3] == LISTEN and fields[9] in inodes:
                    host, port = fields[1].split(":")
                    found.add((_kernel_address(host), int(port, 16)))
    return found


def _kernel_address(hexed: str) -> str:
    """/proc/net/tcp writes addresses as 32-bit words in host (little-endian) order."""
    raw = b"".join(bytes.fromhex(hexed[i:i + 8])[::-1] for i in range(0, len(hexed), 8))
    return str(ipaddress.ip_address(raw))


def is_loopback(host: str) -> bool:
    address = ipaddress.ip_address(host)
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback
