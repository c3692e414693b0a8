"""The benchmarks that start ``cadenza serve`` or ``cadenza up`` processes, each in its quick mode as
a user runs it (see ``test_quick.py`` for the others): slow, 10-70 s each; the longest
(``bench_scripts.LONG``) run only with ``--long-benchmarks`` (``make test-long``, run by CI)."""

from __future__ import annotations

import pytest

from bench_scripts import STARTS_SERVERS, benchmarks, check_quick_run, params


@pytest.mark.slow
@pytest.mark.parametrize("name", params([name for name in benchmarks() if name in STARTS_SERVERS]))
def test_quick_mode_runs(name, tmp_path):
    check_quick_run(name, tmp_path, timeout_s=480)
