"""The config file: validation, and re-reading it when it changes or on request (SIGHUP)."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from cadenza.gateway.app import create_gateway_app
from cadenza.gateway.config import GatewayConfigError, load_config, parse_config
from cadenza.gateway.file_source import FileSource
from cadenza.gateway.upstreams import Upstreams
from waiting import until

BODY = {"model": "fake", "prompt": "hi", "max_tokens": 2}


def write(path, roles, **extra) -> None:
    """Rewrite the config and move its mtime forward (so coarse-mtime filesystems see a change)."""
    path.write_text(json.dumps({"roles": roles, **extra}))
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))


def test_a_yaml_config_is_read_with_its_settings(tmp_path):
    path = tmp_path / "gateway.yaml"
    path.write_text("roles:\n  interactive: [http://127.0.0.1:9001/]\n  batch:\n    - http://127.0.0.1:9002\n"
                    "default_class: Batch\nmax_outstanding: 8\n")
    config = load_config(path)
    assert config.roles == {"interactive": ["http://127.0.0.1:9001"], "batch": ["http://127.0.0.1:9002"]}
    assert (config.default_class, config.max_outstanding) == ("batch", 8)


@pytest.mark.parametrize("data, message", [
    ([], "must be a mapping"),
    ({"upstreams": {}}, "unknown key"),
    ({"default_class": "batch"}, "'roles' is required"),
    ({"roles": {"fast": []}}, "unknown role 'fast'"),
    ({"roles": {"batch": "http://a:1"}}, "must be a list"),
    ({"roles": {"batch": ["ftp://a:1"]}}, r"roles.batch\[0\]"),
    ({"roles": {"batch": ["http://a:99999"]}}, r"roles.batch\[0\]"),
    ({"roles": {}, "default_class": "urgent"}, "default_class"),
    ({"roles": {}, "max_outstanding": 0}, "max_outstanding"),
])
def test_an_invalid_config_names_the_field(data, message):
    with pytest.raises(GatewayConfigError, match=message):
        parse_config(data, "gw.json")


def test_an_unreadable_file_is_a_config_error(tmp_path):
    with pytest.raises(GatewayConfigError, match="cannot read"):
        load_config(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{roles: [")
    with pytest.raises(GatewayConfigError, match="cannot read"):
        load_config(tmp_path / "bad.json")


async def test_a_changed_file_is_picked_up_and_a_broken_one_keeps_the_last_upstreams(tmp_path):
    path = tmp_path / "gateway.json"
    write(path, {"interactive": ["http://a:1"], "batch": ["http://b:1"]})
    table = Upstreams()
    source = FileSource(path, interval_s=0.02)
    reloads = count_reloads(source)
    watching = asyncio.create_task(source.watch(table))
    try:
        await wait_for_urls(table, {"interactive": ["http://a:1"], "batch": ["http://b:1"]})
        write(path, {"interactive": ["http://a:2"], "batch": ["http://b:1"]})
        await wait_for_urls(table, {"interactive": ["http://a:2"], "batch": ["http://b:1"]})
        before = len(reloads)
        path.write_text("{not json")
        await until(lambda: len(reloads) > before, what="the broken file to be re-read")
        assert reloads[-1] is False  # read, refused
        assert table.urls() == {"interactive": ["http://a:2"], "batch": ["http://b:1"]}
    finally:
        watching.cancel()


async def test_a_reload_request_rereads_at_once(tmp_path):
    path = tmp_path / "gateway.json"
    write(path, {"interactive": ["http://a:1"]})
    table = Upstreams()
    source = FileSource(path, interval_s=3600)
    watching = asyncio.create_task(source.watch(table))
    try:
        await wait_for_urls(table, {"interactive": ["http://a:1"], "batch": []})
        path.write_text(json.dumps({"roles": {"interactive": ["http://a:1"], "batch": ["http://b:7"]}}))
        source.request_reload()  # what SIGHUP does
        await wait_for_urls(table, {"interactive": ["http://a:1"], "batch": ["http://b:7"]})
    finally:
        watching.cancel()


async def test_the_gateway_routes_to_replicas_added_to_its_config_file(tmp_path, start_replica, aiohttp_client):
    old, new = await start_replica("old"), await start_replica("new")
    path = tmp_path / "gateway.json"
    write(path, {"interactive": [old.url], "batch": [old.url]})
    table = Upstreams()
    gateway = await aiohttp_client(create_gateway_app(table, source=FileSource(path, interval_s=0.02)))
    await wait_for_urls(table, {"interactive": [old.url], "batch": [old.url]})
    assert (await (await gateway.post("/v1/completions", json=BODY)).json())["replica"] == "old"

    write(path, {"interactive": [new.url], "batch": [new.url]})  # the replica restarted on a new port
    await wait_for_urls(table, {"interactive": [new.url], "batch": [new.url]})
    assert (await (await gateway.post("/v1/completions", json=BODY)).json())["replica"] == "new"


async def wait_for_urls(table: Upstreams, expected: dict) -> None:
    await until(lambda: table.urls() == expected, what=f"the upstreams to become {expected}")


def count_reloads(source: FileSource) -> list[bool]:
    """What each re-read of the file returned (whether the upstreams changed), in order."""
    results: list[bool] = []
    original = source.reload

    def reload(upstreams: Upstreams) -> bool:
        results.append(original(upstreams))
        return results[-1]

    source.reload = reload
    return results
