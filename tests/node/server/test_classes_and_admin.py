"""Traffic-class and tenant headers, overload refusals, and the live admin configuration API."""

from __future__ import annotations

import asyncio

import pytest

from cadenza.node.core.config import CacheConfig, EngineConfig, SchedulerConfig
from cadenza.node.core.policy import ClassPolicy, Policy, TenantPolicy, default_class_policies
from cadenza.node.server.auth import TOKEN_ENV, TOKEN_FILE_ENV
from cadenza.node.server.app import create_app
from cadenza.node.server.app_keys import ENGINE
from step_gate import StepGate
from waiting import until

MODEL = "tiny"
TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
async def client(aiohttp_client, tiny_llama_dir, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    policy = Policy(
        classes={**default_class_policies(), "background": ClassPolicy(max_queue_depth=1)},
        tenants={"capped": TenantPolicy(max_concurrent=1)},
    )
    config = EngineConfig(
        model=str(tiny_llama_dir), served_model_name=MODEL,
        scheduler=SchedulerConfig(token_budget=64, chunk_size=16, max_num_seqs=2, max_model_len=1024, policy=policy),
        cache=CacheConfig(block_size=16, num_kv_blocks=128),
    )
    app = create_app(config, MODEL, default_class="batch")
    client = await aiohttp_client(app)
    await app[ENGINE].wait_ready()
    return client


def body(**extra):
    return {"model": MODEL, "prompt": "Hello there", "max_tokens": 3, "temperature": 0, **extra}


async def test_class_and_tenant_headers_route_the_request(client):
    resp = await client.post("/v1/completions", json=body(), headers={"x-cadenza-class": "interactive",
                                                                    "x-cadenza-tenant": "acme"})
    assert resp.status == 200
    stats = client.app[ENGINE].stats()
    assert stats.classes["interactive"].prefill_tokens > 0
    assert client.app[ENGINE].core.scheduler.stats.prefill_tokens_by_tenant["acme"] > 0


async def test_requests_without_a_class_header_take_the_server_default(client):
    assert (await client.post("/v1/completions", json=body())).status == 200
    assert client.app[ENGINE].stats().classes["batch"].prefill_tokens > 0


@pytest.mark.parametrize("header, value", [("x-cadenza-class", "urgent"), ("x-cadenza-tenant", "no spaces please")])
async def test_invalid_class_or_tenant_header_is_a_400(client, header, value):
    resp = await client.post("/v1/completions", json=body(), headers={header: value})
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == header
    assert (await client.post("/v1/completions", json=body())).status == 200


def slow_steps(client, monkeypatch, seconds: float = 0.02) -> StepGate:
    """Each step takes ``seconds`` more (long requests stay running while a test looks)."""
    return StepGate(client.app[ENGINE].core.runner, monkeypatch, delay_s=seconds)


async def test_a_full_queue_is_refused_at_once_with_429_and_retry_after(client, monkeypatch):
    gate = slow_steps(client, monkeypatch)
    sched = client.app[ENGINE].core.scheduler
    long = body(max_tokens=500, ignore_eos=True)
    busy = [asyncio.ensure_future(client.post("/v1/completions", json=long)) for _ in range(2)]  # both slots
    await until(lambda: sched.num_running == 2)
    queued = asyncio.ensure_future(client.post("/v1/completions", json=long, headers={"x-cadenza-class": "background"}))
    await until(lambda: len(sched.queues["background"]) == 1)  # the background queue (depth 1) is full
    # ... and the front end knows it from the stats the core publishes (every 0.2 s while busy)
    await until(lambda: client.app[ENGINE].stats().classes["background"].waiting == 1)
    gate.hold()
    try:
        await gate.held()  # no step can end, so no answer below can have waited for one
        resp = await asyncio.wait_for(
            client.post("/v1/completions", json=body(), headers={"x-cadenza-class": "background"}), 30)
        assert resp.status == 429 and gate.is_held  # at once: answered while the engine was inside a step
    finally:
        gate.release()
    assert int(resp.headers["Retry-After"]) >= 1
    error = (await resp.json())["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "queue_full"
    assert client.app[ENGINE].stats().rejected["queue_full"] == 1  # refused on the HTTP thread, counted
    for task in (*busy, queued):
        task.cancel()
    await until(lambda: sched.num_running == 0 and sched.num_waiting == 0)
    assert (await client.post("/v1/completions", json=body())).status == 200  # nothing was lost or stuck


async def test_a_tenant_over_its_concurrency_quota_gets_429(client, monkeypatch):
    slow_steps(client, monkeypatch)
    sched = client.app[ENGINE].core.scheduler
    headers = {"x-cadenza-tenant": "capped"}
    slow = asyncio.ensure_future(client.post("/v1/completions", json=body(max_tokens=500, ignore_eos=True),
                                             headers=headers))
    await until(lambda: sched.tenant_live.get("capped", 0) == 1)
    resp = await client.post("/v1/completions", json=body(), headers=headers)
    assert resp.status == 429 and (await resp.json())["error"]["code"] == "tenant_concurrency"
    assert (await client.post("/v1/completions", json=body(), headers={"x-cadenza-tenant": "free"})).status == 200
    slow.cancel()


# -- /admin/config ----------------------------------------------------------------------------------


async def test_admin_config_needs_the_bearer_token(client):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
        resp = await client.get("/admin/config", headers=headers)
        assert resp.status == 401 and resp.headers["WWW-Authenticate"].startswith("Bearer")
        assert (await client.put("/admin/config", json={"token_budget": 32}, headers=headers)).status == 401
    assert (await client.get("/admin/config", headers=AUTH)).status == 200


async def test_admin_config_is_disabled_without_a_configured_token(client, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV)
    resp = await client.get("/admin/config", headers=AUTH)
    assert resp.status == 401 and "disabled" in (await resp.json())["error"]["message"]


async def test_the_token_may_come_from_a_mounted_secret_file(client, monkeypatch, tmp_path):
    monkeypatch.delenv(TOKEN_ENV)
    secret = tmp_path / "token"
    secret.write_text("from-a-secret\n")
    monkeypatch.setenv(TOKEN_FILE_ENV, str(secret))
    assert (await client.get("/admin/config", headers={"Authorization": "Bearer from-a-secret"})).status == 200


async def test_put_changes_knobs_live_from_the_next_step(client):
    change = {"token_budget": 32, "chunk_size": 8, "step_time_target_ms": 250,
              "classes": {"batch": {"max_prefill_tokens": 8}}, "tenants": {"gold": {"weight": 3}}}
    resp = await client.put("/admin/config", json=change, headers=AUTH)
    assert resp.status == 200, await resp.text()
    view = await resp.json()
    assert view["token_budget"] == 32 and view["chunk_size"] == 8 and view["step_time_target_ms"] == 250
    assert view["classes"]["batch"]["max_prefill_tokens"] == 8 and view["tenants"]["gold"]["weight"] == 3
    config = client.app[ENGINE].core.scheduler.config
    assert config.token_budget == 32 and config.policy.tenant("gold").weight == 3
    assert (await client.get("/admin/config", headers=AUTH)).status == 200
    assert (await client.post("/v1/completions", json=body())).status == 200


@pytest.mark.parametrize("change", [
    {"token_budget": 0}, {"chunk_size": -4}, {"classes": {"batch": {"min_share": 1.5}}},
    {"tenants": {"gold": {"weight": -1}}}, {"turbo": True}, {"max_model_len": 64}, [], {},
    {"tenants": {"gold": {"weight": None}}}, {"default_tenant": {"weight": None}},
    {"step_time_target_ms": float("inf")}, {"watermark": False},
])
async def test_invalid_changes_are_a_400_and_nothing_changes(client, change):
    before = await (await client.get("/admin/config", headers=AUTH)).json()
    resp = await client.put("/admin/config", json=change, headers=AUTH)
    assert resp.status == 400 and (await resp.json())["error"]["message"]
    assert await (await client.get("/admin/config", headers=AUTH)).json() == before


async def test_context_limits_at_max_model_len_1024(client):
    """A 1,025-token prompt is a 400; 1,000 tokens + max_tokens 100 is a 400; the server stays up."""
    resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 1025, "max_tokens": 1})
    assert resp.status == 400 and (await resp.json())["error"]["code"] == "context_length_exceeded"
    resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 1000, "max_tokens": 100})
    assert resp.status == 400 and "1024" in (await resp.json())["error"]["message"]
    resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": [], "max_tokens": 1})
    assert resp.status == 400  # a 0-token prompt
    assert (await client.post("/v1/completions", json=body())).status == 200


