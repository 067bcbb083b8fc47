"""The soak test, short: outrider_tools.soak for about a minute with 64 concurrent clients against the bundled demo model
with its draft model loaded (the figures of a long run are in docs/reliability.md)."""

from __future__ import annotations

import pytest

from e2e_harness import ServerProcess
from outrider import demo
from outrider_tools import soak

pytestmark = pytest.mark.skipif(not demo.is_available(), reason="demo artifacts not installed")


@pytest.mark.slow
def test_64_clients_for_a_minute_leave_no_errors_no_leaks_and_flat_memory():
    server = ServerProcess(soak.SERVER_ARGS)
    try:
        report = soak.run(server.url, server.proc.pid, clients=64, duration_s=50, seed=1)
    finally:
        server.stop()
    assert report.drafter == "draft-simple"
    assert report.completed > 100 and report.invalid > 0 and report.disconnected > 0, report
    assert not report.errors, report.errors[:10]
    assert report.busy_slots_after == 0 and report.leaked_blocks == 0, report
    assert report.rss_growth < 0.05, report
