"""KV transfer between a prefill and a decode replica: the wire, leases, and every way it can fail.

The producer and consumer talk over real loopback TCP; faults in transit (a flipped byte, a cut
socket) are made by a small proxy between them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time

import pytest

from cadenza.node.kv_transfer import producer as producer_module
from cadenza.node.kv_transfer import handshake, protocol
from cadenza.node.kv_transfer.consumer import KVConsumer
from cadenza.node.kv_transfer.leases import LeaseTable
from cadenza.node.kv_transfer.producer import MAX_FRAME_BLOCKS, KVProducer
from cadenza.node.kv_transfer.protocol import Fingerprint, TransferError
from cadenza.node.kv_transfer.threshold import Rule, min_prompt_tokens

FP = Fingerprint("tiny-llama", "float32", block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)
TOKEN = "pool-token"  # both sides prove they hold it in the handshake
BLOCK = FP.num_layers * FP.block_layer_bytes  # bytes of one block, every layer


def block_bytes(request: int, block: int) -> bytes:
    """Distinct, checkable contents for block ``block`` of request ``request``."""
    return bytes((request * 31 + block * 7 + i) % 251 for i in range(BLOCK))


class Published:
    """A request's blocks on the prefill side, as the engine would publish them."""

    def __init__(self, request: int, blocks: int) -> None:
        self.data = [block_bytes(request, b) for b in range(blocks)]
        self.freed = 0

    def read(self, first: int, count: int) -> bytes:
        return b"".join(self.data[first:first + count])

    def free(self) -> None:
        self.freed += 1


async def collect(consumer: KVConsumer, port: int, rid: str, **kw) -> list[bytes]:
    out = []
    async for got in consumer.pull("127.0.0.1", port, rid, **kw):
        out += [got.payload[i * BLOCK:(i + 1) * BLOCK] for i in range(got.num_blocks)]
    return out


@pytest.fixture
async def producer():
    p = KVProducer(FP, token=TOKEN, lease_s=30.0)
    port = await p.start()
    yield p, port
    await p.close()


# -- the wire ------------------------------------------------------------------------------------


def test_bytes_per_token_is_two_times_layers_heads_head_dim_and_dtype_size():
    fp = Fingerprint("llama-3.1-8b", "bfloat16", 16, num_layers=32, num_kv_heads=8, head_dim=128)
    assert fp.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    assert fp.block_layer_bytes * fp.num_layers == 16 * fp.bytes_per_token


def test_a_header_round_trips_and_a_bad_one_is_a_protocol_error():
    frame = protocol.encode("pull", request_id="r1", first_block=3, num_blocks=0)
    assert protocol.header_length(frame[:4]) == len(frame) - 4
    assert protocol.decode(frame[4:]) == {"kind": "pull", "request_id": "r1", "first_block": 3, "num_blocks": 0}
    for body in (b"\xc1", protocol.encode("pull", request_id="r1")[4:], protocol.encode("nope")[4:],
                 protocol.encode("pull", request_id="r1", first_block=-1, num_blocks=0)[4:]):
        with pytest.raises(TransferError) as e:
            protocol.decode(body)
        assert e.value.kind == "protocol"
    with pytest.raises(TransferError):
        protocol.header_length(b"\xff\xff\xff\xff")


def test_a_flipped_payload_byte_fails_the_crc_and_a_short_payload_is_truncated():
    payload = block_bytes(0, 0) + block_bytes(0, 1)
    header = protocol.decode(protocol.blocks_header("r", 0, 2, 0, FP.num_layers, payload)[4:])
    protocol.check_blocks_header(header, FP)
    protocol.check_payload(header, payload)
    flipped = bytearray(payload)
    flipped[100] ^= 0x01
    with pytest.raises(TransferError) as e:
        protocol.check_payload(header, bytes(flipped))
    assert e.value.kind == "corrupt"
    with pytest.raises(TransferError) as e:
        protocol.check_payload(header, payload[:-1])
    assert e.value.kind == "truncated"


