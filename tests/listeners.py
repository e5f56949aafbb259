"""Which local addresses listen on a TCP port (read from /proc/net/tcp and tcp6; Linux only)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

_LISTEN = "0A"


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))  # four little-endian 32-bit words
    return str(ipaddress.IPv6Address(words))


def listening_addresses(port: int) -> set[str]:
    """e.g. {"127.0.0.1"}, or {"0.0.0.0"} / {"::"} for a socket listening on every interface."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local, state = fields[1], fields[3]
            hex_address, hex_port = local.split(":")
            if state == _LISTEN and int(hex_port, 16) == port:
                found.add(_address(hex_address))
    return found
