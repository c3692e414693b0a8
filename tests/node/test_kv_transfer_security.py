"""The KV transfer endpoint as an attacker meets it: no token, no slot, no memory, no information.

A producer and real consumers over loopback TCP, and hostile clients speaking the wire by hand
from other loopback addresses (127.0.0.2 and up: Linux routes all of 127/8 to lo), so the
producer tells them apart from the real consumer at 127.0.0.1 as it would tell pods apart.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from cadenza.node.kv_transfer import handshake, protocol, slots
from cadenza.node.kv_transfer import producer as producer_module
from cadenza.node.kv_transfer.consumer import KVConsumer
from cadenza.node.kv_transfer.producer import KVProducer
from cadenza.node.kv_transfer.protocol import Fingerprint, TransferError

FP = Fingerprint("tiny-llama", "float32", block_size=4, num_layers=2, num_kv_heads=2, head_dim=8, weights="ab" * 32)
BLOCK = FP.num_layers * FP.block_layer_bytes
TOKEN = "pool-token"
SECRETS = ("tiny-llama", "float32", "ab" * 32, "head_dim", "num_layers")  # what an outsider must not learn


@pytest.fixture
async def producer():
    p = KVProducer(FP, token=TOKEN, lease_s=30.0)
    port = await p.start()
    yield p, port
    await p.close()


_published = 0


def publish(p: KVProducer, blocks: int = 3, complete: bool = True) -> tuple[str, list[bytes]]:
    """A request's blocks held by ``p`` (all written, unless ``complete`` is False: none yet)."""
    global _published
    _published += 1
    rid = f"r{_published}"
    data = [bytes([(_published + b) % 251]) * BLOCK for b in range(blocks)]
    p.publish(rid, lambda first, count: b"".join(data[first:first + count]), lambda: None)
    if complete:
        p.progress(rid, blocks, complete=True)
    return rid, data


async def pull(consumer: KVConsumer, port: int, rid: str) -> list[bytes]:
    out = []
    async for got in consumer.pull("127.0.0.1", port, rid):
        out += [bytes(got.payload[i * BLOCK:(i + 1) * BLOCK]) for i in range(got.num_blocks)]
    return out


async def read_frame(reader: asyncio.StreamReader) -> dict:
    return protocol.decode(await reader.readexactly(protocol.header_length(await reader.readexactly(4))))


async def connect(port: int, source: str = "127.0.0.2") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def authenticate(port: int, source: str = "127.0.0.2", token: str = TOKEN):
    """A hand-made client that completes the handshake with ``token``: (reader, writer)."""
    reader, writer = await connect(port, source)
    frame, nonce_c = handshake.hello()
    writer.write(frame)
    auth, nonce_p = handshake.answer(await read_frame(reader), token, nonce_c, FP, "test")
    writer.write(auth)
    handshake.check_welcome(await read_frame(reader), token, nonce_c, nonce_p, FP, "test")
    return reader, writer


async def closed_by_peer(reader: asyncio.StreamReader, within_s: float) -> bool:
    """Whether the other side closes the connection within ``within_s`` (frames before are skipped)."""
    deadline = time.monotonic() + within_s
    try:
        while (left := deadline - time.monotonic()) > 0:
            if not await asyncio.wait_for(reader.read(65536), left):
                return True
    except ConnectionError:
        return True
    except TimeoutError:
        return False
    return False


def pull_frame(rid: str) -> bytes:
    return protocol.encode("pull", request_id=rid, first_block=0, num_blocks=0)


# -- credentials ---------------------------------------------------------------------------------


