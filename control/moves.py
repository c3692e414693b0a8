"""Rungs 2 and 3 of the SLO controller: which replica moves, and why.

:func:`~cadenza.control.decide.decide` calls these once it has decided to reshape; they pick the
move and give the sentence that justifies it, from the pool-wide figures of the interactive
class's slow window (:class:`~cadenza.control.signals.ClassWindow`).

- **Split** (interactive breaches, rung 1 exhausted), :func:`split`: the interference is from
  **long prompts** when prefill tokens are at least :data:`PREFILL_DOMINANT` of the tokens the
  engines computed (``prefill_share``) and at least :data:`LONG_PROMPTS` of the prompt tokens are in
  prompts the selective rule would move (``long_prompt_share``, prompts >= ``min_prompt_tokens``):
  then move one colocated replica into the ``prefill`` role (``disaggregate``), so those prompts
  leave the decode replicas' steps. Otherwise it is from **load** (queueing, KV, many short
  prompts): dedicate one colocated replica to interactive (``dedicate``). TTFT breaches count
  too: a prefill replica at its bulk budget also prefills interactive's own long prompts, which a
  small colocated budget starves (reading a TTFT-only breach as load measured worse in the
  simulator's day: docs/benchmarks.md, issue 31). A KV-bound breach is
  load (a prefill replica frees no decode memory); so is one with ``spec.controller.disaggregate``
  false. A figure that is unknown (None) means the interference cannot be attributed: dedicate,
  as before rung 3 existed, and say so.
- **Give back** (every class clear for the dwell), :func:`give_back`: undo a ``prefill`` replica
  first when the long prompts that justified it are gone (``long_prompt_share`` known and below
  ``LONG_PROMPTS x (1 - hysteresis)``); else an ``interactive`` one (``merge``); else a
  ``prefill`` one whose cause cannot be seen (share unknown). A prefill replica whose long prompts
  are still there is kept: given back, the interference it removed returns, and the pool cycles
  (disaggregate, clear for the dwell, aggregate, breach, disaggregate) at the cooldown's pace.
- **Never leave a class without a replica**, :func:`blocked`: a split takes a colocated replica;
  one stays while batch or background has (or may have) traffic, and interactive keeps a replica
  that decodes (colocated or interactive: a prefill replica only prefills).

Thresholds: :data:`PREFILL_DOMINANT` = 0.5, prefill is the larger part of the pool's computed
tokens, so prefill is what shares the decode steps; :data:`LONG_PROMPTS` = 0.3, about what one
replica of a three-replica pool prefills: a prefill replica with less would idle while the
decode replicas lost a replica.

Sources: DistServe (Zhong et al., OSDI 2024) and Splitwise (Patel et al., ISCA 2024) for
splitting the phases when prefill interferes with decode; Arrow (arXiv 2505.11916), TokenScale
(2512.03416) and HyGen (2501.14808) for reshaping a pool at run time as its prompt lengths and
load shift. Pure: no clock, no I/O.
"""

from __future__ import annotations

from cadenza.control.history import AGGREGATE, DEDICATE, DISAGGREGATE, MERGE
from cadenza.control.signals import ClassWindow, Signals

PREFILL_DOMINANT = 0.5  # prefill share (0-1) of the computed tokens at which prefill dominates the steps
LONG_PROMPTS = 0.3  # long-prompt share (0-1) of the prompt tokens worth a prefill replica


def split(window: ClassWindow, kv_bound: bool, disaggregate: bool) -> tuple[str, str]:
    """The split that answers an interactive breach rung 1 could not hold, and why.

    Args:
        window: interactive's slow window (its pool-wide ``prefill_share``, ``long_prompt_share``
            and ``min_prompt_tokens``; None when unknown).
        kv_bound: the breach is KV-bound (the fullest engine's KV full while interactive queues).
        disaggregate: rung 3 is allowed (``spec.controller.disaggregate``).

    Returns:
        ``(move, why)``: ``disaggregate`` or ``dedicate``, and a clause with the figures.
    """
    dedicate = "dedicating one replica to interactive"
    if kv_bound:
        return DEDICATE, f"interference from load (KV full: a prefill replica frees no decode memory): {dedicate}"
    unknown = [name for name, value in (("prefill share", window.prefill_share),
                                        ("long-prompt share", window.long_prompt_share),
                                        ("selective threshold", window.min_prompt_tokens)) if value is None]
    if unknown:
        return DEDICATE, f"the interference could not be attributed ({', '.join(unknown)} unknown): {dedicate}"
    figures = (f"prefill {window.prefill_share:.0%} of computed tokens, {window.long_prompt_share:.0%} of prompt "
               f"tokens in prompts >= {window.min_prompt_tokens:.0f} tokens")
    if window.prefill_share >= PREFILL_DOMINANT and window.long_prompt_share >= LONG_PROMPTS:
        if not disaggregate:
            return DEDICATE, (f"prefill interference from long prompts ({figures}), but "
                              f"spec.controller.disaggregate is false: {dedicate}")
        return DISAGGREGATE, (f"prefill interference from long prompts ({figures}; at least {PREFILL_DOMINANT:.0%} "
                              f"and {LONG_PROMPTS:.0%}): moving one colocated replica to prefill")
    load = window.load()
    return DEDICATE, (f"interference from load ({load + '; ' if load else ''}{figures}; under "
                      f"{PREFILL_DOMINANT:.0%} or {LONG_PROMPTS:.0%}): {dedicate}")


