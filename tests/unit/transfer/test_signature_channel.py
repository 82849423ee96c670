"""The worker -> scheduler result channel over real ZMQ ipc sockets."""

import threading
import time
import uuid

from pd_plugins.transfer.signature_channel import ResultReceiver, ResultSender, channel_address


def test_results_arrive_by_request_id_and_late_ones_are_waited_for():
    address = channel_address(f"engine-{uuid.uuid4().hex}")
    sender = ResultSender(address)  # a worker may connect before the scheduler binds
    receiver = ResultReceiver(address)
    try:
        sender.send({"r1": {"x": 1}, "r2": [1, 2]})
        assert receiver.take("r2", wait_s=2) == [1, 2]
        assert receiver.take("r1", wait_s=2) == {"x": 1}
        assert receiver.take("r1", wait_s=0.05) is None  # taken once
        threading.Timer(0.1, lambda: sender.send({"late": 7})).start()
        start = time.monotonic()
        assert receiver.take("late", wait_s=2) == 7
        assert time.monotonic() - start < 1.5
        assert receiver.take("never", wait_s=0.05) is None
    finally:
        sender.close()
        receiver.close()


def test_addresses_differ_per_engine_and_fit_a_socket_path():
    a, b = channel_address("prefill-1"), channel_address("prefill-2")
    assert a != b and len(a) < 100