def test_a_blocks_header_that_lies_about_its_size_or_layers_is_refused_before_its_payload_is_read():
    good = dict(kind="blocks", request_id="r", first_block=0, num_blocks=2, first_layer=0,
                num_layers=FP.num_layers, nbytes=2 * BLOCK, crc32c=0)
    protocol.check_blocks_header(good, FP)
    for lie in ({"nbytes": 2**30}, {"num_layers": 1, "nbytes": 2 * FP.block_layer_bytes}, {"num_blocks": 0, "nbytes": 0},
                {"first_layer": 1, "num_layers": 1, "nbytes": 2 * FP.block_layer_bytes}):
        with pytest.raises(TransferError) as e:
            protocol.check_blocks_header({**good, **lie}, FP)
        assert e.value.kind == "protocol"
    for bad in ({"kind": ["pull"]}, {"kind": "pull", "request_id": "x" * 300, "first_block": 0, "num_blocks": 0}):
        with pytest.raises(TransferError):
            protocol.decode(protocol.msgpack.packb(bad))


def test_fingerprints_name_every_field_that_differs():
    other = dataclasses.replace(FP, dtype="bfloat16", num_kv_heads=4)
    assert FP.mismatch(other) == ["dtype: 'float32' != 'bfloat16'", "num_kv_heads: 2 != 4"]
    assert FP.mismatch(Fingerprint.from_wire(FP.to_wire())) == []
    assert FP.mismatch(dataclasses.replace(FP, weights="0f" * 32)) == [f"weights: '' != '{'0f' * 32}'"]
    assert Fingerprint.unpacked(FP.packed()) == FP
    with pytest.raises(ValueError):
        Fingerprint("m", "int3", 16, 1, 1, 1)


# -- leases --------------------------------------------------------------------------------------


def test_a_lease_is_renewed_by_progress_and_handed_back_exactly_once():
    t = LeaseTable[str](ttl_s=30.0)
    t.hold("a", "blocks-a", now=0.0)
    t.hold("b", "blocks-b", now=0.0)
    assert t.renew("a", now=20.0)
    assert t.expire(now=30.0) == [("b", "blocks-b")]
    assert t.expire(now=49.0) == []
    assert t.release("a") == "blocks-a"
    assert t.release("a") is None and not t.renew("a", 50.0) and t.expire(1e9) == []
    with pytest.raises(ValueError):
        LeaseTable(ttl_s=0)


# -- producer and consumer over loopback ---------------------------------------------------------


async def test_a_pull_streams_blocks_as_the_prefill_writes_them_and_release_frees_them(producer):
    p, port = producer
    blocks = Published(1, 10)
    p.publish("r1", blocks.read, blocks.free)
    p.progress("r1", 3)
    consumer = KVConsumer(FP, token=TOKEN)
    got: list[bytes] = []

    async def pull():
        async for frame in consumer.pull("127.0.0.1", port, "r1", boot_id=p.boot_id):
            got.extend(frame.payload[i * BLOCK:(i + 1) * BLOCK] for i in range(frame.num_blocks))

    task = asyncio.create_task(pull())
    for _ in range(100):  # the first chunk's blocks arrive before the prefill goes on
        await asyncio.sleep(0.01)
        if len(got) == 3:
            break
    assert len(got) == 3 and not task.done()
    p.progress("r1", 7)
    p.progress("r1", 10, complete=True)
    await asyncio.wait_for(task, 5)
    assert got == blocks.data
    for _ in range(100):
        if not p.held():
            break
        await asyncio.sleep(0.01)
    assert p.held() == [] and blocks.freed == 1
    assert p.stats.transfers == 1 and p.stats.bytes_sent == 10 * BLOCK
    await consumer.close()


async def test_many_blocks_come_in_frames_and_a_pull_may_ask_for_a_range(producer):
    p, port = producer
    consumer = KVConsumer(FP, token=TOKEN)
    blocks = Published(2, MAX_FRAME_BLOCKS * 2 + 5)
    for rid, first, n, want in (("a", 4, 0, slice(4, None)), ("b", 2, 70, slice(2, 72)),
                                ("c", 130, 50, slice(130, None))):  # c: it holds fewer than asked
        p.publish(rid, blocks.read, blocks.free)
        p.progress(rid, len(blocks.data), complete=True)
        assert await collect(consumer, port, rid, first_block=first, num_blocks=n) == blocks.data[want]
    await wait_freed(p, blocks, within_s=1, times=3)  # each released after its one pull
    await consumer.close()