def give_back(shape, window: ClassWindow | None, hysteresis: float) -> tuple[str | None, str]:
    """Which split to undo when every class has been clear for the dwell, and why.

    Args:
        shape: the pool's :class:`~cadenza.control.decide.Shape` (replicas per role), with an
            interactive or a prefill replica.
        window: interactive's slow window (its ``long_prompt_share``), or None.
        hysteresis: ``spec.controller.hysteresis`` (0-1).

    Returns:
        ``(move, why)``: ``aggregate`` or ``merge``, or None to keep the shape (its only split is
        prefill replicas whose long prompts are still there), and a clause with the figures.

    Raises:
        ValueError: a shape with nothing to give back.
    """
    share = None if window is None else window.long_prompt_share
    if shape.prefill and (gone := _long_prompts_gone(window, hysteresis)) is not None:
        return AGGREGATE, gone
    if shape.interactive:
        return MERGE, "giving one interactive replica back to colocated"
    if shape.prefill and share is None:
        return AGGREGATE, "long-prompt share unknown: giving one prefill replica back to colocated"
    if shape.prefill:
        return None, (f"{share:.0%} of prompt tokens still in long prompts (not under "
                      f"{LONG_PROMPTS * (1 - hysteresis):.0%}): keeping the prefill replica")
    raise ValueError(f"nothing to give back in {shape}")


def idle_prefill(shape, window: ClassWindow | None, hysteresis: float) -> str | None:
    """Why a prefill replica should come back to decoding while interactive breaches from load
    and no split may be made (None: it should not).

    A prefill replica whose long prompts are gone (``long_prompt_share`` known and under
    ``LONG_PROMPTS x (1 - hysteresis)``) prefills little while the decode replicas are overloaded;
    given back to colocated, it serves. Without this, a (1, 0, 1) pool breaching from load would
    hold for ever: dedicating its last colocated replica is blocked, and a give-back waits for
    every class to be clear.
    """
    return _long_prompts_gone(window, hysteresis) if shape.prefill else None


def _long_prompts_gone(window: ClassWindow | None, hysteresis: float) -> str | None:
    """Why a prefill replica may come back, its long prompts gone (``long_prompt_share`` known and
    under ``LONG_PROMPTS x (1 - hysteresis)``); None while they stay or cannot be seen."""
    share = None if window is None else window.long_prompt_share
    below = LONG_PROMPTS * (1 - hysteresis)
    if share is None or share >= below:
        return None
    return f"{share:.0%} of prompt tokens in long prompts, under {below:.0%}: giving one prefill replica back to colocated"


def blocked(shape, move: str, signals: Signals) -> str | None:
    """Why the split ``move`` would leave a class without a replica (None: it may be made);
    ``shape`` is the pool's :class:`~cadenza.control.decide.Shape`.

    A split takes one colocated replica: another stays, or batch and background are known to have
    no traffic in the slow window; and for ``disaggregate``, interactive keeps a replica that
    decodes (a colocated or an interactive one).
    """
    if shape.colocated < 1:
        return "no colocated replica is left to move"
    if shape.colocated < 2 and not all(_idle(signals.slow.get(cls)) for cls in ("batch", "background")):
        return "the last colocated replica serves batch/background"
    if move == DISAGGREGATE and shape.colocated - 1 + shape.interactive < 1:
        return "interactive would have no replica that decodes"
    return None


def _idle(window: ClassWindow | None) -> bool:
    return window is not None and window.known and window.requests == 0
