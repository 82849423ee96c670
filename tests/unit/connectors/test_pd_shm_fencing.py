"""PdShmConnector's worker side writes a step's blocks into pool slots under one fence per step:
a step that stalls past its write lease before its first copy loses its slots and writes
nothing into them; one that stalls between layers keeps them. Real pool on /dev/shm, real KV
tensors; the connector itself is replaced by a stand-in holding the state `_WorkerSide` reads
(a real PdShmConnector needs a running vLLM engine: tests/e2e/test_pd_shm.py)."""

import hashlib
import os
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pd_plugins.connectors.vllm.pd_shm import (
    PdShmMetadata, ShmOptions, StoreOp, _WorkerSide, pool_key,
)
from pd_plugins.transfer.kv_faults import KvFaults
from pd_plugins.transfer.paged_kv import PagedKV
from pd_plugins.transfer.shm_pool import ShmKVPool, remove_pool

LEASE_S = 0.2
NUM_BLOCKS = 4
LAYERS = ("layer.0", "layer.1")
BLOCK_BYTES = 2 * 64 * 4  # two layers of 64 float32


@pytest.fixture
def setup(tmp_path):
    path = f"/dev/shm/pd-shm-fence-{os.getpid()}-{tmp_path.name}"
    engine = ShmKVPool(path, slot_bytes=BLOCK_BYTES, layout="pd-shm-fence", size_bytes=16 * 4096,
                       checksums=False, prefault=False)
    other = ShmKVPool(path, slot_bytes=BLOCK_BYTES, layout="pd-shm-fence", checksums=False,
                      prefault=False)  # another engine on the pool
    fill = [hashlib.sha256(b"fill%d" % i).digest() for i in range(other.num_slots - 1)]
    refs = other.reserve(fill)
    zeros = np.zeros(BLOCK_BYTES, np.uint8)
    other.publish([(r, other.write(r, zeros), BLOCK_BYTES) for r in refs], hold_s=60)
    stand_in = SimpleNamespace(pool=engine, rank=0, pieces=1, slot_bytes=BLOCK_BYTES,
                               options=ShmOptions(read_lease_s=LEASE_S, save_mode="layer"),
                               faults=KvFaults.none())
    worker = _WorkerSide(stand_in)
    caches = [torch.arange(NUM_BLOCKS * 64, dtype=torch.float32).reshape(NUM_BLOCKS, 64) + 1000 * i
              for i in range(len(LAYERS))]
    worker.kv = PagedKV(caches, NUM_BLOCKS)
    worker._layer_index = {name: i for i, name in enumerate(LAYERS)}
    yield worker, other
    other.close()
    engine.close()
    remove_pool(path)


BLOCK_HASH = hashlib.sha256(b"prompt block").digest()
KEY = pool_key(BLOCK_HASH, 0)
META = PdShmMetadata(stores=[StoreOp("req-1", [2], [BLOCK_HASH], [77])])


def read(pool, key):
    (pinned,) = pool.pin([key])
    out = np.empty((1, BLOCK_BYTES), np.uint8)
    pool.read_many([pinned], out)
    assert pool.unpin([pinned]) == [True]
    return out[0]


def counted(worker, key):
    return sum(worker.stats.data.get(key, ()))


def expected_block(worker):
    return np.concatenate([layer[2].view(torch.uint8).numpy() for layer in worker.kv.layers])


def test_a_step_that_stalled_before_copying_writes_nothing_into_a_slot_it_lost(setup):
    worker, other = setup
    worker.begin_step(META)  # reserves the pool's last free slot for block 2
    time.sleep(LEASE_S + 0.1)  # the step stalls: its write lease runs out
    (ref,) = other.reserve([KEY])  # the only slot to be had: the lapsed reservation's
    assert ref is not None
    theirs = np.full(BLOCK_BYTES, 0x5A, np.uint8)
    assert other.publish([(ref, other.write(ref, theirs), BLOCK_BYTES)]) == [True]
    for name in LAYERS:
        worker.save_kv_layer(name)
    worker.wait_for_save(META)
    assert counted(worker, "stored_blocks") == 0 and counted(worker, "unstored_blocks") == 1
    assert np.array_equal(read(other, KEY), theirs)  # the other engine's block is untouched


def test_a_step_that_stalled_between_layers_keeps_its_slots(setup):
    worker, other = setup
    worker.begin_step(META)
    worker.save_kv_layer(LAYERS[0])  # fenced from its first copy until published
    time.sleep(LEASE_S + 0.1)
    assert other.reserve([KEY]) == [None]  # being written by a live writer
    assert other.reserve([hashlib.sha256(b"new").digest()]) == [None]  # and not up for reuse
    worker.save_kv_layer(LAYERS[1])
    worker.wait_for_save(META)
    assert counted(worker, "stored_blocks") == 1
    assert np.array_equal(read(other, KEY), expected_block(worker))
