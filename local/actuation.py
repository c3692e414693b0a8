"""Hybrid mode under ``cadenza up``: the in-place actuation (:mod:`cadenza.control.in_place`) over
local processes.

Replicas are the supervisor's processes (all started colocated, with a per-run admin token, and a
KV transfer endpoint when the pool's controller may move them into the prefill role); routing is
the gateway's config file — its ``interactive``, ``batch`` and ``prefill`` roles — rewritten
atomically and signalled with SIGHUP so the gateway re-reads it at once. The state lives in
memory and in the ``--state-file``.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable
from http.client import HTTPException

from cadenza.control.in_place import in_place_loop
from cadenza.control.loop import ControlLoop
from cadenza.control.roles import COLOCATED, ROUTES
from cadenza.control.replicas import AdminClient, Replica
from cadenza.pool.spec import Pool

GATEWAY_ROUTES = ("interactive", "batch", "prefill")  # the roles of the gateway's config file


class LocalBackend:
    """The replicas of a local pool and the gateway's routing file.

    Args:
        replicas: name -> URL of each replica process (ports survive restarts).
        gateway_url: where the gateway's ``/metrics`` is (the replicas' are at their URLs).
        write_routes: called with ``{"interactive": [urls], "batch": [urls], "prefill": [urls]}``.
    """

    def __init__(self, replicas: dict[str, str], gateway_url: str,
                 write_routes: Callable[[dict[str, list[str]]], None]) -> None:
        self._urls, self.gateway_url, self._write = dict(replicas), gateway_url, write_routes
        # cadenza up starts with every replica in both class routes (the gateway config it writes).
        self._routes = {name: ROUTES[COLOCATED] for name in replicas}
        self.roles = {name: COLOCATED for name in replicas}

    def replicas(self) -> list[Replica]:
        return [Replica(name, url, ready=True, routes=self._routes[name]) for name, url in self._urls.items()]

    def scrape(self) -> dict[str, str] | None:
        """The gateway's ``/metrics`` and every replica's that answers, by name; None without the gateway's."""
        gateway = _get(f"{self.gateway_url}/metrics")
        if gateway is None:
            return None
        texts = {"gateway": gateway}
        for name, url in self._urls.items():
            if (text := _get(f"{url}/metrics")) is not None:
                texts[name] = text
        return texts

    def route(self, replica: Replica, role: str, routes: frozenset[str]) -> None:
        self._routes[replica.name] = frozenset(routes)
        self.roles[replica.name] = role
        replica.routes = frozenset(routes)
        self._write_all()

    def unroute(self, name: str) -> None:
        """Stop routing to a replica whose process exited: restarted, it runs the spec's settings,
        not its role's, until the controller's next tick puts them back and routes it again."""
        if self._routes.get(name):
            self._routes[name] = frozenset()
            self._write_all()

    def _write_all(self) -> None:
        self._write({route: [self._urls[n] for n, routes in self._routes.items() if route in routes]
                     for route in GATEWAY_ROUTES})


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.read().decode()
    except (OSError, HTTPException, ValueError):  # ValueError: a bad URL
        return None


def local_loop(pool: Pool, replicas: dict[str, str], gateway_url: str,
               write_routes: Callable[[dict[str, list[str]]], None], token: str) -> ControlLoop:
    """The controller loop of a local ``mode: auto`` pool: every replica starts colocated, at the
    spec's knobs (the loop's actuation is in place over a :class:`LocalBackend`)."""
    started = {"roles": {name: COLOCATED for name in replicas}}
    return in_place_loop(pool, LocalBackend(replicas, gateway_url, write_routes), AdminClient(token), started)
