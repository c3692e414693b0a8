"""Bodies pass through chunk by chunk; disconnects and mid-stream failures close the right ends."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from cadenza.gateway.state import UPSTREAMS
from waiting import until

STREAM = {"model": "fake", "prompt": "hi", "max_tokens": 5, "stream": True}


async def test_sse_chunks_reach_the_client_as_the_replica_sends_them(start_replica, start_gateway):
    replica = await start_replica("r", chunks=5, paced=True)  # each event waits until the client has the last
    gateway = await start_gateway({"interactive": [replica.url], "batch": [replica.url]})
    resp = await gateway.post("/v1/completions", json=STREAM)
    assert resp.status == 200
    assert resp.headers["content-type"] == "text/event-stream"
    assert resp.headers["x-request-id"] == "r-1"
    events = []
    async with asyncio.timeout(30):  # a gateway that buffered would never pass the first event on
        async for line in resp.content:
            if line.startswith(b"data: "):
                events.append(line[6:].strip())
                if events[-1] != b"[DONE]":
                    # This event reached the client while the replica held the next one back.
                    assert len(replica.sent_at) == len(events)
                    replica.send_next.release()
    assert events[-1] == b"[DONE]"
    assert [json.loads(e)["i"] for e in events[:-1]] == [0, 1, 2, 3, 4]


async def test_a_client_that_disconnects_closes_the_upstream_request(start_replica, start_gateway):
    replica = await start_replica("r", chunks=5, paced=True)  # only a disconnect can end its stream early
    gateway = await start_gateway({"interactive": [replica.url], "batch": [replica.url]})
    resp = await gateway.post("/v1/completions", json=STREAM)
    assert (await resp.content.readline()).startswith(b"data: ")
    resp.close()  # drop the connection mid-stream
    async with asyncio.timeout(30):
        await replica.disconnected.wait()
    await until(lambda: not replica.in_flight)
    view = await (await gateway.get("/gateway/upstreams")).json()
    assert view["roles"]["interactive"][0]["outstanding"] == 0


async def test_a_replica_dying_mid_stream_truncates_the_stream_without_a_retry(start_replica, start_gateway):
    dying = await start_replica("dying", chunks=5, mode="die", die_after=2)
    spare = await start_replica("spare", chunks=5)
    gateway = await start_gateway({"interactive": [dying.url, spare.url], "batch": [spare.url]})
    # Make the dying replica the first choice: the spare is busier.
    gateway.app[UPSTREAMS].of_role("interactive")[1].outstanding = 1
    resp = await gateway.post("/v1/completions", json=STREAM)
    assert resp.status == 200
    data = b""
    try:
        async for chunk in resp.content.iter_any():
            data += chunk
    except aiohttp.ClientPayloadError:
        pass  # the body ended without its final chunk: truncated, as it should read
    events = [line[6:] for line in data.decode().splitlines() if line.startswith("data: ")]
    assert [json.loads(e).get("i") for e in events[:2]] == [0, 1]
    assert json.loads(events[2])["error"]["code"] == "upstream_stream_interrupted"
    assert "[DONE]" not in events
    assert spare.calls == 0  # never retried once bytes had reached the client