async def test_pulls_measure_the_links_bandwidth_from_the_payload_bytes_they_waited_for():
    # blocks of a real model's size (1 MiB, 4 MiB frames): bytes staged before a read asked for
    # them are not timed, and frames far larger than the stage are mostly waited for
    fp = Fingerprint("big", "float32", block_size=16, num_layers=16, num_kv_heads=8, head_dim=64)
    size = fp.num_layers * fp.block_layer_bytes
    p = KVProducer(fp, token=TOKEN, lease_s=30.0)
    port = await p.start()
    consumer = KVConsumer(fp, token=TOKEN)
    assert consumer.bandwidth is None
    data = [os.urandom(size) for _ in range(8)]  # 8 MiB
    p.publish("big", lambda first, count: b"".join(data[first:first + count]), lambda: None)
    p.progress("big", len(data), complete=True)
    got = b"".join([bytes(b.payload) async for b in consumer.pull("127.0.0.1", port, "big")])
    assert got == b"".join(data)
    assert 2**20 <= consumer.link_bytes <= 8 * 2**20 and consumer.bandwidth is not None
    assert consumer.bandwidth > 1e6  # bytes per second: loopback moves GB/s
    await consumer.close()
    await p.close()


async def test_a_range_pull_ends_once_its_blocks_are_written_before_the_prefill_ends(producer):
    p, port = producer
    blocks = Published(12, 9)
    p.publish("r12", blocks.read, blocks.free)
    p.progress("r12", 3)
    consumer = KVConsumer(FP, token=TOKEN)
    assert await asyncio.wait_for(collect(consumer, port, "r12", num_blocks=3), 5) == blocks.data[:3]
    await consumer.close()


async def test_connections_are_reused_across_pulls(producer):
    p, port = producer
    consumer = KVConsumer(FP, token=TOKEN)
    for i in range(3):
        blocks = Published(i, 2)
        p.publish(f"r{i}", blocks.read, blocks.free)
        p.progress(f"r{i}", 2, complete=True)
        assert await collect(consumer, port, f"r{i}") == blocks.data
    assert p.stats.connections == 1
    await consumer.close()


async def test_an_incompatible_consumer_is_refused_before_any_block_moves(producer):
    p, port = producer
    blocks = Published(3, 2)
    p.publish("r3", blocks.read, blocks.free)
    p.progress("r3", 2, complete=True)
    consumer = KVConsumer(dataclasses.replace(FP, head_dim=16), token=TOKEN)
    with pytest.raises(TransferError) as e:
        await collect(consumer, port, "r3")
    assert e.value.kind == "incompatible" and "head_dim: 8 != 16" in str(e.value)  # told: it holds the token
    assert p.stats.blocks_sent == 0 and p.stats.refused == 1 and p.held() == ["r3"]


async def test_a_pull_that_comes_before_its_publication_waits_for_it(producer):
    p, port = producer
    consumer = KVConsumer(FP, token=TOKEN)
    blocks = Published(16, 3)
    pull = asyncio.create_task(collect(consumer, port, "r16"))
    await asyncio.sleep(0.2)  # the decode side asked first
    p.publish("r16", blocks.read, blocks.free)
    p.progress("r16", 3, complete=True)
    assert await asyncio.wait_for(pull, 5) == blocks.data
    await consumer.close()


async def test_a_request_the_producer_does_not_hold_is_unknown(producer, monkeypatch):
    monkeypatch.setattr(producer_module, "PUBLISH_WAIT_S", 0.2)
    p, port = producer
    consumer = KVConsumer(FP, token=TOKEN)
    with pytest.raises(TransferError) as e:
        await collect(consumer, port, "nobody")
    assert e.value.kind == "unknown_request"
    blocks = Published(4, 1)  # the connection is still good after a clean error
    p.publish("r4", blocks.read, blocks.free)
    p.progress("r4", 1, complete=True)
    assert await collect(consumer, port, "r4") == blocks.data
    assert p.stats.connections == 1
    await consumer.close()


class FaultyProxy:
    """Forwards producer -> consumer bytes, flipping the byte at ``flip_at`` or closing both
    sides after ``cut_after`` bytes (counted from the start of the producer's stream)."""

    def __init__(self, target_port: int, flip_at: int | None = None, cut_after: int | None = None) -> None:
        self.target_port, self.flip_at, self.cut_after = target_port, flip_at, cut_after
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _handle(self, creader, cwriter):
        preader, pwriter = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def upstream():
            while data := await creader.read(65536):
                pwriter.write(data)
            pwriter.close()

        async def downstream():
            seen = 0
            while data := await preader.read(65536):
                if self.flip_at is not None and seen <= self.flip_at < seen + len(data):
                    data = bytearray(data)
                    data[self.flip_at - seen] ^= 0x40
                if self.cut_after is not None and seen + len(data) >= self.cut_after:
                    cwriter.write(data[:self.cut_after - seen])
                    await cwriter.drain()
                    cwriter.close()
                    pwriter.close()
                    return
                seen += len(data)
                cwriter.write(data)
                await cwriter.drain()
            cwriter.close()

        await asyncio.gather(upstream(), downstream(), return_exceptions=True)

    async def close(self):
        self.server.close()


