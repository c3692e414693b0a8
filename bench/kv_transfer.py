"""KV transfer throughput on loopback against a plain socket copy: ``python -m bench.kv_transfer``.

A producer process holds requests of SmolLM2-135M-Instruct's KV layout (30 layers, 3 KV heads,
head dim 64, 16-token blocks, bf16: 368,640 bytes a block) of 2,048 prompt tokens each (128
blocks, 45 MiB). This process pulls them with :class:`~cadenza.node.kv_transfer.consumer.KVConsumer`:
the token handshake (once per connection), msgpack headers, CRC32C per frame on both sides,
lease bookkeeping, asyncio streams. Side by
side, interleaved round by round, the same producer process sends the same bytes over a plain
blocking socket (one ``sendall`` per prompt, ``recv_into`` one preallocated buffer: no header, no
checksum, no copy beyond the kernel's), the cheapest copy Python can make. Both sides
run one process each on their own core (2 cores here). The producer's block reader returns views
of one buffer in both runs: the engine's gather of blocks from its KV cache is not in this figure.

Target (issue 14): KV transfer >= 80 % of the plain copy's throughput. Last line JSON. ``--quick``:
one round of one 256-token prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import secrets
import socket
import statistics
import threading
import time

from bench.common import arguments, machine, report
from cadenza.node.kv_transfer.consumer import KVConsumer
from cadenza.node.kv_transfer.producer import KVProducer, frame_blocks
from cadenza.node.kv_transfer.protocol import Fingerprint

SMOLLM2 = Fingerprint("SmolLM2-135M-Instruct", "bfloat16", block_size=16, num_layers=30, num_kv_heads=3, head_dim=64)
PROMPT_TOKENS, QUICK_PROMPT_TOKENS = 2048, 256
FRAME = frame_blocks(SMOLLM2.num_layers * SMOLLM2.block_layer_bytes)  # blocks per frame, both ways


def _pin(cpu: int) -> None:
    if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) > 1:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[cpu % len(os.sched_getaffinity(0))]})


def _producer(ports: mp.Queue, requests: int, blocks: int, token: str) -> None:
    """The producer process: every request published and complete, plus a plain byte server;
    ``token``: the pool's token, which both sides prove they hold when they connect."""
    _pin(1)
    block = SMOLLM2.num_layers * SMOLLM2.block_layer_bytes
    data = memoryview(os.urandom(block * blocks))

    def read(first: int, count: int) -> memoryview:
        return data[first * block:(first + count) * block]

    def plain(listener: socket.socket) -> None:  # blocking sockets: the copy at its cheapest
        conn, _ = listener.accept()
        while conn.recv(1):  # one request's bytes per byte asked, in one sendall
            conn.sendall(read(0, blocks))

    async def main() -> None:
        producer = KVProducer(SMOLLM2, token=token, lease_s=3600)
        for i in range(requests):
            producer.publish(f"r{i}", read, lambda: None)
            producer.progress(f"r{i}", blocks, complete=True)
        port = await producer.start()
        listener = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=plain, args=(listener,), daemon=True).start()
        ports.put((port, listener.getsockname()[1]))
        await asyncio.Event().wait()

    asyncio.run(main())


async def _measure(port: int, plain_port: int, rounds: int, per_round: int, blocks: int, token: str) -> dict:
    block = SMOLLM2.num_layers * SMOLLM2.block_layer_bytes
    nbytes = per_round * blocks * block
    consumer = KVConsumer(SMOLLM2, token=token)
    sock = socket.create_connection(("127.0.0.1", plain_port))
    buffer = memoryview(bytearray(nbytes // per_round))
    kv, raw, n = [], [], 0

    def receive() -> None:  # recv_into one preallocated buffer: no copy beyond the kernel's
        sock.sendall(b"x")
        got = 0
        while got < len(buffer):
            got += sock.recv_into(buffer[got:])

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
            await asyncio.to_thread(receive)
        return nbytes / (time.perf_counter() - started)

    await pull_round(), await plain_round()  # warm-up: connections, buffers
    for r in range(rounds):
        order = (pull_round, plain_round) if r % 2 == 0 else (plain_round, pull_round)
        for f in order:
            (kv if f is pull_round else raw).append(await f())
    sock.close()
    await consumer.close()
    return {"kv": kv, "plain": raw}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, help="default 9; 1 with --quick")
    p.add_argument("--per-round", type=int, help="requests pulled per round (default 12; 1 with --quick)")
    a = arguments(__doc__, p)
    a.rounds = a.rounds or (1 if a.quick else 9)
    a.per_round = a.per_round or (1 if a.quick else 12)
    prompt_tokens = QUICK_PROMPT_TOKENS if a.quick else PROMPT_TOKENS
    blocks = prompt_tokens // SMOLLM2.block_size
    token = secrets.token_urlsafe(32)
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    proc = ctx.Process(target=_producer, args=(ports, (a.rounds + 1) * a.per_round, blocks, token), daemon=True)
    proc.start()
    try:
        port, plain_port = ports.get(timeout=60)
        _pin(0)
        rates = asyncio.run(_measure(port, plain_port, a.rounds, a.per_round, blocks, token))
    finally:
        proc.terminate()
    kv, plain = statistics.median(rates["kv"]), statistics.median(rates["plain"])
    per_round = [round(k / r, 3) for k, r in zip(rates["kv"], rates["plain"], strict=True)]
    mib = blocks * SMOLLM2.num_layers * SMOLLM2.block_layer_bytes / 2**20
    print(f"{a.rounds} rounds of {a.per_round} x {prompt_tokens}-token prompts ({mib:.0f} MiB each)")
    print(f"KV transfer {kv / 1e9:.2f} GB/s, plain socket copy {plain / 1e9:.2f} GB/s (medians); "
          f"ratio per round {per_round}")
    report({"benchmark": "kv_transfer", "ratio": round(kv / plain, 3), "target": 0.8,
            "kv_gb_s": round(kv / 1e9, 3), "plain_gb_s": round(plain / 1e9, 3), "ratio_per_round": per_round,
            "bytes_per_prompt": blocks * SMOLLM2.num_layers * SMOLLM2.block_layer_bytes,
            "bytes_per_token": SMOLLM2.bytes_per_token, "frame_blocks": FRAME,
            "prefix_caching": False, "prefix_cache_hit_rate": 0.0, "machine": machine()}, quick=a.quick)


if __name__ == "__main__":
    main()
