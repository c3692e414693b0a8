"""A step-time cost model, calibrated online: the decode reservation expressed in time.

A step's duration is modelled as linear in its composition (as in Sarathi-Serve's and
DistServe's latency models)::

    t = c0 + c_p * prefill_tokens + c_d * decode_tokens
           + c_dc * decode_context_tokens + c_pa * prefill_attention_tokens

where ``decode_context_tokens`` sums the sequence lengths the decode rows attend to and
``prefill_attention_tokens`` sums ``n * (start + n/2)`` over prefill chunks (query-key pairs of
causal chunks over their cached prefix). Coefficients are fitted by ridge-regularised least
squares (numpy) over a window of recent steps and clipped at zero; every prediction made before
a step is compared with the measured time, and the mean absolute relative error over the window
is reported. No torch here.
"""

from __future__ import annotations

import math
from collections import deque
from typing import NamedTuple

import numpy as np

_MIN_OBSERVATIONS = 8


class StepFeatures(NamedTuple):
    """A step's composition (tokens)."""

    prefill_tokens: int
    decode_tokens: int
    decode_context_tokens: int
    prefill_attention_tokens: float

    def vector(self) -> list[float]:
        return [1.0, self.prefill_tokens, self.decode_tokens, self.decode_context_tokens, self.prefill_attention_tokens]


class StepCostModel:
    """Predicts step time in seconds from :class:`StepFeatures`; learns from measured steps.

    Args:
        window: recent steps the fit uses.
        refit_every: steps between refits.
    """

    def __init__(self, window: int = 256, refit_every: int = 8) -> None:
        # a ring of the last ``window`` steps, kept as arrays (the fit reads them without copying)
        self._x = np.zeros((window, 5))
        self._y = np.zeros(window)
        self._n = self._next = 0
        self._errors: deque[float] = deque(maxlen=window)
        self._refit_every = refit_every
        self._since_fit = 0
        self.coef: np.ndarray | None = None

    @property
    def ready(self) -> bool:
        """Calibrated on enough steps, with a positive cost per prefill token."""
        return self.coef is not None and self.coef[1] > 0

    def predict(self, features: StepFeatures) -> float | None:
        """Predicted seconds, or None before calibration."""
        if self.coef is None:
            return None
        return float(np.dot(self.coef, features.vector()))

    def observe(self, features: StepFeatures, seconds: float) -> None:
        """Record a measured step (its error against the prediction first), refitting now and then."""
        predicted = self.predict(features)
        if predicted is not None and seconds > 0:
            self._errors.append(abs(predicted - seconds) / seconds)
        i = self._next
        self._x[i] = features.vector()
        self._y[i] = seconds
        self._next = (i + 1) % len(self._y)
        self._n = min(self._n + 1, len(self._y))
        self._since_fit += 1
        if self._n >= _MIN_OBSERVATIONS and (self.coef is None or self._since_fit >= self._refit_every):
            self._fit()

    def _fit(self) -> None:
        x, y = self._x[:self._n], self._y[:self._n]
        scale = np.maximum(np.abs(x).max(axis=0), 1e-12)  # columns to comparable magnitudes
        xs = x / scale
        ridge = 1e-6 * len(y)
        coef = np.linalg.solve(xs.T @ xs + ridge * np.eye(xs.shape[1]), xs.T @ y) / scale
        self.coef = np.clip(coef, 0.0, None)
        self._since_fit = 0

    @property
    def mean_relative_error(self) -> float | None:
        """Mean |predicted − measured| / measured over the window (None before any prediction)."""
        return float(np.mean(self._errors)) if self._errors else None

    def max_chunk(self, seconds_left: float, context: int) -> int:
        """Most prefill tokens of one chunk starting at ``context`` that fit ``seconds_left``.

        Solves ``c_p n + c_pa n (context + n/2) <= seconds_left`` for ``n``.
        """
        if not self.ready or not seconds_left > 0:
            return 0
        if not math.isfinite(seconds_left):
            return 1 << 30
        c_p, c_pa = float(self.coef[1]), float(self.coef[4])
        if c_pa <= 0:
            return int(seconds_left / c_p)
        b = c_p + c_pa * context  # (c_pa / 2) n^2 + b n - seconds_left = 0
        a = c_pa / 2
        return int((-b + math.sqrt(b * b + 4 * a * seconds_left)) / (2 * a))

    def chunk_cost(self, n: int, context: int) -> float:
        """Predicted seconds one prefill chunk adds to a step."""
        if self.coef is None:
            return 0.0
        return float(self.coef[1] * n + self.coef[4] * n * (context + n / 2))
