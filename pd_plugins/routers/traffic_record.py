"""The traffic record: what pd-router routes, one JSON line per request, for the simulator, the
replay and pd-planner (pd_plugins/workloads/traffic_record.py reads it back).

    {"t": 1764745200.12, "model": "llama", "input_tokens": 812, "output_tokens": 64,
     "block_keys": [...], "block_size": 16, "session": "c42", "turn": 3,
     "decision": "disaggregated", "prefill": "http://p0:8000", "decode": "http://d1:8000",
     "ttft_s": 0.081, "tpot_s": 0.012, "e2e_s": 0.84, "status": 200}

Never prompt text: the block keys are one-way chained hashes of the prompt's full blocks (as the
router computed them, at most `max_block_keys`). They still reveal which requests share prefixes,
so the file is created 0600.

Off the request's path: the proxy hands `record()` a few references (no I/O, no JSON); a bounded
queue takes them, and a full queue drops the record and counts it (never blocks a request). A
writer thread encodes them in batches, appends and rotates by size (path.1 .. path.N).

The requests in flight: a record is written when its request ends, so the recorder also lists the
requests that have not ended (`started()` to `record()`: one dict insert and one pop), for
`GET /admin/in_flight` (`in_flight()`): what `pd-planner --apply` adds to the record's window.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgspec
from prometheus_client.core import CounterMetricFamily

from pd_plugins.routers.config import TrafficRecordSpec
from pd_plugins.routers.policy.base import RequestInfo

log = logging.getLogger("pd_router.traffic_record")

BATCH = 512                 # records encoded and written per write
MAX_IN_FLIGHT = 100_000     # requests listed in flight at most; more go unlisted (counted)
WARN_INTERVAL_S = 60.0      # a failing disk is logged at most this often (counted always)
_STOP = object()


@dataclass(slots=True)
class Measured:
    """What the proxy learns about one request while serving it (filled in along the way)."""

    t: float                         # arrival, unix seconds
    decision: str = "failed"         # disaggregated | local | rejected | failed
    prefill: str | None = None
    decode: str | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int | None = None  # streamed tokens counted, when streamed
    # while it runs (GET /admin/in_flight): queued | prefill | decode (its prompt prefilled, no
    # token yet) | answer (its first token relayed), and the stream's events relayed so far
    phase: str = "queued"
    streamed: int = 0
    answer: bytes | None = None      # a whole (non-streamed) answer: the writer reads its usage
    status: int | None = None        # overrides the response's: 502 failed mid-stream, 499 left
    kv: str | None = None            # the decode's pd.kv verdict (non-streamed answers)


class TrafficRecorder:
    def __init__(self, spec: TrafficRecordSpec) -> None:
        self.spec = spec
        self._queue: queue.Queue = queue.Queue(maxsize=spec.queue_size)
        self._thread: threading.Thread | None = None
        self._file = None
        self._size = 0
        self._warned_at = float("-inf")
        self.counts = {"written": 0, "dropped": 0, "rotations": 0, "write_errors": 0,
                       "unlisted": 0}
        # the requests in flight, in arrival order (id of their Measured: it lives until record())
        self._running: dict[int, tuple[str, RequestInfo, int, Measured]] = {}
        self._encode = msgspec.json.Encoder().encode
        self._decode = msgspec.json.Decoder().decode

    # -- the request side (the event loop) ---------------------------------------------------
    def started(self, model: str, info: RequestInfo, block_size: int, measured: Measured) -> None:
        """A request arrived: listed in flight until its record()."""
        if len(self._running) < MAX_IN_FLIGHT:
            self._running[id(measured)] = (model, info, block_size, measured)
        else:
            self.counts["unlisted"] += 1

    def record(self, model: str, info: RequestInfo, block_size: int, measured: Measured,
               status: int, turn: int | None) -> None:
        """Queue one request's record: references only, encoded later by the writer. `turn`:
        None where the router does not track sessions (it cannot know)."""
        self._running.pop(id(measured), None)
        try:
            self._queue.put_nowait((model, info, block_size, measured, status, turn))
        except queue.Full:
            self.counts["dropped"] += 1

    def in_flight(self, model: str | None, limit: int, max_keys: int) -> dict[str, Any]:
        """The oldest `limit` requests in flight (of `model`, or all), each as its record will
        begin (same clock, same block keys, no prompt text) with `max_tokens`, its `phase` and
        the tokens relayed so far; at most `max_keys` block keys in all (the oldest requests get
        theirs first: the rest list fewer, as a record with fewer keys shares less)."""
        listed, total, keys_left = [], 0, max_keys
        for name, info, block_size, m in self._running.values():
            if model is not None and name != model:
                continue
            total += 1
            if len(listed) >= limit:
                continue
            keys = info.block_keys[:min(self.spec.max_block_keys, keys_left)]
            keys_left -= len(keys)
            listed.append({"t": round(m.t, 6), "model": name, "input_tokens": info.prompt_tokens,
                           "max_tokens": info.max_tokens, "block_keys": keys,
                           "block_size": block_size, "session": info.session_id,
                           "phase": m.phase, "output_tokens": m.streamed if m.phase == "answer"
                           else 0, "stream": info.stream})
        return {"now": time.time(), "total": total, "requests": listed,
                "unlisted": self.counts["unlisted"]}

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Open the file (0600; errors here stop the router from starting) and the writer."""
        self._open()
        self._thread = threading.Thread(target=self._run, name="pd-traffic-record", daemon=True)
        self._thread.start()
        log.info("traffic record: writing to %s (rotated at %d bytes, %d backups)",
                 self.spec.path, self.spec.max_bytes, self.spec.backups)

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued, then stop (bounded: a stuck disk does not hold shutdown)."""
        if self._thread is None:
            return
        try:
            self._queue.put(_STOP, timeout=timeout_s)
        except queue.Full:
            log.warning("traffic record: writer did not drain its queue; records lost")
        self._thread.join(timeout_s)
        self._thread = None

    # -- the writer thread --------------------------------------------------------------------
    def _open(self) -> None:
        fd = os.open(self.spec.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(fd, 0o600)  # an existing file keeps no wider mode
        # unbuffered: a write that failed leaves no bytes behind in a buffer to land later
        self._file = os.fdopen(fd, "ab", buffering=0)
        self._size = os.fstat(fd).st_size

    def _replaced(self) -> bool:
        """The path no longer names the open file (an operator deleted it to free space, or
        moved it): writing on would fill a file nobody can see."""
        try:
            path = os.stat(self.spec.path)
        except FileNotFoundError:
            return True
        mine = os.fstat(self._file.fileno())
        return (path.st_dev, path.st_ino) != (mine.st_dev, mine.st_ino)

    def _rotate(self) -> None:
        path, n = self.spec.path, self.spec.backups
        try:
            if n == 0:
                os.truncate(path, 0)
            else:
                for i in range(n - 1, 0, -1):
                    if os.path.exists(f"{path}.{i}"):
                        os.replace(f"{path}.{i}", f"{path}.{i + 1}")
                os.replace(path, f"{path}.1")
        except FileNotFoundError:
            pass  # deleted under the writer (an operator freeing space): a new file, no backup
        finally:  # a file at the path again, even when renaming failed
            self._file.close()
            self._open()
        self.counts["rotations"] += 1

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            batch = [item]
            while len(batch) < BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = any(entry is _STOP for entry in batch)
            try:
                if self._file.closed or self._replaced():  # a failed reopen; a deleted file
                    self._file.close()
                    self._open()
                self._write([self._line(*entry) for entry in batch if entry is not _STOP])
            except Exception as exc:  # noqa: BLE001 - a full disk must not end the thread
                self.counts["write_errors"] += 1
                now = time.monotonic()
                if now - self._warned_at >= WARN_INTERVAL_S:  # not one line per batch
                    self._warned_at = now
                    log.warning("traffic record: write to %s failed (%d failed batches so "
                                "far): %s", self.spec.path, self.counts["write_errors"], exc)
            if stop:
                self._file.close()
                return

    def _write(self, lines: list[bytes]) -> None:
        chunk: list[bytes] = []
        size = self._size
        for line in lines:
            if size + len(line) > self.spec.max_bytes and (size or chunk):
                self._append(chunk)
                chunk, size = [], 0
                self._rotate()
            chunk.append(line)
            size += len(line)
        self._append(chunk)

    def _append(self, chunk: list[bytes]) -> None:
        """All of the chunk's lines or none: a write that fails part-way (a full disk) is cut
        back off, or the next batch would append to a torn line and the file would not parse."""
        fd = self._file.fileno()
        start = os.fstat(fd).st_size
        data = memoryview(b"".join(chunk))
        try:
            while data:
                written = self._file.write(data)  # may be short (the disk filled up mid-write)
                if not written:
                    raise OSError(errno.ENOSPC, "nothing written")
                data = data[written:]
        except BaseException:
            os.ftruncate(fd, start)
            self._size = start
            raise
        self._size = start + sum(map(len, chunk))
        self.counts["written"] += len(chunk)

    def _line(self, model: str, info: RequestInfo, block_size: int, m: Measured,
              status: int, turn: int | None) -> bytes:
        output = m.output_tokens
        if output is None and m.answer is not None:
            output = self._usage_tokens(m.answer)
        if output is None:  # not served: the tokens it asked for (what it would have cost)
            output = info.max_tokens or 0
        record: dict[str, Any] = {
            "t": round(m.t, 6), "model": model, "input_tokens": info.prompt_tokens,
            "output_tokens": output, "block_keys": info.block_keys[:self.spec.max_block_keys],
            "block_size": block_size, "session": info.session_id,
            "turn": turn, "decision": m.decision,
            "prefill": m.prefill, "decode": m.decode, "ttft_s": _rounded(m.ttft_s),
            "tpot_s": _rounded(m.tpot_s), "e2e_s": _rounded(m.e2e_s),
            "status": m.status if m.status is not None else status}
        if m.kv is not None:
            record["kv"] = m.kv
        return self._encode(record) + b"\n"

    def _usage_tokens(self, answer: bytes) -> int | None:
        try:
            body = self._decode(answer)
            tokens = body["usage"]["completion_tokens"]
        except (msgspec.DecodeError, KeyError, TypeError):
            return None
        return tokens if isinstance(tokens, int) and tokens >= 0 else None

    def collector(self) -> "RecordCollector":
        return RecordCollector(self)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


class RecordCollector:
    """/metrics: records written, dropped (queue full), rotations, failed writes, unlisted."""

    def __init__(self, recorder: TrafficRecorder) -> None:
        self.recorder = recorder

    def collect(self):
        family = CounterMetricFamily("pd_router_traffic_records", "Traffic record: records "
                                     "written, dropped because the writer's queue was full, file "
                                     "rotations, failed writes; requests not listed in flight "
                                     "(the list was full)", labels=["event"])
        for event, count in self.recorder.counts.items():
            family.add_metric([event], count)
        yield family
