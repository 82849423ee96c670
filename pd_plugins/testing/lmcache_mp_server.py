"""An LMCache multiprocess ("MP") cache server for tests: `lmcache server` on 127.0.0.1.

    with lmcache_mp_server(port) as server:      # or LMCacheMPServer(port=...).start().wait_healthy()
        client = LMCacheMPClient(server.mp_url, ...)

The server runs in its own process group (stopped by PID: SIGTERM, then SIGKILL), with its log
under a temporary folder (server.log_tail() for failing tests), KV transfer mode lmcache_driven
(KV over POSIX shared memory), LRU eviction, a small L1 (`l1_size_gb`), observability and usage
telemetry off, and `--null-block-id -1` so that no engine block id is treated as absent data.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator


from pd_plugins.testing.kv_servers import port_open
from pd_plugins.testing.processes import ManagedProcess, free_port


def lmcache_command() -> list[str]:
    """The `lmcache` console script of this interpreter's environment, or its -c equivalent."""
    script = Path(sys.executable).parent / "lmcache"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from lmcache.cli.main import main; sys.exit(main())"]


@dataclass(kw_only=True)
class LMCacheMPServer(ManagedProcess):
    name: str = "lmcache-mp"
    http_port: int = field(default_factory=free_port)
    chunk_size: int = 16
    l1_size_gb: float = 0.05
    max_workers: int = 2
    extra_args: list[str] = field(default_factory=list)
    health_path: str = "/healthcheck"

    @property
    def mp_url(self) -> str:
        return f"mp://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:  # HTTP admin API, used for the health check
        return f"http://127.0.0.1:{self.http_port}"

    def command(self) -> list[str]:
        return [
            *lmcache_command(), "server",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
            "--chunk-size", str(self.chunk_size),
            "--l1-size-gb", str(self.l1_size_gb),
            "--eviction-policy", "LRU",
            "--supported-transfer-mode", "lmcache_driven",
            "--null-block-id", "-1",
            "--max-workers", str(self.max_workers),
            "--disable-observability",
            *self.extra_args,
        ]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1", LMCACHE_DISABLE_BANNER="1",
                   PYTHONHASHSEED="0")
        return env

    def wait_healthy(self, timeout: float = 120.0) -> LMCacheMPServer:
        """Until the HTTP health check answers, then the ZMQ port accepts connections."""
        deadline = time.monotonic() + timeout
        super().wait_healthy(timeout)
        while not port_open(self.port):
            if not self.alive() or time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: ZMQ port {self.port} not open:\n{self.log_tail()}")
            time.sleep(0.2)
        return self


@contextlib.contextmanager
def lmcache_mp_server(port: int | None = None, *, timeout: float = 120.0,
                      **kwargs: object) -> Iterator[LMCacheMPServer]:
    """Start a server (on `port`, or a free one), wait until it is ready, stop it on exit."""
    server = LMCacheMPServer(**({"port": port} if port else {}), **kwargs)  # type: ignore[arg-type]
    try:
        server.start().wait_healthy(timeout)
        yield server
    finally:
        server.stop(grace=10)