ODD_CHANGES = [  # (change, status): spellings, types and cases an operator might really send
    ({"classes": {"Batch": {"max_prefill_tokens": 64}}}, 200),
    ({"classes": {" INTERACTIVE ": {"max_queue_depth": 10}}}, 200),
    ({"classes": {"batch": {}, "BATCH": {}}}, 400),
    ({"classes": {"urgent": {}}}, 400),
    ({"classes": {"": {}}}, 400),
    ({"classes": []}, 400),
    ({"classes": "batch"}, 400),
    ({"classes": {"batch": []}}, 400),
    ({"classes": {"batch": None}}, 400),
    ({"classes": {"batch": {"min_share": "0.1"}}}, 400),
    ({"classes": {"batch": {"min_share": None}}}, 400),
    ({"classes": {"batch": {"Min_Share": 0.1}}}, 400),
    ({"classes": {"batch": {"max_prefill_tokens": True}}}, 400),
    ({"classes": {"batch": {"max_prefill_tokens": 2.5}}}, 400),
    ({"classes": {"batch": {"max_queue_age_s": {"s": 1}}}}, 400),
    ({"classes": {"batch": {"max_queue_depth": 10**30}}}, 200),
    ({"tenants": {"Gold": {"weight": 2}}}, 200),
    ({"tenants": {"gold": None}}, 200),
    ({"tenants": {"": {}}}, 400),
    ({"tenants": {"x y": {}}}, 400),
    ({"tenants": {"x": 3}}, 400),
    ({"tenants": []}, 400),
    ({"tenants": {"x": {"weight": "heavy"}}}, 400),
    ({"default_tenant": None}, 400),
    ({"default_tenant": {"weight": 0}}, 400),
    ({"default_tenant": []}, 400),
    ({"token_budget": "512"}, 400),
    ({"token_budget": -1}, 400),
    ({"token_budget": 1.5}, 400),
    ({"token_budget": True}, 400),
    ({"token_budget": None}, 400),
    ({"Token_Budget": 64}, 400),
    ({"chunk_size": None}, 200),
    ({"chunk_size": 0}, 400),
    ({"chunk_size": "none"}, 400),
    ({"max_num_seqs": [1]}, 400),
    ({"prefix_caching": "yes"}, 400),
    ({"prefix_caching": 1}, 400),
    ({"step_time_target_ms": "fast"}, 400),
    ({"step_time_target_ms": None}, 200),
    ({"max_preemptions": -1}, 400),
    ({"max_preemptions": 2.5}, 400),
    ({"watermark": 0.5}, 400),
    ({"watermark": "0.1"}, 400),
    ({"max_model_len": 10}, 400),
    ({"classes": {"batch": {"a": {"b": {"c": [1, {"d": None}]}}}}}, 400),
    ([], 400), ("token_budget", 400), (5, 400), (None, 400), ({}, 400),
]


