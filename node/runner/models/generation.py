"""Sampling defaults from a model folder's ``generation_config.json``.

A request that sets no ``temperature``, ``top_p`` or ``top_k`` gets the values the model's
authors ship, as vLLM does with ``--generation-config auto``; without the file (or the key),
the OpenAI defaults apply: temperature 1, top_p 1, no top-k. ``do_sample`` is not read: the
OpenAI API has no such switch (temperature 0 is greedy), and vLLM ignores it too. A value the
engine cannot use (a negative temperature, a top_p outside (0, 1]) is ignored with a warning
rather than failing the model. No torch here.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """What a request's unset sampling fields become.

    Attributes:
        temperature: >= 0 (0: greedy).
        top_p: in (0, 1].
        top_k: >= 0 (0: off).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "SamplingDefaults":
        """Read ``model_dir/generation_config.json``; the OpenAI defaults where it is silent.

        Raises:
            ValueError: the file exists but is not a JSON object.
        """
        path = Path(model_dir) / GENERATION_CONFIG
        if not path.is_file():
            return cls()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read {path}: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path} does not hold a JSON object")
        checks = {
            "temperature": lambda v: _number(v) and v >= 0,
            "top_p": lambda v: _number(v) and 0 < v <= 1,
            "top_k": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
        }
        values = {}
        for name, ok in checks.items():
            if name not in data:
                continue
            if ok(data[name]):
                values[name] = data[name]
            else:
                logger.warning("%s: ignoring %s=%r (out of range)", path, name, data[name])
        return cls(**values)

    def as_dict(self) -> dict[str, float]:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
