"""Request text must be UTF-8: a JSON body may escape a lone surrogate (``"\\ud800"``), which
Python decodes into a ``str`` that no tokenizer, template or response encoder accepts. Refused
where it is read, with the field named. Pure.
"""

from __future__ import annotations

import json
from typing import Any


def check_utf8(text: str, what: str) -> str:
    """``text``, refused if it cannot be UTF-8.

    Raises:
        ValueError: naming ``what`` (pydantic turns it into a 400 at the field).
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not valid Unicode (it holds a lone surrogate)") from None
    return text


def check_utf8_json(value: Any, what: str) -> Any:
    """``value`` (JSON data: keys and strings at any depth), refused as :func:`check_utf8` does."""
    check_utf8(json.dumps(value, ensure_ascii=False), what)
    return value
