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


def test_sockets_live_in_a_private_directory_and_oversized_messages_are_dropped(tmp_path,
                                                                              monkeypatch):
    """Another local user can neither squat the path nor connect (the directory is 0700 and
    ours); a message over MAX_MESSAGE_BYTES is dropped and the channel keeps working."""
    import os
    import stat

    import zmq

    from pd_plugins.transfer import signature_channel

    monkeypatch.setenv("PD_PRIVATE_DIR", str(tmp_path / "private"))
    address = channel_address(f"engine-{uuid.uuid4().hex}")
    directory = os.path.dirname(address.removeprefix("ipc://"))
    assert directory == str(tmp_path / "private")
    info = os.stat(directory)
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()
    receiver = ResultReceiver(address)
    big = zmq.Context.instance().socket(zmq.PUSH)
    big.setsockopt(zmq.LINGER, 0)
    big.connect(address)
    sender = ResultSender(address)
    try:
        big.send(b"\x81\xa1x" + b"\x00" * (signature_channel.MAX_MESSAGE_BYTES + 1))
        sender.send({"r1": 1})
        assert receiver.take("r1", wait_s=2) == 1
    finally:
        big.close()
        sender.close()
        receiver.close()
