"""What the router charges a worker for a leg is exactly what it takes off again."""

import numpy as np

from pd_plugins.routers import accounting
from tests.unit.routers.helpers import context, request


def _histogram(hot: int) -> np.ndarray:
    h = np.zeros((2, 4))
    h[:, hot] = 10.0
    return h


def test_push_decode_removes_only_the_histogram_it_added():
    """Push + ELDR: the prefill reports the prompt's experts after the decode leg started.
    The decode's end must not take that histogram off the worker: it was never added, and
    removing it erased another request's footprint."""
    ctx = context(prefills=1, decodes=1)
    decode = ctx.pool.usable("decode")[0]
    pull = request(list(range(16)), expert_histogram=_histogram(0))
    pull_charge = accounting.decode_started(decode, pull)  # pull: the experts are known here
    push = request(list(range(100, 116)))
    push_charge = accounting.decode_started(decode, push)  # push: not yet
    push.expert_histogram = _histogram(3)                  # the prefill answers meanwhile
    accounting.decode_ended(decode, push, push_charge)
    assert decode.experts.count == 1
    np.testing.assert_array_equal(decode.experts.total, _histogram(0))
    accounting.decode_ended(decode, pull, pull_charge)
    assert decode.experts.count == 0 and decode.experts.total is None
    assert decode.in_flight == 0 and decode.in_flight_tokens == 0