def welcome_len(p: KVProducer) -> int:
    """Bytes the producer sends before a pull's first frame: its challenge and its welcome."""
    nonce = bytes(handshake.NONCE_BYTES)
    return len(handshake.challenge(TOKEN, nonce)[0]) + len(handshake.welcome(TOKEN, nonce, nonce, FP, p.boot_id))


async def test_one_flipped_byte_in_transit_is_caught_and_nothing_after_it_is_used():
    p = KVProducer(FP, token=TOKEN, lease_s=0.5)
    port = await p.start()
    blocks = Published(5, MAX_FRAME_BLOCKS + 4)
    p.publish("r5", blocks.read, blocks.free)
    p.progress("r5", len(blocks.data), complete=True)
    first = len(protocol.blocks_header("r5", 0, MAX_FRAME_BLOCKS, 0, 2, blocks.read(0, MAX_FRAME_BLOCKS)))
    # a byte in the second frame's payload: the first frame's blocks are good and delivered
    flip = welcome_len(p) + first + MAX_FRAME_BLOCKS * BLOCK + 200
    proxy = FaultyProxy(port, flip_at=flip)
    consumer = KVConsumer(FP, token=TOKEN)
    good = []
    with pytest.raises(TransferError) as e:
        async for frame in consumer.pull("127.0.0.1", await proxy.start(), "r5"):
            good.append(frame)
    assert e.value.kind == "corrupt"
    assert [f.num_blocks for f in good] == [MAX_FRAME_BLOCKS]
    assert good[0].payload == blocks.read(0, MAX_FRAME_BLOCKS)
    await wait_freed(p, blocks, within_s=0.5 + 1.0)
    await proxy.close(); await consumer.close(); await p.close()


async def wait_freed(p: KVProducer, blocks: Published, within_s: float, times: int = 1) -> None:
    """The producer holds nothing and freed ``blocks`` ``times`` times, within ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while p.held() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert p.held() == [] and blocks.freed == times


async def test_a_socket_cut_mid_frame_fails_the_pull_as_truncated_and_the_lease_still_ends():
    p = KVProducer(FP, token=TOKEN, lease_s=0.5)
    port = await p.start()
    blocks = Published(6, 8)
    p.publish("r6", blocks.read, blocks.free)
    p.progress("r6", 8, complete=True)
    proxy = FaultyProxy(port, cut_after=welcome_len(p) + 300)
    consumer = KVConsumer(FP, token=TOKEN)
    started = time.monotonic()
    with pytest.raises(TransferError) as e:
        await collect(consumer, await proxy.start(), "r6")
    assert e.value.kind == "truncated" and time.monotonic() - started < 2
    await wait_freed(p, blocks, within_s=0.5 + 1.0)
    await proxy.close(); await consumer.close(); await p.close()


async def test_a_decode_side_stalled_past_the_lease_finds_it_expired_and_the_blocks_freed():
    p = KVProducer(FP, token=TOKEN, lease_s=0.5)
    port = await p.start()
    blocks = Published(7, 6)
    p.publish("r7", blocks.read, blocks.free)
    p.progress("r7", 2)  # the prefill stalls too: nothing renews the lease
    consumer = KVConsumer(FP, token=TOKEN)
    frames = consumer.pull("127.0.0.1", port, "r7")
    first = await anext(frames)
    assert first.num_blocks == 2
    await wait_freed(p, blocks, within_s=0.5 + 1.0)
    p.progress("r7", 6, complete=True)  # too late: ignored, nothing is read from freed blocks
    with pytest.raises(TransferError) as e:
        await anext(frames)
    assert e.value.kind == "expired" and p.stats.expired == 1
    await consumer.close(); await p.close()


async def test_a_prompt_queued_behind_others_outlives_many_leases_while_its_engine_steps():
    """The engine's steps renew a prompt it has not computed yet, and ``pending`` frames keep the
    pull's read timeout from firing on a producer that is busy, not silent."""
    p = KVProducer(FP, token=TOKEN, lease_s=0.6)
    port = await p.start()
    blocks = Published(8, 5)
    p.publish("r8", blocks.read, blocks.free)
    consumer = KVConsumer(FP, token=TOKEN, read_timeout_s=0.6)
    task = asyncio.create_task(collect(consumer, port, "r8", boot_id=p.boot_id))
    for _ in range(10):  # 2 s queued: more than three leases and three read timeouts
        await asyncio.sleep(0.2)
        p.renew(["r8"])
    assert not task.done() and p.held() == ["r8"]
    p.progress("r8", 5, complete=True)
    assert await asyncio.wait_for(task, 5) == blocks.data
    await wait_freed(p, blocks, within_s=1.0)
    await consumer.close(); await p.close()


