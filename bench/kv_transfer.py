"""KV transfer throughput on loopback against a plain socket copy: ``python -m bench.kv_transfer``.

A producer process holds requests of SmolLM2-135M-Instruct's KV layout (30 layers, 3 KV heads,
head dim 64, 16-token blocks, bf16: 368,640 bytes a block) of 2,048 prompt tokens each (128
blocks, 45 MiB). This process pulls them with :class:`~cadenza.node.kv_transfer.consumer.KVConsumer`:
msgpack headers, CRC32C per frame on both sides, lease bookkeeping. Side by side, interleaved
round by round, the same producer process sends the same bytes in the same frame sizes over a plain
asyncio stream (no header, no checksum), read the same way (``readexactly`` per frame). Both sides
run one process each on their own core (2 cores here). The producer's block reader returns views
of one buffer in both runs: the engine's gather of blocks from its KV cache is not in this figure.

Target (issue 14): KV transfer >= 80 % of the plain copy's throughput. Last line JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import time

from bench.common import machine, report
from cadenza.node.kv_transfer.consumer import KVConsumer
from cadenza.node.kv_transfer.producer import MAX_FRAME_BLOCKS, KVProducer
from cadenza.node.kv_transfer.protocol import Fingerprint

SMOLLM2 = Fingerprint("SmolLM2-135M-Instruct", "bfloat16", block_size=16, num_layers=30, num_kv_heads=3, head_dim=64)
PROMPT_TOKENS = 2048


def _pin(cpu: int) -> None:
    if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) > 1:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[cpu % len(os.sched_getaffinity(0))]})


def _producer(ports: mp.Queue, requests: int, blocks: int) -> None:
    """The producer process: every request published and complete, plus a plain byte server."""
    _pin(1)
    block = SMOLLM2.num_layers * SMOLLM2.block_layer_bytes
    data = memoryview(os.urandom(block * blocks))

    def read(first: int, count: int) -> memoryview:
        return data[first * block:(first + count) * block]

    async def plain(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.readexactly(1):  # one request's frames per byte asked
            for first in range(0, blocks, MAX_FRAME_BLOCKS):
                writer.write(read(first, min(MAX_FRAME_BLOCKS, blocks - first)))
                await writer.drain()

    async def main() -> None:
        producer = KVProducer(SMOLLM2, lease_s=3600)
        for i in range(requests):
            producer.publish(f"r{i}", read, lambda: None)
            producer.progress(f"r{i}", blocks, complete=True)
        port = await producer.start()
        server = await asyncio.start_server(plain, "127.0.0.1", 0)
        ports.put((port, server.sockets[0].getsockname()[1]))
        await asyncio.Event().wait()

    asyncio.run(main())


async def _measure(port: int, plain_port: int, rounds: int, per_round: int, blocks: int) -> dict:
    block = SMOLLM2.num_layers * SMOLLM2.block_layer_bytes
    nbytes = per_round * blocks * block
    consumer = KVConsumer(SMOLLM2)
    reader, writer = await asyncio.open_connection("127.0.0.1", plain_port)
    frames = [min(MAX_FRAME_BLOCKS, blocks - f) * block for f in range(0, blocks, MAX_FRAME_BLOCKS)]
    kv, raw, n = [], [], 0

    async def pull_round() -> float:
        nonlocal n
        started, got = time.perf_counter(), 0
        for _ in range(per_round):
            async for frame in consumer.pull("127.0.0.1", port, f"r{n}"):
                got += len(frame.payload)
            n += 1
        assert got == nbytes
        return nbytes / (time.perf_counter() - started)

    async def plain_round() -> float:
        started = time.perf_counter()
        for _ in range(per_round):
            writer.write(b"x")
            for size in frames:
                await reader.readexactly(size)
        return nbytes / (time.perf_counter() - started)

    await pull_round(), await plain_round()  # warm-up: connections, buffers
    for r in range(rounds):
        order = (pull_round, plain_round) if r % 2 == 0 else (plain_round, pull_round)
        for f in order:
            (kv if f is pull_round else raw).append(await f())
    writer.close()
    await consumer.close()
    return {"kv": kv, "plain": raw}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--per-round", type=int, default=12, help="requests pulled per round")
    a = p.parse_args()
    blocks = PROMPT_TOKENS // SMOLLM2.block_size
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    proc = ctx.Process(target=_producer, args=(ports, (a.rounds + 1) * a.per_round, blocks), daemon=True)
    proc.start()
    try:
        port, plain_port = ports.get(timeout=60)
        _pin(0)
        rates = asyncio.run(_measure(port, plain_port, a.rounds, a.per_round, blocks))
    finally:
        proc.terminate()
    kv, plain = statistics.median(rates["kv"]), statistics.median(rates["plain"])
    per_round = [round(k / r, 3) for k, r in zip(rates["kv"], rates["plain"], strict=True)]
    mib = blocks * SMOLLM2.num_layers * SMOLLM2.block_layer_bytes / 2**20
    print(f"{a.rounds} rounds of {a.per_round} x {PROMPT_TOKENS}-token prompts ({mib:.0f} MiB each)")
    print(f"KV transfer {kv / 1e9:.2f} GB/s, plain socket copy {plain / 1e9:.2f} GB/s (medians); "
          f"ratio per round {per_round}")
    report({"benchmark": "kv_transfer", "ratio": round(kv / plain, 3), "target": 0.8,
            "kv_gb_s": round(kv / 1e9, 3), "plain_gb_s": round(plain / 1e9, 3), "ratio_per_round": per_round,
            "bytes_per_prompt": blocks * SMOLLM2.num_layers * SMOLLM2.block_layer_bytes,
            "bytes_per_token": SMOLLM2.bytes_per_token, "frame_blocks": MAX_FRAME_BLOCKS,
            "prefix_caching": False, "prefix_cache_hit_rate": 0.0, "machine": machine()})


if __name__ == "__main__":
    main()
