"""Sizing torch's intra-op threads from what the process may really use."""

from __future__ import annotations

import pytest

from cadenza.node.runner.threads import cgroup_cpu_quota, choose_threads


def reader(files: dict[str, str]):
    return files.get


V2_POD = {  # a Kubernetes pod with limits.cpu: 1500m, on cgroup v2
    "/proc/self/cgroup": "0::/kubepods/burstable/pod1/ctr\n",
    "/sys/fs/cgroup/kubepods/burstable/pod1/ctr/cpu.max": "max 100000\n",
    "/sys/fs/cgroup/kubepods/burstable/pod1/cpu.max": "150000 100000\n",
    "/sys/fs/cgroup/kubepods/cpu.max": "max 100000\n",
}
V1_POD = {
    "/proc/self/cgroup": "12:cpu,cpuacct:/kubepods/pod2\n4:memory:/kubepods/pod2\n",
    "/sys/fs/cgroup/cpu,cpuacct/kubepods/pod2/cpu.cfs_quota_us": "200000\n",
    "/sys/fs/cgroup/cpu,cpuacct/kubepods/pod2/cpu.cfs_period_us": "100000\n",
}
UNLIMITED = {"/proc/self/cgroup": "0::/user.slice\n", "/sys/fs/cgroup/user.slice/cpu.max": "max 100000\n"}


@pytest.mark.parametrize(("files", "quota"), [(V2_POD, 1.5), (V1_POD, 2.0), (UNLIMITED, None), ({}, None),
                                              ({"/proc/self/cgroup": "1:cpu:/\n",
                                                "/sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1\n",
                                                "/sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n"}, None),
                                              ({"/proc/self/cgroup": "0::/\n", "/sys/fs/cgroup/cpu.max": "garbage"},
                                               None)])
def test_the_cgroup_quota_is_read_from_v2_cpu_max_or_v1_cfs_files(files, quota):
    assert cgroup_cpu_quota(reader(files)) == quota


def test_a_pod_limited_to_1500m_on_a_64_core_node_gets_one_thread_not_64():
    choice = choose_threads(environ={}, affinity=64, read=reader(V2_POD))
    assert choice.threads == 1 and "quota 1.5" in choice.reason


def test_affinity_bounds_threads_when_the_quota_is_larger_or_absent():
    assert choose_threads(environ={}, affinity=2, read=reader(V1_POD)).threads == 2
    assert choose_threads(environ={}, affinity=3, read=reader(UNLIMITED)).threads == 3


def test_threads_option_then_omp_num_threads_win():
    assert choose_threads(4, environ={"OMP_NUM_THREADS": "2"}, affinity=1).threads == 4
    assert choose_threads(environ={"OMP_NUM_THREADS": "3"}, affinity=64, read=reader(V2_POD)) == (3, "OMP_NUM_THREADS")
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="threads"):
            choose_threads(bad)
    with pytest.raises(ValueError, match="OMP_NUM_THREADS"):
        choose_threads(environ={"OMP_NUM_THREADS": "lots"})
