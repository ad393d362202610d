"""A DNS server on a loopback UDP port whose answer can change while clients run: gRPC's resolver (c-ares) asks it
when the target names it, `dns://127.0.0.1:PORT/NAME:GRPC_PORT`.  It answers A queries for any name with the
current address list (TTL 0) and every other query with no records."""

from __future__ import annotations

import socket
import struct
import threading


class FakeDNS:
    def __init__(self, addresses: list[str]):
        self.addresses = list(addresses)
        self.queries = 0
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                data, peer = self.sock.recvfrom(4096)
            except OSError:
                return
            answer = self.answer(data)
            if answer is not None:
                self.sock.sendto(answer, peer)

    def answer(self, query: bytes) -> bytes | None:
        if len(query) < 12:
            return None
        qid, flags, qdcount = struct.unpack("!HHH", query[:6])
        if qdcount != 1:
            return None
        end = 12
        while query[end] != 0:  # the question's name: length-prefixed labels, then a zero byte
            end += 1 + query[end]
        qtype = struct.unpack("!H", query[end + 1:end + 3])[0]
        question = query[12:end + 5]
        addresses = list(self.addresses) if qtype == 1 else []
        self.queries += 1
        header = struct.pack("!HHHHHH", qid, 0x8180 | (flags & 0x0100), 1, len(addresses), 0, 0)
        records = b"".join(struct.pack("!HHHIH", 0xC00C, 1, 1, 0, 4) + socket.inet_aton(a) for a in addresses)
        return header + question + records

    def close(self) -> None:
        self.sock.close()
