"""Operator tests: a short resync period, so the emulator tests see mode shifts finish quickly,
and ``api``: kmock's Kubernetes emulator, serving ServingPools, with a kubeconfig for it.

The period is set before :mod:`cadenza.operator.resync` is imported (it reads it then).
"""

import os

import pytest

os.environ.setdefault("CADENZA_OPERATOR_RESYNC_S", "1")

POOLS = "serving.cadenza.dev/v1alpha1/servingpools"


@pytest.fixture
def api(tmp_path, monkeypatch):
    import kmock
    import kubernetes
    from kube_emulator import KubeEmulator

    info = kmock.ResourceInfo(kind="ServingPool", singular="servingpool", namespaced=True, shortnames={"sp"},
                              verbs={"get", "list", "watch", "create", "patch", "delete"}, subresources={"status"})
    with KubeEmulator({POOLS: info}) as emulator:
        config = str(emulator.write_kubeconfig(tmp_path / "kubeconfig"))
        monkeypatch.setenv("KUBECONFIG", config)
        monkeypatch.delenv("CADENZA_OPERATOR_EVENTS", raising=False)  # Events on: the emulator names them
        kubernetes.config.load_kube_config(config_file=config)
        yield emulator


@pytest.fixture
def cluster(monkeypatch):
    """A fake cluster for the handlers (:class:`fake_cluster.FakeCluster`), with the operator's state."""
    from fake_cluster import FakeCluster

    return FakeCluster(monkeypatch)
