import json
import urllib.request

import pytest

from pd_plugins.testing.processes import free_port
from pd_plugins.transfer import bootstrap_registry as br


@pytest.fixture
def registry():
    server = br.BootstrapRegistry("127.0.0.1", free_port())
    yield f"127.0.0.1:{server.port}"
    server.close()


def test_register_and_look_up(registry):
    assert br.is_alive(registry)
    assert br.lookup(registry, br.rank_key(0, 1)) is None
    br.register(registry, br.rank_key(0, 1), {"pool_id": "abc", "scope": "s"})
    assert br.lookup(registry, "0.1") == {"pool_id": "abc", "scope": "s"}


def test_rooms_come_and_go(registry):
    key = br.room_key(2**62 + 5, br.rank_key(0, 0))
    assert br.get_room(registry, key) is None
    br.put_room(registry, key, {"pages": [1, 2]})
    assert br.get_room(registry, key) == {"pages": [1, 2]}
    br.drop_room(registry, key)
    assert br.get_room(registry, key) is None


@pytest.mark.parametrize("path,body,status", [
    ("/ranks/0.0", b"[1, 2]", 400),          # not an object
    ("/ranks/0.0", b"{not json", 400),
    ("/ranks/x.y", b"{}", 404),               # not a rank key
    ("/ranks/0.0", b"", 400),                 # empty
    ("/rooms/0.0", b"{}", 404),               # a room key has three parts
    ("/ranks/5.0.0", b"{}", 404),             # a rank key has two
])
def test_bad_records_get_a_4xx(registry, path, body, status):
    request = urllib.request.Request(f"http://{registry}{path}", data=body, method="PUT")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=5)
    assert err.value.code == status and "error" in json.loads(err.value.read())


def test_an_absent_registry_is_unreachable():
    addr = f"127.0.0.1:{free_port()}"
    assert not br.is_alive(addr, timeout_s=0.5)
    with pytest.raises(br.RegistryUnreachable, match="unreachable"):
        br.lookup(addr, "0.0", timeout_s=0.5)


def test_a_target_is_claimed_once_and_then_cannot_be_withdrawn(registry):
    """Push: the decode's pages belong to whichever side the registry says: a claimed target is
    the prefill's to write (the decode keeps its pages), a withdrawn one is the decode's again."""
    key = br.room_key(7, "0.0")
    assert br.target_action(registry, key, "claim")[0] == 404  # not published yet
    assert br.put_target(registry, key, {"pages": [4, 5]})
    status, record = br.target_action(registry, key, "claim")
    assert (status, record) == (200, {"pages": [4, 5]})
    assert br.target_action(registry, key, "claim")[0] == 409  # one writer only
    status, answer = br.target_action(registry, key, "withdraw")
    assert status == 409 and answer["claimed_at"] > 0  # a write may be under way: keep the pages
    assert br.target_action(registry, key, "expire")[0] == 409
    br.drop_target(registry, key)
    assert br.target_action(registry, key, "claim")[0] == 404


def test_a_withdrawn_target_cannot_be_claimed(registry):
    key = br.room_key(8, "0.0")
    assert br.put_target(registry, key, {"pages": [1]})
    assert br.target_action(registry, key, "withdraw")[0] == 200
    status, answer = br.target_action(registry, key, "claim")
    assert status == 409 and "withdrawn" in answer["error"]


def test_an_expired_room_refuses_a_late_target(registry):
    """The prefill gave up (its lease ran out) before the decode published: the decode learns it
    when it publishes, instead of waiting for a write that will never come."""
    key = br.room_key(9, "0.0")
    assert br.target_action(registry, key, "expire")[0] == 200
    assert not br.put_target(registry, key, {"pages": [1]})
    assert br.target_action(registry, key, "claim")[0] == 409
    other = br.room_key(10, "0.0")
    assert br.put_target(registry, other, {"pages": [1]})
    assert br.target_action(registry, other, "expire")[0] == 200  # open, not claimed: expired
    assert br.target_action(registry, other, "claim")[0] == 409


@pytest.mark.parametrize("method,path", [
    ("POST", "/targets/1.0.0/steal"),   # not an action
    ("POST", "/rooms/1.0.0/claim"),     # actions are for targets only
    ("POST", "/targets/1.0.0"),         # no action
])
def test_bad_target_calls_get_a_404(registry, method, path):
    request = urllib.request.Request(f"http://{registry}{path}", data=b"", method=method)
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=5)
    assert err.value.code == 404
