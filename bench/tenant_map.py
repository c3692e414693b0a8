"""What a large tenant map costs a replica: ``python -m bench.tenant_map [--tenants N] [--quick]``.

``cadenza serve`` with a tiny random Llama (its forward pass costs next to nothing, so the host
side shows) and an admin token. Two phases on the same server, interleaved over a few rounds:
short completions (4 prompt words, 4 tokens out, one at a time, from 64 tenants) with no tenant
configured, then the same after ``PUT /admin/config`` has configured N tenants (default: the most
the policy accepts, ``MAX_TENANTS``), each with both quotas; then they are removed again. While
a PUT runs, ``/health`` is polled every 20 ms; its slowest answer is reported. ``ratio``: median request latency with the
tenants over without (target ≤ 1.2: a tenant costs only while it has live requests). A tenant map
over the limit is refused with a 400 (printed, not timed). ``--quick``: one round of 10 requests
per phase. Last line JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.common import arguments, machine, quick_model, report, serving, tiny_random_llama
from cadenza.node.core.policy import MAX_TENANTS

TOKEN = "bench-tenant-map"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def latencies(session: aiohttp.ClientSession, base: str, n: int) -> list[float]:
    body = {"model": "tiny", "prompt": "one two three four", "max_tokens": 4, "temperature": 0}
    out = []
    for i in range(n):
        started = time.perf_counter()
        async with session.post(f"{base}/v1/completions", json=body,
                                headers={"x-cadenza-tenant": f"t{i % 64:05d}"}) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()
        out.append(time.perf_counter() - started)
    return out


async def configure(session: aiohttp.ClientSession, base: str, tenants: int) -> tuple[int, float, float]:
    """PUT ``tenants`` tenants; (status, seconds the PUT took, slowest /health meanwhile)."""
    doc = {"tenants": {f"t{i:05d}": {"weight": 1 + i % 3, "max_concurrent": 64, "max_queued_prompt_tokens": 1 << 20}
                       for i in range(tenants)}}
    slowest = 0.0
    done = asyncio.Event()

    async def poll() -> None:
        nonlocal slowest
        while not done.is_set():
            started = time.perf_counter()
            async with session.get(f"{base}/health") as resp:
                await resp.read()
            slowest = max(slowest, time.perf_counter() - started)
            await asyncio.sleep(0.02)

    poller = asyncio.create_task(poll())
    started = time.perf_counter()
    async with session.put(f"{base}/admin/config", json=doc, headers=AUTH) as resp:
        status = resp.status
        await resp.read()
    took = time.perf_counter() - started
    await asyncio.sleep(0.1)
    done.set()
    await poller
    return status, took, slowest


async def measure(base: str, tenants: int, requests: int, rounds: int) -> dict:
    """``rounds`` interleaved rounds (without, then with the tenants, which are then removed), so
    a change in the machine's load falls on both phases alike; medians over all requests."""
    timeout = aiohttp.ClientTimeout(total=600)
    without: list[float] = []
    with_tenants: list[float] = []
    puts = []
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await latencies(session, base, 8)  # warm up
        for _ in range(rounds):
            without += await latencies(session, base, requests)
            puts.append(await configure(session, base, tenants))
            if puts[-1][0] != 200:
                break
            with_tenants += await latencies(session, base, requests)
            async with session.put(f"{base}/admin/config", headers=AUTH,
                                   json={"tenants": {f"t{i:05d}": None for i in range(tenants)}}) as resp:
                assert resp.status == 200, await resp.text()
        over, _, _ = await configure(session, base, MAX_TENANTS + 1)
    return {"tenants": tenants, "put_status": puts[-1][0], "put_s": round(max(p[1] for p in puts), 3),
            "health_slowest_ms_during_put": round(1000 * max(p[2] for p in puts), 1),
            "request_ms_without": round(1000 * statistics.median(without), 2),
            "request_ms_with": round(1000 * statistics.median(with_tenants), 2) if with_tenants else None,
            "over_limit_put_status": over}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenants", type=int, default=MAX_TENANTS, help="tenants to configure (default: the limit)")
    parser.add_argument("--requests", type=int, default=50, help="timed requests per phase and round")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds")
    args = arguments(__doc__, parser)
    requests, rounds = (10, 1) if args.quick else (args.requests, args.rounds)
    with tempfile.TemporaryDirectory() as tmp:
        model = quick_model() if args.quick else tiny_random_llama(Path(tmp) / "tiny")
        os.environ["CADENZA_ADMIN_TOKEN"] = TOKEN
        with serving(["--model", str(model), "--served-model-name", "tiny", "--max-model-len", "256",
                      "--num-kv-blocks", "64"], Path(tmp) / "serve.log", quick=args.quick) as base:
            result = asyncio.run(measure(base, args.tenants, requests, rounds))
    with_ms = result["request_ms_with"]
    ratio = None if with_ms is None else round(with_ms / result["request_ms_without"], 3)
    report({"benchmark": "tenant_map", "ratio": ratio, "target": "<= 1.2", **result, **machine()}, quick=args.quick)

if __name__ == "__main__":
    main()
