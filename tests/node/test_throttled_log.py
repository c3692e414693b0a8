"""Lines peers can cause are throttled to one per kind a minute, and the next one counts the rest."""

from __future__ import annotations

import logging

from cadenza.node.kv_transfer.throttled_log import EVERY_S, ThrottledLog


def test_one_line_per_kind_a_minute_and_the_next_counts_those_held_back(caplog):
    now = [0.0]
    log = ThrottledLog(logging.getLogger("throttled"), clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="throttled"):
        for _ in range(5):
            log.warning("busy", "refused %s", "a")
        log.warning("unauthorized", "refused %s", "b")  # another kind has its own minute
        now[0] += EVERY_S
        log.warning("busy", "refused %s", "c")
    assert [r.getMessage() for r in caplog.records] == [
        "refused a", "refused b", "refused c (4 more since the last such line)"]
