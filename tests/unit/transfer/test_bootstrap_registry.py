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
