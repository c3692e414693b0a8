"""The kernels compile for NVIDIA Ampere (sm_80) and Hopper (sm_90), checked without a GPU.

The interpreter runs the kernels on a CPU but never compiles them; this lowers each kernel —
with the tile rules the launchers use and the bf16 tensor-core path the interpreter cannot run —
to a cubin with Triton's bundled ptxas, and reads its shared memory and register spills.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # one compile of everything, ~45 s of CPU

SUPPORT = Path(__file__).resolve().parents[1] / "support"
SHARED_MEMORY_LIMIT = {"sm80": 163 * 1024, "sm90": 227 * 1024}  # bytes per block, A100 / H100


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path_factory.mktemp("triton-cache")), "PYTHONPATH": str(SUPPORT)}
    proc = subprocess.run([sys.executable, "-c", "import aot_compile; aot_compile.main()"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_kernel_compiles_for_ampere_and_hopper(compiled):
    errors = {name: r for name, r in compiled.items() if not isinstance(r, dict)}
    assert not errors, errors
    assert len(compiled) == 2 * 3 * 6 + 3 * 5


def test_shared_memory_fits_each_architecture(compiled):
    for name, r in compiled.items():
        limit = SHARED_MEMORY_LIMIT["sm80" if "sm80" in name else "sm90"]
        assert r["shared"] <= limit, f"{name} needs {r['shared']} bytes of shared memory"


def test_16_bit_attention_on_hopper_and_every_elementwise_kernel_never_spill(compiled):
    for name, r in compiled.items():
        if not name.startswith("attention") or ("sm90" in name and "fp32" not in name):
            assert r["stack"] == 0, f"{name} spills {r['stack']} bytes ({r['regs']} registers)"
