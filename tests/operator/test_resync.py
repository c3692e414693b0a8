"""The resync loop's pass over a pool: drift repaired, an invalid spec left quiet, the pool as it is now."""

from __future__ import annotations

import kopf
from fake_cluster import BODY


def test_the_resync_timer_recreates_a_child_deleted_by_hand_and_leaves_the_rest(cluster):
    cluster.run(BODY)
    cluster["existing"].discard(("Deployment", "chat-gateway"))  # kubectl delete deploy chat-gateway
    cluster["events"].clear()
    status = cluster.resync(BODY)
    assert cluster["events"] == [("Normal", "Created", "Deployment chat-gateway")]
    assert status["mode"] == "colocated"


def test_the_resync_timer_is_quiet_about_an_invalid_spec(cluster):
    bad = {**BODY, "spec": {**BODY["spec"], "engine": {"tokenBudget": 128, "chunkSize": 256}}}
    assert cluster.resync(bad) is None
    assert cluster["applied"] == [] and cluster["events"] == []


def test_a_resync_applies_the_pool_as_it_is_now_and_leaves_a_terminating_pool_alone(cluster, monkeypatch):
    """A pass copies every pool at its start; a reconcile of a newer spec may run before this
    pool's turn. The resync reads the pool again under its lock, so it never applies the old one."""
    cluster.run(BODY)
    newer = {**BODY, "spec": {**BODY["spec"], "replicas": 4}}
    cluster.operator.pools = {("prod", "chat"): [kopf.Body(newer)]}
    cluster.resync(BODY)  # the pass's older copy
    assert cluster["objects"][("Deployment", "chat-colocated")]["spec"]["replicas"] == 4
    cluster["applied"].clear()
    terminating = {**newer, "metadata": {**newer["metadata"], "deletionTimestamp": "2026-12-03T00:00:00Z"}}
    cluster.operator.pools = {("prod", "chat"): [kopf.Body(terminating)]}
    assert cluster.resync(BODY) is None and cluster["applied"] == []  # its children go with it: none made again