async def test_a_decode_side_that_holds_a_request_queued_keeps_its_lease_with_renew_frames():
    """``renew`` frames from the decode side keep a computed prompt's lease running past many
    leases; one naming another boot id sends nothing; once they stop, the lease ends as usual."""
    p = KVProducer(FP, token=TOKEN, lease_s=0.6)
    port = await p.start()
    kept, dropped = Published(10, 3), Published(11, 3)
    for rid, blocks in (("r10", kept), ("r11", dropped)):
        p.publish(rid, blocks.read, blocks.free)
        p.progress(rid, 3, complete=True)
    consumer = KVConsumer(FP, token=TOKEN)
    for _ in range(10):  # 2 s: more than three leases
        await asyncio.sleep(0.2)
        assert await consumer.renew("127.0.0.1", port, p.boot_id, ["r10"])
        assert not await consumer.renew("127.0.0.1", port, "an-older-boot", ["r11"])  # nothing renewed there
    assert p.held() == ["r10"] and dropped.freed == 1 and p.stats.expired == 1
    assert await collect(consumer, port, "r10", boot_id=p.boot_id) == kept.data
    await wait_freed(p, kept, within_s=1.0)
    await consumer.close(); await p.close()


async def test_a_restarted_producer_is_detected_by_its_boot_id_and_stale_connections_dropped():
    p = KVProducer(FP, token=TOKEN)
    port = await p.start()
    consumer = KVConsumer(FP, token=TOKEN)
    blocks = Published(8, 1)
    p.publish("r8", blocks.read, blocks.free)
    p.progress("r8", 1, complete=True)
    assert await collect(consumer, port, "r8", boot_id=p.boot_id) == blocks.data
    old_boot = p.boot_id
    await p.close()
    restarted = KVProducer(FP, token=TOKEN)
    await restarted.start(port=port)
    with pytest.raises(TransferError) as e:  # the request was prefilled by the process that died
        await collect(consumer, port, "r8", boot_id=old_boot)
    assert e.value.kind == "restarted"
    fresh = Published(9, 2)
    restarted.publish("r9", fresh.read, fresh.free)
    restarted.progress("r9", 2, complete=True)
    assert await collect(consumer, port, "r9", boot_id=restarted.boot_id) == fresh.data
    await consumer.close(); await restarted.close()


async def test_a_producer_killed_mid_pull_fails_it_at_once_and_one_that_goes_silent_times_out():
    p = KVProducer(FP, token=TOKEN)
    port = await p.start()
    blocks = Published(10, 4)
    p.publish("r10", blocks.read, blocks.free)
    p.progress("r10", 1)
    consumer = KVConsumer(FP, token=TOKEN, read_timeout_s=0.3)
    frames = consumer.pull("127.0.0.1", port, "r10")
    await anext(frames)
    started = time.monotonic()
    with pytest.raises(TransferError) as e:  # silent: the prefill never goes on
        await anext(frames)
    assert e.value.kind == "connection" and time.monotonic() - started < 2
    blocks2 = Published(11, 4)
    p.publish("r11", blocks2.read, blocks2.free)
    p.progress("r11", 1)
    frames = KVConsumer(FP, token=TOKEN, read_timeout_s=30).pull("127.0.0.1", port, "r11")
    await anext(frames)
    closing = asyncio.create_task(p.close())  # killed: every connection cut, every block freed
    with pytest.raises(TransferError) as e:
        await asyncio.wait_for(anext(frames), 5)
    assert e.value.kind in ("connection", "truncated")
    await closing
    assert blocks2.freed == 1 and p.held() == []
    with pytest.raises(TransferError) as e:
        await collect(consumer, port, "r11")
    assert e.value.kind == "connection"
    await consumer.close()


