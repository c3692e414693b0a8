"""``cadenza gateway`` options, clear refusals of bad configurations, and a real process's signals."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import sys

import aiohttp
import pytest

from cadenza.gateway import cli
from cadenza.gateway.file_source import FileSource
from cadenza.gateway.state import SETTINGS
from cadenza.node.http.hardening import HttpTimeouts, http_timeouts_from_args

# Runs the gateway as its own process, as the lead's `cadenza gateway` subcommand will.
MAIN = ("import argparse, sys; from cadenza.gateway import cli; p = argparse.ArgumentParser(); "
        "cli.add_arguments(p); sys.exit(cli.run(p.parse_args()))")


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_options_and_their_defaults():
    args = parse("--config", "gw.yaml")
    assert (args.host, args.port, args.default_class, args.max_outstanding, args.kubernetes) == (
        "127.0.0.1", 8000, None, None, False)
    args = parse("--kubernetes", "--namespace", "ns", "--pool", "chat", "--default-class", "Batch",
                 "--max-outstanding", "16", "--port", "9000")
    assert (args.namespace, args.pool, args.default_class, args.max_outstanding) == ("ns", "chat", "batch", 16)
    assert parse("--config", "gw.yaml", "--slo-targets-ms", "500,80").slo_targets_ms == (0.5, 0.08)


def test_http_timeout_options_reach_the_gateway():
    assert http_timeouts_from_args(parse("--config", "gw.yaml")) == HttpTimeouts()
    args = parse("--config", "gw.yaml", "--header-timeout-s", "3", "--idle-timeout-s", "120", "--body-timeout-s", "20")
    assert http_timeouts_from_args(args) == HttpTimeouts(3, 120, 20)
    with pytest.raises(SystemExit):
        parse("--config", "gw.yaml", "--idle-timeout-s", "0")


@pytest.mark.parametrize("argv", [(), ("--config", "a", "--kubernetes"), ("--config", "a", "--max-outstanding", "0"),
                                  ("--config", "a", "--default-class", "urgent"),
                                  ("--config", "a", "--slo-targets-ms", "500,x"),
                                  ("--config", "a", "--slo-targets-ms", "0")])
def test_bad_options_are_refused_by_the_parser(argv):
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == 2


def test_command_line_settings_override_the_config_file(tmp_path):
    path = tmp_path / "gw.json"
    path.write_text(json.dumps({"roles": {"interactive": ["http://a:1"]}, "default_class": "batch",
                                "max_outstanding": 3}))
    app, _ = cli.build_gateway(parse("--config", str(path)))
    assert (app[SETTINGS].default_class, app[SETTINGS].max_outstanding) == ("batch", 3)
    app, _ = cli.build_gateway(parse("--config", str(path), "--max-outstanding", "9", "--default-class", "background"))
    assert (app[SETTINGS].default_class, app[SETTINGS].max_outstanding) == ("background", 9)


@pytest.mark.parametrize("content, argv_extra, message", [
    (None, (), "cannot read"),
    ('{"roles": {"fast": ["http://a:1"]}}', (), "unknown role 'fast'"),
    ('{"roles": {}}', ("--pool", "chat"), "--namespace and --pool go with --kubernetes"),
])
def test_a_bad_configuration_exits_2_with_one_clear_line(tmp_path, capsys, content, argv_extra, message):
    path = tmp_path / "gw.json"
    if content is not None:
        path.write_text(content)
    assert cli.run(parse("--config", str(path), *argv_extra)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("cadenza gateway: error:") and message in err and "\n" not in err


def test_kubernetes_mode_needs_a_pool(capsys):
    assert cli.run(parse("--kubernetes")) == 2
    assert "--pool" in capsys.readouterr().err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_a_gateway_process_reloads_on_sighup_and_stops_on_sigterm(tmp_path, start_replica):
    replica = await start_replica("r")
    path = tmp_path / "gw.json"
    first = json.dumps({"roles": {"interactive": [replica.url]}})
    second = json.dumps({"roles": {"interactive": [replica.url], "batch": [replica.url]}})
    path.write_text(first.ljust(len(second)))  # padded to the size of the change below
    port = free_port()
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", MAIN, "--config", str(path), "--port", str(port),
                                                stderr=asyncio.subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            async with asyncio.timeout(60):
                while True:
                    try:
                        async with http.get(f"{base}/health") as resp:
                            if resp.status == 200:
                                break
                    except aiohttp.ClientConnectionError:
                        await asyncio.sleep(0.05)
            async with http.get(f"{base}/ready") as resp:
                assert resp.status == 200 and "batch" in (await resp.json())["unavailable"]  # no batch replica yet
            async with http.post(f"{base}/v1/completions", json={"prompt": "hi"}) as resp:
                assert (await resp.json())["replica"] == "r"

            # Changed in place with its size and mtime kept, the file's stamp is the same: the
            # periodic file check cannot notice, so only the SIGHUP can make the gateway re-read it.
            stamp = path.stat()
            path.write_text(second)
            os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
            assert FileSource(path)._current_stamp() == (stamp.st_mtime_ns, stamp.st_size, stamp.st_ino)
            proc.send_signal(signal.SIGHUP)
            async with asyncio.timeout(30):
                while True:
                    async with http.get(f"{base}/ready") as resp:
                        if not (await resp.json())["unavailable"]:
                            break
                    await asyncio.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(10):
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
