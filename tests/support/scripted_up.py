"""``cadenza up`` whose controller makes scripted decisions: for end-to-end tests of the in-place
actuation with real replicas and a real gateway, where driving the real signals to each breach is
the benchmarks' job, not a test's.

Run in a child process as ``python -c "import scripted_up; scripted_up.main()" up POOL.yaml ...``
(``tests/support`` on ``PYTHONPATH``) with ``$CADENZA_TEST_DECISIONS`` naming a JSON file: a list of
steps the test appends to while the pool runs, each ``{"action": "retune", "knobs": {...}}`` or
``{"action": "reshape", "move": "disaggregate"}``. The controller's loop takes the next step not
yet taken whenever it decides (never during a move in progress, as with the real ``decide()``),
and holds when there is none; everything else — the supervisor, the in-place actuation, the state
file — is ``cadenza up``'s own.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

SCRIPT_ENV = "CADENZA_TEST_DECISIONS"


def scripted_decide(path: Path):
    """A ``decide()`` that returns the steps of the JSON list at ``path`` one per call, then holds."""
    from cadenza.control.decide import Decision

    taken = 0

    def decide(signals, shape, knobs, history, spec, now):
        nonlocal taken
        try:
            steps = json.loads(path.read_text())
        except (OSError, ValueError):
            steps = []
        if taken >= len(steps):
            return Decision("hold", "scripted: holding", False, history)
        step, taken = steps[taken], taken + 1
        reason = f"scripted step {taken}: {step.get('move') or step['action']}"
        return Decision(step["action"], reason, True, replace(history, last_action=now), knobs=step.get("knobs"),
                        move=step.get("move"))

    return decide


def main() -> None:
    import cadenza.control.loop as loop
    from cadenza.node.cli import main as cadenza

    loop.decide = scripted_decide(Path(os.environ[SCRIPT_ENV]))
    sys.exit(cadenza(sys.argv[1:]))
