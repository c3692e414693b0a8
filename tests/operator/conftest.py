"""Operator tests: a short resync period, so the emulator tests see mode shifts finish quickly.

Set before :mod:`cadenza.operator.handlers` is imported (its kopf timer reads it then).
"""

import os

os.environ.setdefault("CADENZA_OPERATOR_RESYNC_S", "1")
