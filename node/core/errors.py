"""The error of a setting that names it: which field, and why it is refused.

The configuration's and the policy's errors (:class:`ConfigError`, re-exported by
:mod:`cadenza.node.core.config`,
:class:`~cadenza.node.core.policy.PolicyError`) are :class:`FieldError`s, so a caller that
answers for another layer (an HTTP header, a CRD key) reads ``field`` and ``reason`` instead of
parsing the message.
"""

from __future__ import annotations


class FieldError(ValueError):
    """A refused setting.

    Attributes:
        field: the setting's name or dotted path (``token_budget``, ``classes.batch.weight``).
        reason: why it is refused (``must be >= 1, got 0``).

    The message is ``"{field}: {reason}"``.
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason

    def __reduce__(self):  # pickled and copied by its fields, not by its message
        return type(self), (self.field, self.reason)


class ConfigError(FieldError):
    """An invalid configuration value (``field``, ``reason``)."""