async def test_a_peer_without_the_token_is_refused_unheard_and_learns_nothing(producer):
    p, port = producer
    reader, writer = await connect(port)
    frame, nonce_c = handshake.hello()
    writer.write(frame)
    challenge = await read_frame(reader)
    assert challenge["kind"] == "challenge"
    forged = handshake.proof("guessed", b"consumer", nonce_c, challenge["nonce"], FP.packed())
    writer.write(protocol.encode("auth", fingerprint=FP.packed(), proof=forged))
    refused = await read_frame(reader)
    assert refused["kind"] == "refused" and refused["code"] == "unauthorized"
    assert await closed_by_peer(reader, 1)
    writer.close()
    # a hello of the old protocol (its fingerprint in the clear) is refused by version, unanswered
    reader, writer = await connect(port)
    writer.write(protocol.encode("hello", version=1, fingerprint=dataclasses.replace(FP, head_dim=16).to_wire()))
    old = await read_frame(reader)
    assert old["kind"] == "refused" and old["code"] == "incompatible" and "protocol version 1" in old["reason"]
    writer.close()
    told = repr((challenge, refused, old))
    assert not [s for s in SECRETS if s in told]  # no model, dtype, weights or shape in anything it said
    rid, data = publish(p)
    consumer = KVConsumer(FP, token=TOKEN)
    assert await pull(consumer, port, rid) == data  # a real pull still succeeds
    assert p.stats.failures == {"unauthorized": 1, "incompatible": 1}
    await consumer.close()


async def test_a_consumer_with_another_token_or_none_fails_unauthorized_and_moves_nothing(producer):
    p, port = producer
    rid, _ = publish(p)
    for token in ("another-token", None):
        with pytest.raises(TransferError) as e:
            await pull(KVConsumer(FP, token=token), port, rid)
        assert e.value.kind == "unauthorized" and not [s for s in SECRETS if s in str(e.value)]
    assert p.stats.blocks_sent == 0 and p.held() == [rid]


async def test_a_producer_without_a_token_refuses_everyone():
    p = KVProducer(FP, token=None)
    port = await p.start()
    rid, _ = publish(p)
    with pytest.raises(TransferError) as e:
        await pull(KVConsumer(FP, token=TOKEN), port, rid)
    assert e.value.kind == "unauthorized" and p.stats.blocks_sent == 0
    await p.close()


async def test_a_captured_handshake_cannot_be_replayed_on_another_connection(producer):
    p, port = producer
    reader, writer = await connect(port)
    frame, nonce_c = handshake.hello()
    writer.write(frame)
    auth, _ = handshake.answer(await read_frame(reader), TOKEN, nonce_c, FP, "test")  # what a sniffer saw
    writer.close()
    reader, writer = await connect(port)
    writer.write(frame)  # the same hello, so the same consumer nonce...
    await read_frame(reader)  # ...but a fresh producer nonce: the old proof does not cover it
    writer.write(auth)
    refused = await read_frame(reader)
    assert refused["kind"] == "refused" and refused["code"] == "unauthorized"
    writer.close()


async def test_the_consumer_reveals_its_fingerprint_only_to_a_producer_that_proves_the_token():
    heard: list[dict] = []

    async def impostor(reader, writer):  # answers hello without knowing the token
        try:
            hello = await read_frame(reader)
            writer.write(handshake.challenge("not-the-token", hello["nonce"])[0])
            heard.append(await read_frame(reader))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        writer.close()

    server = await asyncio.start_server(impostor, "127.0.0.1", 0)
    with pytest.raises(TransferError) as e:
        await pull(KVConsumer(FP, token=TOKEN), server.sockets[0].getsockname()[1], "r")
    assert e.value.kind == "unauthorized" and heard == []  # it hung up before sending auth
    server.close()


# -- slots ---------------------------------------------------------------------------------------


