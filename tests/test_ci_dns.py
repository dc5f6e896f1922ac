""".ci/dns-nxdomain.py, the private Docker engine's upstream DNS: NXDOMAIN, well formed."""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / ".ci" / "dns-nxdomain.py"
_spec = importlib.util.spec_from_file_location("dns_nxdomain", SCRIPT)
assert _spec is not None and _spec.loader is not None
dns = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dns)


def query(name: str, *, ident: int = 0x1234, flags: int = 0x0100, qtype: int = 1) -> bytes:
    labels = b"".join(bytes([len(p)]) + p.encode() for p in name.split("."))
    return (
        struct.pack(">HHHHHH", ident, flags, 1, 0, 0, 0)
        + labels
        + b"\0"
        + struct.pack(">HH", qtype, 1)
    )


def test_a_query_gets_nxdomain_for_its_own_question() -> None:
    for qtype in (1, 28):  # A and AAAA, as a resolver asks both
        q = query("etcd-0", ident=0xBEEF, qtype=qtype)
        answer = dns.reply(q + b"\0\0")  # bytes after the question (an OPT record) dropped
        ident, flags, questions, answers, authority, extra = struct.unpack_from(">HHHHHH", answer)
        assert ident == 0xBEEF
        assert flags & 0x8000 and flags & 0x0100 and flags & 0x000F == 3  # response, RD, NXDOMAIN
        assert (questions, answers, authority, extra) == (1, 0, 0, 0)
        assert answer[12:] == q[12:]


def test_what_is_no_query_gets_no_answer() -> None:
    assert dns.reply(b"\x12\x34") is None  # shorter than a header
    assert dns.reply(query("etcd-0", flags=0x8180)) is None  # a response
    assert dns.reply(query("etcd-0")[:-3]) is None  # the question cut short
