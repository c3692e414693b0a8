"""``cadenza operator`` registers every kopf handler: importing :mod:`cadenza.operator.handlers`
imports each module that declares them."""

from __future__ import annotations

import argparse

import kopf

from cadenza.operator import cli, startup
from cadenza.operator.children import CHILD_KINDS


def test_the_operator_command_runs_kopf_with_every_handler_registered(monkeypatch):
    registered = {}

    def run(**kwargs):
        registry = kopf.get_default_registry()
        registered["activities"] = {(h.id, h.activity.value) for h in registry._activities.get_all_handlers()}
        registered["indexes"] = {h.id for h in registry._indexing.get_all_handlers()}
        registered["changes"] = {(h.id, h.reason and h.reason.value, h.initial)
                                 for h in registry._changing.get_all_handlers()}
        registered["run"] = kwargs

    monkeypatch.setattr(startup, "credentials_problem", lambda: None)
    monkeypatch.setattr(kopf, "run", run)
    assert cli.run_operator(argparse.Namespace(namespace=["prod"], liveness="none")) == 0
    assert {("login", "authentication"), ("configure", "startup"), ("start_resync", "startup"),
            ("stop_resync", "cleanup")} <= registered["activities"]
    assert registered["indexes"] == {f"children_{kind}" for kind in CHILD_KINDS} | {"pools"}
    assert registered["changes"] == {("reconcile", "create", None), ("reconcile", "update", None),
                                     ("reconcile", None, True)}  # create, update, resume
    assert registered["run"]["namespaces"] == ["prod"] and not registered["run"]["clusterwide"]