async def test_connections_that_never_authenticate_cannot_take_the_slots_a_real_pull_needs(producer, monkeypatch):
    monkeypatch.setattr(slots, "HANDSHAKE_TIMEOUT_S", 0.5)
    p, port = producer
    hogs = [await connect(port, f"127.0.0.{2 + i % 20}") for i in range(300)]  # 20 addresses x 15, saying nothing
    await asyncio.sleep(0.1)
    rid, data = publish(p)
    consumer = KVConsumer(FP, token=TOKEN, connect_timeout_s=2)
    assert await pull(consumer, port, rid) == data
    closed = await asyncio.gather(*(closed_by_peer(r, 1.5) for r, _ in hogs))
    assert all(closed)  # each one cut at its handshake's deadline, if not before
    for _, w in hogs:
        w.close()
    monkeypatch.setattr(slots, "HANDSHAKE_TIMEOUT_S", 5.0)
    one = [await connect(port, "127.0.0.99") for _ in range(slots.MAX_HANDSHAKES_PER_PEER + 10)]
    refused_at_once = await asyncio.gather(*(closed_by_peer(r, 1.0) for r, _ in one))
    assert sum(refused_at_once) == 10  # one address gets its share of handshakes, no more
    for _, w in one:
        w.close()
    await consumer.close()


async def test_a_handshake_flood_from_a_few_addresses_cuts_its_own_handshakes_not_a_real_peers(producer):
    """Silent connections from 20 addresses (each under its per-address cap) kept the handshake
    slots full, and each new one cut the oldest handshake: a real consumer's too, whose pull then
    failed as a lost ``connection``. Now the flood's own handshakes are cut first."""
    _, port = producer
    flood = []

    async def open_flood(n: int) -> None:
        for i in range(n):
            flood.append(await connect(port, f"127.0.0.{2 + i % 20}"))
        await asyncio.sleep(0.05)

    await open_flood(slots.MAX_HANDSHAKES - 1)
    reader, writer = await connect(port, "127.0.0.1")  # a real peer starts its handshake, the 64th
    frame, nonce_c = handshake.hello()
    writer.write(frame)
    auth, nonce_p = handshake.answer(await read_frame(reader), TOKEN, nonce_c, FP, "test")
    await open_flood(2 * slots.MAX_HANDSHAKES)  # each one past the cap cuts a handshake
    writer.write(auth)
    handshake.check_welcome(await read_frame(reader), TOKEN, nonce_c, nonce_p, FP, "test")  # not cut
    writer.close()
    for _, w in flood:
        w.close()


async def test_a_handshake_cut_for_another_is_told_busy(producer, monkeypatch):
    monkeypatch.setattr(slots, "MAX_HANDSHAKES", 2)
    _, port = producer
    kept = [await connect(port, "127.0.0.2") for _ in range(2)]
    await asyncio.sleep(0.05)
    kept.append(await connect(port, "127.0.0.3"))  # the handshakes are full: 127.0.0.2's oldest goes
    refusal = await asyncio.wait_for(read_frame(kept[0][0]), 2)
    assert (refusal["kind"], refusal["code"]) == ("refused", "busy")
    for _, writer in kept:
        writer.close()


async def test_a_peer_holding_every_slot_by_pulling_nothing_gives_way_to_a_real_pull(producer, monkeypatch):
    monkeypatch.setattr(slots, "MAX_CONNECTIONS", 4)
    monkeypatch.setattr(producer_module, "PUBLISH_WAIT_S", 0.05)
    p, port = producer
    hogs = [await authenticate(port) for _ in range(4)]  # a token holder gone wrong, all slots taken

    async def keep_busy(reader, writer):  # pulls of ids the producer does not hold, back to back
        try:
            while True:
                writer.write(pull_frame("nothing"))
                if (await read_frame(reader))["kind"] != "error":
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return

    busy = [asyncio.create_task(keep_busy(r, w)) for r, w in hogs]
    await asyncio.sleep(0.3)
    rid, data = publish(p)
    consumer = KVConsumer(FP, token=TOKEN)
    assert await pull(consumer, port, rid) == data  # the longest-idle hog was evicted for it
    await asyncio.sleep(0.2)
    assert p.slots.evicted == 1 and sum(t.done() for t in busy) == 1
    for t in busy:
        t.cancel()
    await consumer.close()


