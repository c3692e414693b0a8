"""The policies ``cadenza sim --compare`` runs side by side: one ServingPool's replicas, hardware
and engine knobs under each way of scheduling them, on the same trace and cost model.

- ``prefill-first``: whole prompts first, decodes wait, no chunking (vLLM V0's default;
  :class:`~cadenza.sim.baselines.PrefillFirstScheduler`), every replica serving every class;
- ``chunked-fcfs``: chunked prefill with every request in one class (Sarathi-Serve);
- ``chunked-classes``: chunked prefill with the trace's traffic classes, decode reservation and
  fair queuing (cadenza's colocated mode);
- ``dedicated``: interactive-only replicas beside batch ones (``spec.dedicated.interactiveReplicas``,
  else half the pool), a static split;
- ``disaggregated``: prefill replicas (``spec.disaggregated.prefillReplicas``, default 1) computing
  long prompts for decode replicas, the KV moved over a link (:mod:`cadenza.sim.disagg`);
- ``auto``: cadenza's hybrid mode, its controller moving replicas and retuning knobs at run time.

Each is the pool document with its ``spec.mode`` (and, for the split, ``spec.dedicated``) set,
laid out by :func:`cadenza.sim.pool.fleet_layout` as ``cadenza up`` would run it; one that the
pool could not run that way is left out, and :func:`left_out` says why.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cadenza.node.core.scheduler import Scheduler
from cadenza.loadgen.trace import TraceRequest
from cadenza.sim.baselines import PrefillFirstScheduler
from cadenza.control.loop import ControlLoop
from cadenza.sim.client import ConcurrencyLimit
from cadenza.sim.control import Action, sim_controller
from cadenza.sim.disagg import KVLinkModel
from cadenza.sim.fleet import Fleet, FleetResult
from cadenza.sim.pool import FleetLayout, fleet_layout
from cadenza.sim.roofline import Roofline

POLICIES = ("prefill-first", "chunked-fcfs", "chunked-classes", "dedicated", "disaggregated", "auto")


@dataclass(frozen=True, slots=True)
class Policy:
    """One way of running the pool.

    Attributes:
        name: one of :data:`POLICIES`.
        layout: its replicas, roles, knobs and (``auto``) controller.
        scheduler_cls: the replicas' scheduler.
        one_class: send every request as ``interactive`` (the trace's classes ignored).
        link: the KV link of a ``disaggregated`` pool (None: :class:`KVLinkModel`'s default).
    """

    name: str
    layout: FleetLayout
    scheduler_cls: type[Scheduler] = Scheduler
    one_class: bool = False
    link: KVLinkModel | None = None


@dataclass(frozen=True, slots=True)
class PolicyRun:
    """A policy's run: the fleet's result, the fleet, and the control loop (``auto``; None otherwise)."""

    policy: str
    result: FleetResult
    fleet: Fleet
    controller: ControlLoop | None

    @property
    def actions(self) -> list[Action]:
        """The controller's decisions other than ``hold``, acted on or not (none without a controller)."""
        return self.controller.actuation.actions if self.controller else []

    @property
    def goodput_rps(self) -> float:
        """Requests per second within their class's SLO, over every class."""
        return sum(s.goodput_rps or 0.0 for s in self.result.by_class.values())

    @property
    def reshapes(self) -> int:
        return sum(1 for a in self.actions if a.acted and a.action == "reshape")


def _with_mode(pool: Mapping[str, Any], mode: str) -> dict:
    doc = copy.deepcopy(dict(pool))
    spec = doc["spec"]
    spec["mode"] = mode
    if mode == "dedicated":
        replicas = int(spec.get("replicas", 1))
        dedicated = dict(spec.get("dedicated") or {})
        dedicated.setdefault("interactiveReplicas", max(1, replicas // 2))
        spec["dedicated"] = dedicated
    return doc


def left_out(pool: Mapping[str, Any], name: str) -> str | None:
    """Why :func:`policies` leaves policy ``name`` out for ``pool`` (a validated ServingPool
    document), or None when it runs it: ``dedicated`` and ``disaggregated`` need two replicas to
    split."""
    if name in ("dedicated", "disaggregated") and int(pool["spec"].get("replicas", 1)) < 2:
        return "a pool of one replica has no split"
    return None


def policies(pool: Mapping[str, Any], roofline: Roofline, names: Sequence[str] = POLICIES,
             link: KVLinkModel | None = None) -> list[Policy]:
    """The named policies of ``pool`` (a validated ServingPool document), less those
    :func:`left_out` says it cannot run. ``link``: the KV link a disaggregated pool moves
    prompts over.

    Raises:
        ValueError: an unknown policy name, or a pool the engine refuses.
    """
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}: choose from {', '.join(POLICIES)}")
    out = []
    for name in names:
        if left_out(pool, name) is not None:
            continue
        if name in ("dedicated", "disaggregated"):
            out.append(Policy(name, fleet_layout(_with_mode(pool, name), roofline), link=link))
        elif name == "auto":
            out.append(Policy(name, fleet_layout(_with_mode(pool, "auto"), roofline)))
        else:
            layout = fleet_layout(_with_mode(pool, "colocated"), roofline)
            if name == "prefill-first":  # whole prompts: no chunk cap, a budget of the longest one
                configs = {n: dataclasses.replace(c, chunk_size=None, token_budget=max(c.token_budget, c.max_model_len))
                           for n, c in layout.configs.items()}
                out.append(Policy(name, dataclasses.replace(layout, configs=configs), PrefillFirstScheduler, True))
            else:
                out.append(Policy(name, layout, one_class=name == "chunked-fcfs"))
    return out


def run_policy(policy: Policy, trace: Sequence[TraceRequest], roofline: Roofline,
               on_done=None, client: ConcurrencyLimit | None = None, **controller_args: float) -> PolicyRun:
    """Replay ``trace`` under ``policy`` (``client``: what holds requests back before the gateway,
    :class:`~cadenza.sim.client.ConcurrencyLimit`; ``controller_args``:
    :func:`~cadenza.sim.control.sim_controller`'s interval and delays).

    Raises:
        RuntimeError: a replica stopped making progress.
    """
    layout = policy.layout
    fleet = Fleet(layout.roles, layout.configs, roofline, block_size=layout.block_size,
                  scheduler_cls=policy.scheduler_cls, num_blocks=layout.num_blocks, slo=layout.slo,
                  link=policy.link, min_prompt_tokens=layout.min_prompt_tokens)
    controller = None
    if layout.controller is not None:
        controller = sim_controller(layout.controller, fleet, **{"prefill_knobs": layout.prefill_knobs,
                                                                 **controller_args})
    classes = ["interactive"] * len(trace) if policy.one_class else None  # reported by the trace's all the same
    return PolicyRun(policy.name, fleet.run(trace, classes, on_done=on_done, client=client), fleet, controller)