async def test_odd_admin_changes_get_an_answer_and_the_server_keeps_serving(client):
    """Every admin key with odd spellings, types and cases: each PUT answers 200 or 400 at once,
    and afterwards the engine still serves, healthy."""
    for change, status in ODD_CHANGES:
        resp = await asyncio.wait_for(client.put("/admin/config", json=change, headers=AUTH), timeout=30)
        assert resp.status == status, (change, await resp.text())
        if status == 400:
            assert (await resp.json())["error"]["message"]
    view = await (await client.get("/admin/config", headers=AUTH)).json()
    assert view["classes"]["batch"]["max_prefill_tokens"] == 64  # "Batch" reached batch
    assert view["classes"]["interactive"]["max_queue_depth"] == 10
    for raw in (b"{not json", b"\xff\xfe", b'{"classes": ' * 100_000):
        resp = await client.put("/admin/config", data=raw, headers=AUTH)
        assert resp.status == 400
    assert (await client.post("/v1/completions", json=body())).status == 200
    assert (await client.get("/health")).status == 200 and client.app[ENGINE].is_alive


@pytest.mark.parametrize("change", [{"chunk_size": 100000}, {"token_budget": 8}, {"token_budget": 32, "chunk_size": 48}])
async def test_a_live_chunk_over_the_token_budget_is_a_400_naming_it_and_nothing_changes(client, change):
    before = await (await client.get("/admin/config", headers=AUTH)).json()
    resp = await client.put("/admin/config", json=change, headers=AUTH)
    assert resp.status == 400
    assert (await resp.json())["error"]["message"].startswith("chunk_size: ")
    assert await (await client.get("/admin/config", headers=AUTH)).json() == before
    config = client.app[ENGINE].core.scheduler.config
    assert (config.token_budget, config.chunk_size) == (64, 16)


