"""vLLM's KV events from a modelled mock (`--kv-events`), as the router's KvEventSubscriber reads
them: the blocks its prefix cache stores and evicts, keyed as the router keys them."""

from __future__ import annotations

import time

import msgspec


class KvEventPublisher:
    """vLLM's KV events on a ZMQ PUB socket: frames [topic, seq (8 bytes, big endian),
    msgpack([ts, [event, ...]])], each event a tagged map as vLLM's msgspec structs encode."""

    def __init__(self, endpoint: str, topic: str = "") -> None:
        import zmq
        self._zmq = zmq
        self.sock = zmq.Context.instance().socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.topic = topic.encode()
        self.seq = 0
        self.pending: list[dict] = []
        self.sent_events = 0
        self.encoder = msgspec.msgpack.Encoder()

    def stored(self, hashes: list[int], parent: int | None, token_ids: list[int], block_size: int) -> None:
        self.pending.append({"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                             "token_ids": token_ids, "block_size": block_size, "lora_id": None,
                             "medium": "GPU", "lora_name": None})

    def removed(self, hashes: list[int]) -> None:
        self.pending.append({"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU"})

    def flush(self) -> None:
        if not self.pending:
            return
        payload = self.encoder.encode([time.time(), self.pending])
        try:
            self.sock.send_multipart((self.topic, self.seq.to_bytes(8, "big"), payload),
                                     flags=self._zmq.NOBLOCK)
        except self._zmq.Again:
            pass  # a PUB drops what no subscriber can take, as vLLM's does
        self.seq += 1
        self.sent_events += len(self.pending)
        self.pending = []

    def close(self) -> None:
        self.sock.close(linger=0)