async def test_a_pull_abandoned_midway_hands_its_lease_back_at_once(producer):
    p, port = producer  # a 30 s lease: only the release can free it this soon
    blocks = Published(13, 8)
    p.publish("r13", blocks.read, blocks.free)
    p.progress("r13", 2)  # the prefill goes on: the stream waits for more
    consumer = KVConsumer(FP, token=TOKEN)
    async for _frame in consumer.pull("127.0.0.1", port, "r13"):
        break  # the decode side gives up (its request was aborted)
    await wait_freed(p, blocks, within_s=2)
    for _ in range(50):  # and the abandoned connection is gone on both sides
        if len(p._connections) == 0:
            break
        await asyncio.sleep(0.02)
    assert len(p._connections) == 0 and consumer._idle.get(("127.0.0.1", port), []) == []


async def test_a_restarted_producer_is_never_told_to_release_an_id_it_may_hold_anew():
    p = KVProducer(FP, token=TOKEN)
    port = await p.start()
    consumer = KVConsumer(FP, token=TOKEN)
    blocks = Published(14, 1)
    p.publish("r14", blocks.read, blocks.free)
    p.progress("r14", 1, complete=True)
    old = p.boot_id
    await p.close()
    restarted = KVProducer(FP, token=TOKEN)
    await restarted.start(port=port)
    again = Published(15, 1)
    restarted.publish("r14", again.read, again.free)  # the same id, prefilled anew by the new process
    with pytest.raises(TransferError) as e:
        await collect(consumer, port, "r14", boot_id=old)
    assert e.value.kind == "restarted"
    await asyncio.sleep(0.2)
    assert restarted.held() == ["r14"] and again.freed == 0
    await consumer.close(); await restarted.close()


async def read_frame(reader: asyncio.StreamReader) -> dict:
    return protocol.decode(await reader.readexactly(protocol.header_length(await reader.readexactly(4))))


async def fake_producer(fingerprint: Fingerprint, then: bytes = b"", token: str | None = TOKEN,
                        heard: list | None = None) -> tuple[asyncio.Server, int]:
    """A server that runs the producer's side of the handshake with ``token`` (None: it has none)
    and welcomes with ``fingerprint``, then writes ``then`` and waits; ``heard`` collects the
    frames the consumer sent."""
    async def handle(reader, writer):
        try:
            hello = await read_frame(reader)
            frame, nonce_p = handshake.challenge(token, hello["nonce"])
            writer.write(frame)
            auth = await read_frame(reader)
            if heard is not None:
                heard.extend([hello, auth])
            writer.write(handshake.welcome(token or "x", hello["nonce"], nonce_p, fingerprint, "b") + then)
            await writer.drain()
            await reader.read()  # until the consumer closes
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_the_consumer_believes_neither_a_foreign_welcome_nor_a_frame_that_lies_about_its_size():
    server, port = await fake_producer(dataclasses.replace(FP, num_layers=3))
    with pytest.raises(TransferError) as e:
        await collect(KVConsumer(FP, token=TOKEN), port, "r")
    assert e.value.kind == "incompatible" and "num_layers" in str(e.value)
    server.close()
    huge = protocol.encode("blocks", request_id="r", first_block=0, num_blocks=1, first_layer=0,
                           num_layers=FP.num_layers, nbytes=2**30, crc32c=0)
    server, port = await fake_producer(FP, then=huge)  # announces 1 GiB and sends none of it
    started = time.monotonic()
    with pytest.raises(TransferError) as e:
        await collect(KVConsumer(FP, token=TOKEN, read_timeout_s=30), port, "r")
    assert e.value.kind == "protocol" and time.monotonic() - started < 2  # refused at the header
    server.close()


# -- the selective rule -------------------------------------------------------------------------


def test_the_threshold_is_where_the_saved_prefill_time_pays_for_the_fixed_cost():
    # 100 us of decode-replica time per prompt token; KV of 128 KiB/token over 50 GB/s: 2.6 us
    assert min_prompt_tokens(1e-4, 0.0, 131072, 50e9, fixed_s=0.05) == 514
    assert min_prompt_tokens(1e-4, 0.0, 131072, 1e9, fixed_s=0.05) is None  # the link costs more than the prefill