async def test_a_tenant_map_over_the_limit_is_a_400_and_nothing_changes(client):
    from cadenza.node.core.policy import MAX_TENANTS

    before = await (await client.get("/admin/config", headers=AUTH)).json()
    for count in (MAX_TENANTS + 1, 100_000):
        resp = await client.put("/admin/config", json={"tenants": {f"t{i}": {"weight": 2} for i in range(count)}},
                                headers=AUTH)
        assert resp.status == 400
        assert f"at most {MAX_TENANTS} tenants" in (await resp.json())["error"]["message"]
    assert await (await client.get("/admin/config", headers=AUTH)).json() == before
    full = {f"t{i}": {"weight": 2, "max_concurrent": 4} for i in range(MAX_TENANTS - 1)}  # "capped" is listed already
    resp = await client.put("/admin/config", json={"tenants": full}, headers=AUTH)
    assert resp.status == 200 and len((await resp.json())["tenants"]) == MAX_TENANTS
    assert (await client.post("/v1/completions", json=body(), headers={"x-cadenza-tenant": "t7"})).status == 200
    assert (await (await client.get("/ready")).json())["tenants"] == {}  # nothing live: no tenant to show


async def test_a_bug_in_an_engine_command_is_a_500_and_the_engine_goes_on(client, monkeypatch):
    engine = client.app[ENGINE].core

    def broken_reconfigure(changes):
        raise KeyError("a bug")

    monkeypatch.setattr(engine, "reconfigure", broken_reconfigure)
    resp = await client.put("/admin/config", json={"token_budget": 32}, headers=AUTH)
    assert resp.status == 500 and "KeyError" in (await resp.json())["error"]["message"]
    original_add = engine.add_request
    calls = []

    def add_once_broken(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 1:
            original_add(*args, **kwargs)  # half-added, then a bug
            raise AttributeError("another bug")
        return original_add(*args, **kwargs)

    monkeypatch.setattr(engine, "add_request", add_once_broken)
    resp = await client.post("/v1/completions", json=body())
    assert resp.status == 500 and "AttributeError" in (await resp.json())["error"]["message"]
    await until(lambda: not engine.scheduler.requests)  # the half-added request was dropped
    assert engine.block_manager.num_used_blocks == 0
    assert (await client.post("/v1/completions", json=body())).status == 200
    assert (await client.get("/health")).status == 200


async def test_a_policy_file_may_name_classes_in_any_case(tmp_path):
    from cadenza.node.cli import build_parser, engine_config_from_args

    policy = tmp_path / "policy.yaml"
    policy.write_text("classes:\n  Batch: {min_share: 0.2}\n  BACKGROUND: {max_queue_depth: 7}\n")
    args = build_parser().parse_args(["serve", "--model", str(tmp_path), "--policy", str(policy)])
    config = engine_config_from_args(args)
    assert config.scheduler.policy.classes["batch"].min_share == 0.2
    assert config.scheduler.policy.classes["background"].max_queue_depth == 7
