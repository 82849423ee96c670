import os
import signal
import sys

import pytest

from pd_plugins.testing.engine_harness import LIVE_SERVERS
from pd_plugins.testing.processes import LOG_ROOT_VAR

pytest_plugins = ["tests.tiers", "pytester"]  # the two test tiers; pytester checks them


def _stop_servers_and_exit(signum, frame):
    """A killed test run (CI timeout, Ctrl-C twice) still stops the servers it started."""
    for server in list(LIVE_SERVERS):
        server.stop(grace=2)
    sys.exit(128 + signum)


signal.signal(signal.SIGTERM, _stop_servers_and_exit)


@pytest.fixture(scope="session", autouse=True)
def server_logs_under_pytest_basetemp(tmp_path_factory):
    """Test servers log under pytest's temporary directory, which pytest prunes to the last three
    runs: a run no longer leaves a /tmp/pd-test-* directory per server behind for good."""
    with pytest.MonkeyPatch.context() as patch:
        if not os.environ.get(LOG_ROOT_VAR):
            patch.setenv(LOG_ROOT_VAR, str(tmp_path_factory.getbasetemp() / "servers"))
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """On failure, attach the tail of every live vLLM server's log to the report."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for server in list(LIVE_SERVERS):
            report.sections.append((f"log of {server.name} ({server.url})", server.log_tail(60)))