async def test_pulls_of_requests_not_held_do_not_keep_an_idle_connection_open(producer, monkeypatch):
    monkeypatch.setattr(slots, "IDLE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(producer_module, "PUBLISH_WAIT_S", 0.05)
    p, port = producer
    reader, writer = await authenticate(port)
    started = time.monotonic()
    try:
        while time.monotonic() - started < 3:
            writer.write(pull_frame("nothing"))
            assert (await read_frame(reader))["code"] == "unknown_request"
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    assert time.monotonic() - started < 1.5  # closed once idle, the pulls notwithstanding
    writer.close()
    rid, data = publish(p, complete=False)  # a pull that streams is not idle, however long it takes
    consumer = KVConsumer(FP, token=TOKEN)
    task = asyncio.create_task(pull(consumer, port, rid))
    await asyncio.sleep(1.0)
    p.progress(rid, len(data), complete=True)
    assert await asyncio.wait_for(task, 5) == data
    await consumer.close()


async def test_a_full_endpoint_refuses_as_busy_not_as_incompatible(producer, monkeypatch):
    monkeypatch.setattr(slots, "MAX_CONNECTIONS", 1)
    p, port = producer
    streaming, data = publish(p, complete=False)
    first = KVConsumer(FP, token=TOKEN)
    task = asyncio.create_task(pull(first, port, streaming))  # holds the one slot, streaming
    await asyncio.sleep(0.2)
    second = KVConsumer(FP, token=TOKEN)
    rid, _ = publish(p)
    with pytest.raises(TransferError) as e:
        await pull(second, port, rid)
    assert e.value.kind == "busy" and "streaming" in str(e.value)
    p.progress(streaming, len(data), complete=True)
    assert await asyncio.wait_for(task, 5) == data
    assert p.stats.failures == {"busy": 1}
    await first.close(); await second.close()


async def test_a_pooled_connection_evicted_for_another_peer_does_not_fail_the_next_pull(producer, monkeypatch):
    monkeypatch.setattr(slots, "MAX_CONNECTIONS", 1)
    p, port = producer
    consumer = KVConsumer(FP, token=TOKEN)
    rid, data = publish(p)
    assert await pull(consumer, port, rid) == data  # its connection now waits in the pool, idle
    other = await authenticate(port)  # takes the one slot: the pooled connection is evicted
    rid, data = publish(p)
    assert await pull(consumer, port, rid) == data  # and the next pull just connects again
    other[1].close()
    await consumer.close()


# -- queued pulls --------------------------------------------------------------------------------


async def test_pulls_queued_past_the_cap_close_the_connection_and_a_real_pull_goes_on(producer, monkeypatch):
    monkeypatch.setattr(producer_module, "MAX_QUEUED_PULLS_TOTAL", 5)
    p, port = producer
    reader, writer = await authenticate(port)
    writer.write(b"".join(pull_frame(f"nothing-{i}") for i in range(20_000)))  # 1.1 MB, the first waits 5 s
    started = time.monotonic()
    assert await closed_by_peer(reader, 2)
    assert time.monotonic() - started < 2
    writer.close()
    # in total too: two connections queueing within their own cap, past the endpoint's
    first, second = await authenticate(port), await authenticate(port, "127.0.0.3")
    first[1].write(b"".join(pull_frame(f"wait-{i}") for i in range(producer_module.MAX_QUEUED_PULLS)))
    await asyncio.sleep(0.2)
    second[1].write(b"".join(pull_frame(f"wait-{i}") for i in range(producer_module.MAX_QUEUED_PULLS)))
    assert await closed_by_peer(second[0], 2) and not await closed_by_peer(first[0], 0.2)
    rid, data = publish(p)
    consumer = KVConsumer(FP, token=TOKEN)
    assert await pull(consumer, port, rid) == data
    assert p.stats.failures["busy"] == 2
    first[1].close()
    await consumer.close()
