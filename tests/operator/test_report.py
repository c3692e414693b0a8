"""What the operator reports about a pool: its status merge patch."""

from __future__ import annotations

from cadenza.operator import report


def test_a_status_patch_is_a_noop_only_when_every_key_it_sets_or_deletes_already_is_so():
    live = {"mode": "colocated", "roles": {"colocated": {"replicas": 2}}, "conditions": [{"type": "Ready"}]}
    assert report.patch_is_noop(live, {"mode": "colocated", "roles": {"colocated": {"replicas": 2}}, "gone": None})
    assert not report.patch_is_noop(live, {"roles": {"colocated": None}})  # removes a key that is there
    assert not report.patch_is_noop(live, {"roles": {"colocated": {"replicas": 3}}})
    assert not report.patch_is_noop(live, {"conditions": []}) and not report.patch_is_noop({}, {"mode": "colocated"})