def test_with_an_attention_term_a_long_enough_prompt_always_pays_and_one_token_shorter_does_not():
    c_p, c_pa, b, bw, c = 2e-5, 1e-8, 131072, 1e9, 0.01  # the link (131 us/token) is slower than c_p

    def saved(n):
        return c_p * n + c_pa * n * n / 2 - n * b / bw - c

    n = min_prompt_tokens(c_p, c_pa, b, bw, fixed_s=c)
    assert n is not None and saved(n) >= 0 > saved(n - 1)
    assert min_prompt_tokens(c_p, c_pa, b, bw, fixed_s=0.0) == 22215  # where the attention term outgrows the link
    assert min_prompt_tokens(c_p, c_pa, b, 50e9, fixed_s=0.0) == 1  # a fast link and no fixed cost: every prompt


def test_the_threshold_refuses_nonsense():
    with pytest.raises(ValueError):
        min_prompt_tokens(-1e-4, 0.0, 1, 1e9)
    with pytest.raises(ValueError):
        min_prompt_tokens(1e-4, 0.0, 1, 0.0)


def test_an_engine_computes_its_rule_once_its_cost_model_is_calibrated_and_from_its_measured_link():
    from types import SimpleNamespace

    from cadenza.node.core.cost_model import StepCostModel, StepFeatures
    from cadenza.node.engine.kv_link import ASSUMED_LINK_BYTES_PER_S, KVLink

    cost = StepCostModel()
    consumer = SimpleNamespace(bandwidth=None)
    link = SimpleNamespace(consumer=consumer, fingerprint=FP)  # what rule() reads of a KVLink
    assert KVLink.rule(link, cost) is None  # not calibrated: the gateway moves nothing
    for i in range(16):  # 2 ms a step, 20 us a prefill token, 10 ns a prefill attention pair
        n, decode = 16 * (i % 5 + 1), i % 3
        cost.observe(StepFeatures(n, decode, 100 * decode, n * n / 2), 0.002 + 2e-5 * n + 1e-8 * n * n / 2)
    rule = KVLink.rule(link, cost)
    assert rule.local_tokens == 1  # the prompt's last token is computed where it decodes
    assert rule.transfer_s_per_token == FP.bytes_per_token / ASSUMED_LINK_BYTES_PER_S
    expected = min_prompt_tokens(float(cost.coef[1]), float(cost.coef[4]), FP.bytes_per_token, ASSUMED_LINK_BYTES_PER_S)
    assert rule.min_prompt_tokens() == expected + 1 and 300 < expected < 1000
    consumer.bandwidth = 1e5  # a slow link measured: moving a token costs more; only far longer prompts pay
    assert KVLink.rule(link, cost).min_prompt_tokens() > rule.min_prompt_tokens()


def test_a_prefill_queue_raises_the_threshold_by_what_it_costs():
    rule = Rule(1e-4, 1e-8, 2e-5, local_tokens=16, fixed_s=0.01)

    def saved(n, queue_s):  # the interference avoided less what moving costs, for m = n - 16 tokens moved
        m = n - 16
        return 1e-4 * m + 1e-8 * m * m / 2 - 2e-5 * m - 0.01 - queue_s

    queue_s = rule.queue_s(2000, 2000 * 2000 / 2)  # one 2,000-token prompt ahead: 0.2 + 0.02 s
    assert queue_s == pytest.approx(0.22)
    for q in (0.0, queue_s):
        n = rule.min_prompt_tokens(q)
        assert saved(n, q) >= 0 > saved(n - 1, q)
    assert rule.min_prompt_tokens(queue_s) > rule.min_prompt_tokens() > 16
    with pytest.raises(ValueError):
        rule.min_prompt_tokens(-1.0)


def test_a_rule_crosses_a_header_whole_and_a_bad_header_reads_as_none():
    rule = Rule(1.25e-4, 3e-9, 2.1e-6, local_tokens=16, fixed_s=0.01)
    assert Rule.from_header(rule.header()) == rule
    for bad in (None, "", "c_p=1", rule.header() + ";c_p=1", rule.header().replace("l=16", "l=1.5"),
                rule.header().replace("c_p=0.000125", "c_p=-1"), rule.header().replace("c_p=0.000125", "c_p=nan"),
                "x" * 300, "junk"):
        assert Rule.from_header(bad) is None, bad
    with pytest.raises(ValueError):
        Rule(-1.0, 0.0, 0.0)
