"""The private dockerd's upstream DNS server (.ci/docker-engine.sh): NXDOMAIN to every name.

dockerd runs with --iptables=false (no NAT rules on the CI host), so its containers
cannot reach the host's resolver. Docker's embedded DNS (127.0.0.11) forwards a name it
does not know (a stopped container's, say) upstream, and with no upstream answering a
lookup fails only after the client's 10 s of timeouts, where on an ordinary Docker
engine it gets NXDOMAIN at once. etcd members dialling a stopped peer by name then stall:
followers forwarding lease renewals to a leader just killed held them long enough for
leases to expire with a quorum up (tests/test_compose.py). This server, on the engine's
bridge address (reachable from every container without NAT) and named by dockerd --dns,
answers NXDOMAIN to every query, as an upstream does for a name it does not know: the
test containers need no outside name, and nothing leaves the machine.

Usage: python3 dns-nxdomain.py ADDRESS (UDP port 53 there).
"""

from __future__ import annotations

import socket
import struct
import sys

_HEADER = struct.Struct(">HHHHHH")  # id, flags, question / answer / authority / extra counts
_RESPONSE, _KEPT, _AVAILABLE, _NXDOMAIN = 0x8000, 0x7900, 0x0080, 3  # QR; opcode and RD kept


def reply(query: bytes) -> bytes | None:
    """NXDOMAIN for a one-question query; None for anything else (it gets no answer)."""
    if len(query) < _HEADER.size:
        return None
    ident, flags, questions, *_ = _HEADER.unpack_from(query)
    if flags & _RESPONSE or questions != 1:
        return None
    end = _HEADER.size
    while end < len(query) and query[end]:  # the name's labels, up to the root label
        end += query[end] + 1
    end += 1 + 4  # the root label, the type and the class
    if end > len(query):
        return None
    flags = _RESPONSE | (flags & _KEPT) | _AVAILABLE | _NXDOMAIN
    return _HEADER.pack(ident, flags, 1, 0, 0, 0) + query[_HEADER.size : end]


def main() -> None:
    """Answer on ADDRESS:53 until killed."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as server:
        server.bind((sys.argv[1], 53))
        while True:
            query, client = server.recvfrom(65535)
            answer = reply(query)
            if answer is not None:
                server.sendto(answer, client)


if __name__ == "__main__":
    main()
