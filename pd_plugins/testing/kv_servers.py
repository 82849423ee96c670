"""Real KV stores for tests, on loopback ports: Debian's redis-server and LMCache's `lm://` server.

Each is a ManagedProcess: started by the test, stopped by PID (process group) in a finalizer.
"""

from __future__ import annotations

import shutil
import socket
import sys
import time
from dataclasses import dataclass

from pd_plugins.testing.processes import ManagedProcess

REDIS_SERVER = shutil.which("redis-server")


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


class _TcpServer(ManagedProcess):
    """A server that is ready once its port answers (`ready` says how)."""

    def ready(self) -> bool:
        return port_open(self.port)

    def wait_healthy(self, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while not self.ready():
            if not self.alive():
                raise RuntimeError(f"{self.name} exited early:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not answering:\n{self.log_tail()}")
            time.sleep(0.05)
        return self


@dataclass
class RedisServer(_TcpServer):
    name: str = "redis"

    def command(self) -> list[str]:
        return [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.log_dir)]

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def ready(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def client(self):
        import redis
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)


@dataclass
class LMCacheServer(_TcpServer):
    """LMCache's standalone KV server (`lm://host:port`), keeping chunks in its CPU memory."""

    name: str = "lmcache-server"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(self.port), "cpu"]

    @property
    def lm_url(self) -> str:
        return f"lm://127.0.0.1:{self.port}"
