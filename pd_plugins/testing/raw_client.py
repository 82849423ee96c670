"""A client the test controls byte by byte (when it leaves, how fast it reads), and label-aware
Prometheus samples, for tests of how servers treat their clients."""

from __future__ import annotations

import json
import re
import socket
from typing import Any
from urllib.parse import urlsplit


def send_raw(url: str, body: dict[str, Any], path: str = "/v1/completions",
             rcvbuf: int | None = None) -> socket.socket:
    """POST `body` to `url` over a bare socket and return it unread: closing it is the client
    going away; with a small `rcvbuf` and no reads, the server's writes block once it is full."""
    parts = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:  # before connect: it sets the TCP window offered to the server
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((parts.hostname, parts.port))
    data = json.dumps(body).encode()
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (path.encode(), parts.netloc.encode(),
                                                    len(data), data))
    return sock


_SAMPLE = re.compile(r"([A-Za-z_:][\w:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def sample(metrics_text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` (Prometheus text) whose labels include `labels`; 0 if none."""
    total = 0.0
    for line in metrics_text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or match.group(1) != name:
            continue
        have = dict(_LABEL.findall(match.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(match.group(3))
    return total
