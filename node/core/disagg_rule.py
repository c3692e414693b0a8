"""The selective disaggregation rule of an engine: its step-time model and a KV link turned into
the coefficients of :class:`~cadenza.node.kv_transfer.threshold.Rule`.

Pure: the engine's KV link (:mod:`cadenza.node.engine.kv_link`) applies it to the bandwidth its
pulls measured, the simulator (:mod:`cadenza.sim.disagg`) to its modelled link; both get the same
rule from the same model.
"""

from __future__ import annotations

from cadenza.node.core.cost_model import StepCostModel
from cadenza.node.kv_transfer.threshold import FIXED_S, Rule

LOCAL_TOKENS = 1  # of a moved prompt, computed where it decodes: its last token (remote_kv)


def rule(cost: StepCostModel, bytes_per_token: int, link_bytes_per_s: float, local_tokens: int = LOCAL_TOKENS,
         fixed_s: float = FIXED_S) -> Rule | None:
    """The selective rule (:class:`~cadenza.node.kv_transfer.threshold.Rule`) of an engine with
    step-time model ``cost``, its prefill coefficients (seconds per token, per query-key pair)
    and the link's cost per token (``bytes_per_token`` KV bytes over ``link_bytes_per_s``); None
    before the model is calibrated.

    Raises:
        ValueError: a byte count or bandwidth that is not positive (:meth:`Rule.of_link`).
    """
    if not cost.ready:
        return None
    return Rule.of_link(max(0.0, float(cost.coef[1])), max(0.0, float(cost.coef[4])), bytes_per_token,
                        link_bytes_per_s, local_tokens, fixed_s)
