"""The access-log tally the three-node test counts Prefect API requests with (tests/api_log.py),
on a log written the way uvicorn writes it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.api_log import POLL_S, ApiLogTally

pytestmark = pytest.mark.timeout(30)

RUN = "0b6f2d4e-1c3a-4b5d-8e9f-0a1b2c3d4e5f"


def test_requests_are_counted_by_route_with_their_peak(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text('INFO:     127.0.0.1:1 - "GET /api/health HTTP/1.1" 200 OK\n')  # before
    with ApiLogTally(log) as tally:
        start = time.monotonic()
        with log.open("a") as file:
            for _ in range(3):
                file.write(
                    f'INFO:     127.0.0.1:2 - "POST /api/flow_runs/{RUN}/set_state HTTP/1.1" 201 Created\n'
                )
            file.write('INFO:     127.0.0.1:3 - "POST /api/flow_runs/filter?x=1 HTTP/1.1" 200 OK\n')
            file.write('INFO:     127.0.0.1:4 - "WebSocket /api/events/in" [accepted]\n')
            file.write(
                'INFO:     127.0.0.1:5 - "GET /api/work_pools/hsx-gpu HTTP/1.1" 2'
            )  # unfinished
            file.flush()
        time.sleep(3 * POLL_S)
        window = tally.window(start, time.monotonic())
    assert window.requests == 4 and window.websockets == 1
    assert window.by_path == {
        "POST /api/flow_runs/{id}/set_state": 3,
        "POST /api/flow_runs/filter": 1,
    }
    assert window.peak_per_s == 4 and window.mean_per_s > 0
    assert tally.window(start - 100, start - 50).requests == 0
