"""``cadenza up``: a ServingPool on one machine — replicas as local processes behind the gateway.

The same YAML as in a cluster, validated against the same CRD schema, read through the same
:class:`~cadenza.pool.spec.Pool` view: each role's replicas run ``cadenza serve`` with the
role's flags and policy document on free ports of 127.0.0.1, and ``cadenza gateway`` routes each
class to its role on the chosen address. The supervisor waits until every replica is ready,
restarts one that dies (on the same port, with backoff), and on Ctrl-C or SIGTERM stops the
gateway, then the replicas (SIGTERM, then SIGKILL after a grace period). Logs and the generated
configuration go to a run folder it prints.

The admin token (:func:`choose_admin_token`): the user's, when ``$CADENZA_ADMIN_TOKEN`` (or the file
named by ``$CADENZA_ADMIN_TOKEN_FILE``) is set where ``cadenza up`` runs, given to every replica
(and to the gateway of a disaggregated pool); else, in ``auto`` and ``disaggregated`` mode, which
need one, a per-run token written to ``admin-token`` in the run folder; else none (each replica's
admin API is off). At start, ``cadenza up`` logs each replica's address and whether its
``/admin/config`` is on and with which token: the gateway does not proxy the admin API (it is per
replica) and does not list the replicas' addresses.

With ``mode: auto`` every replica starts colocated, and the same SLO controller as the operator's
keeps the pool's SLOs by retuning and moving replicas in place (:mod:`.actuation`) through
their admin API; each decision is logged and the state file shows the shape (``shape``:
replicas per role). Unless ``spec.controller.disaggregate`` is false, every replica also opens a
KV transfer endpoint and the gateway holds the admin token, so a replica the controller moves into
the prefill role prefills the long prompts the gateway moves (threshold
``disaggregated.minPromptTokens``, else ``auto``) and every other one can pull their KV.

With ``mode: disaggregated`` the prefill and decode replicas each open a KV transfer endpoint (a
free port, announced per request) and share the admin token with the gateway, which sends every
class to the decode replicas and long prompts through a prefill replica first.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from cadenza.node.core.config import listen_problem as port_problem
from cadenza.node.credentials import TOKEN_ENV, TOKEN_FILE_ENV
from cadenza.control.loop import ControlLoop
from cadenza.control.roles import shape_doc, shape_of
from cadenza.local.actuation import local_loop
from cadenza.pool.spec import Pool, PoolSpecError
from cadenza.pool.spec import cpu_threads
from cadenza.local.process import Process, free_port

logger = logging.getLogger("cadenza.up")
GRACE_S = 30.0
MAX_BACKOFF_S = 30.0
RUN_TOKEN_FILE = "admin-token"  # the per-run token, in the run folder (mode 0600)
MODES_WITH_TOKEN = ("auto", "disaggregated")  # the controller's admin calls; the KV transfer headers


class AdminToken(NamedTuple):
    """The admin token of a local pool and where it came from.

    Attributes:
        value: the bearer token; None when the replicas' admin API is off.
        source: ``"env"`` (``$CADENZA_ADMIN_TOKEN``), ``"file"`` (``$CADENZA_ADMIN_TOKEN_FILE``),
            ``"run"`` (generated for this run) or ``"none"``.
    """

    value: str | None
    source: str

    def describe(self, run_dir: Path) -> str:
        """How a user reaches a replica's ``/admin/config`` with it, for the start-up log."""
        if self.source in ("env", "file"):
            return f"on, with your token ({TOKEN_ENV if self.source == 'env' else TOKEN_FILE_ENV})"
        if self.source == "run":
            return (f"on, with the per-run token in {run_dir / RUN_TOKEN_FILE} "
                    f"(set {TOKEN_ENV} before cadenza up to choose it)")
        return f"off (set {TOKEN_ENV} before cadenza up to turn it on)"


def choose_admin_token(mode: str, environ: dict[str, str] | None = None) -> AdminToken:
    """The pool's admin token: the user's when one is set (``$CADENZA_ADMIN_TOKEN``, else the
    content of the file ``$CADENZA_ADMIN_TOKEN_FILE`` names, read once, as ``cadenza serve`` reads
    them), else a new random one in a mode that needs one (``auto``, ``disaggregated``), else none.

    Raises:
        PoolSpecError: ``$CADENZA_ADMIN_TOKEN_FILE`` names a file that cannot be read or is empty
            (a typo must not silently turn the user's token into another).
    """
    environ = os.environ if environ is None else environ
    if token := environ.get(TOKEN_ENV, "").strip():
        return AdminToken(token, "env")
    if path := environ.get(TOKEN_FILE_ENV):
        try:
            token = Path(path).read_text().strip()
        except OSError as exc:
            raise PoolSpecError(f"{TOKEN_FILE_ENV}={path}: cannot read it ({exc.strerror or exc})") from None
        if not token:
            raise PoolSpecError(f"{TOKEN_FILE_ENV}={path}: the file is empty")
        return AdminToken(token, "file")
    if mode in MODES_WITH_TOKEN:
        return AdminToken(secrets.token_hex(16), "run")
    return AdminToken(None, "none")


def plan(pool_obj: dict, run_dir: Path, host: str, port: int, admin_token: str | None = None
         ) -> tuple[list[Process], Process]:
    """The replicas and the gateway a pool needs, with their configuration files written.

    ``admin_token``, when given, enables every replica's admin API with it, and is the gateway's
    too in ``mode: disaggregated`` and in an auto pool that may move replicas into the prefill
    role (its KV transfer headers need it); without it the replicas' admin API is off, whatever
    this process's environment says.

    Raises:
        PoolSpecError: a spec that cannot run here (a PVC source needs a cluster).
    """
    pool = Pool(pool_obj["metadata"]["name"], pool_obj["metadata"].get("namespace", "default"), pool_obj["spec"])
    source = pool.spec["model"].get("source", {"embedded": True})
    if "pvc" in source:
        raise PoolSpecError("spec.model.source.pvc needs a cluster; use source.path for cadenza up")
    roles = pool.roles()
    if pool.hub_model:  # once here, not once per replica: they start from the cache
        from cadenza.node.hub import fetch

        try:
            fetch(pool.hub_model)
        except (FileNotFoundError, ValueError) as exc:
            raise PoolSpecError(f"spec.model.source.hf: {exc}") from None
    total = sum(role.replicas for role in roles)
    if total == 0:
        raise PoolSpecError("spec.replicas is 0: there is nothing to run (scaling to zero is for a cluster)")
    model_args = pool.model_args()
    serve = [sys.executable, "-m", "cadenza.node.cli", "serve", "--host", "127.0.0.1"]
    env = {} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": str(_threads(pool, total))}
    # the token given, or none: never one the replicas would inherit from here without `up` knowing
    env.update({TOKEN_ENV: admin_token or "", TOKEN_FILE_ENV: ""})
    replicas: list[Process] = []
    for role in roles:
        policy = run_dir / f"{role.name}.policy.json"
        policy.write_text(json.dumps(role.policy(), indent=2) + "\n")
        for i in range(role.replicas):
            port_i = free_port()
            cmd = [*serve, "--port", str(port_i), *role.serve_args(model_args), "--policy", str(policy)]
            if role.kv_transfer:
                cmd += ["--kv-transfer-port", "0"]
            replicas.append(Process(f"{role.name}-{i}", cmd, port_i, run_dir / f"{role.name}-{i}.log",
                                    role=role.name, env=env))
    urls = {route: [r.url for r in replicas if r.role == role] for route, role in pool.routes().items()}
    config = run_dir / "gateway.json"
    write_routes(config, urls)
    gateway = Process("gateway", [sys.executable, "-m", "cadenza.node.cli", "gateway", "--config", str(config),
                                  "--host", host, "--port", str(port), *pool.gateway_args()], port,
                      run_dir / "gateway.log", host=host,
                      env={TOKEN_ENV: admin_token if _moves_kv(pool) and admin_token else "", TOKEN_FILE_ENV: ""})
    return replicas, gateway


def _moves_kv(pool: Pool) -> bool:
    """Whether the pool's gateway may send prompts through prefill replicas (its KV transfer
    headers carry the pool's token): a disaggregated pool, or an auto pool whose controller may
    move replicas into the prefill role."""
    return pool.mode == "disaggregated" or pool.prefill_in_place


def write_routes(config: Path, urls: dict[str, list[str]]) -> None:
    """Write the gateway's config file atomically (the gateway never reads half a file)."""
    tmp = config.with_name(config.name + ".tmp")
    tmp.write_text(json.dumps({"roles": urls, "default_class": "interactive"}, indent=2) + "\n")
    tmp.replace(config)


def _threads(pool: Pool, replicas: int) -> int:
    """Intra-op threads per replica: an equal share of this machine's cores, capped by the pool's CPU
    quantity when it gives one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = max(1, math.floor(cores / replicas))
    given = cpu_threads(pool)
    return min(given, share) if given is not None else share


def _write_state(path: Path | None, replicas: list[Process], gateway: Process,
                 controller: ControlLoop | None = None) -> None:
    if path is None:
        return
    roles = controller.actuation.state.roles if controller is not None else {}
    state = {
        "gateway": {"url": gateway.url, "pid": gateway.proc.pid if gateway.proc else None},
        "replicas": [{"name": r.name, "role": roles.get(r.name, r.role), "url": r.url,
                      "pid": r.proc.pid if r.proc else None, "restarts": r.restarts, "log": str(r.log)}
                     for r in replicas],
    }
    if controller is not None:
        state["controller"] = controller.status()
        state["shape"] = shape_doc(shape_of(list(roles.values())))  # as the roles are now
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(path)
    except OSError as exc:  # the file only informs: a full disk or a removed folder must not stop serving
        logger.warning("could not write the state file %s: %s", path, exc)


def _wait_ready(procs: list[Process], timeout: float, stop: dict) -> Process | None:
    """Wait for every process to answer /ready; the first that died instead (or None)."""
    deadline = time.monotonic() + timeout
    pending = list(procs)
    while pending and not stop["now"]:
        for p in list(pending):
            if p.proc is not None and p.proc.poll() is not None:
                return p
            if p.ready():
                pending.remove(p)
        if time.monotonic() > deadline:
            return pending[0]
        time.sleep(0.25)
    return None


def run_local(pool_obj: dict, host: str = "127.0.0.1", port: int = 8000, state_file: Path | None = None,
              ready_timeout: float = 600.0) -> int:
    """Run a validated ServingPool until interrupted; the process exit code (0, 1 failed, 2 refused)."""
    name = pool_obj["metadata"]["name"]
    if problem := port_problem(host, port):
        print(f"cadenza up: {problem}", file=sys.stderr)
        return 1
    run_dir = Path(tempfile.mkdtemp(prefix=f"cadenza-up-{name}-"))
    auto = pool_obj["spec"].get("mode") == "auto"
    try:
        admin = choose_admin_token(pool_obj["spec"].get("mode", "colocated"))
        token = admin.value
        replicas, gateway = plan(pool_obj, run_dir, host, port, admin_token=token)
        if admin.source == "run":
            (run_dir / RUN_TOKEN_FILE).touch(mode=0o600)
            (run_dir / RUN_TOKEN_FILE).write_text(token + "\n")
    except PoolSpecError as exc:
        shutil.rmtree(run_dir, ignore_errors=True)
        print(f"cadenza up: {exc}", file=sys.stderr)
        return 2
    stop = {"now": False, "force": False}

    def on_signal(_signum, _frame) -> None:
        if stop["now"]:
            stop["force"] = True  # a second Ctrl-C: no more grace
        stop["now"] = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    everyone = [*replicas, gateway]
    try:
        logger.info("pool %s: starting %d replicas (logs in %s)", name, len(replicas), run_dir)
        where = admin.describe(run_dir)
        for r in replicas:
            logger.info("pool %s: replica %s (%s) at %s; admin API %s/admin/config %s", name, r.name, r.role, r.url,
                        r.url, where)
            r.start()
        failed = _wait_ready(replicas, ready_timeout, stop)
        if failed is not None:
            print(f"cadenza up: replica {failed.name} did not become ready:\n{failed.tail()}", file=sys.stderr)
            return 1
        if stop["now"]:
            return 0  # stopped while loading: no gateway to start
        gateway.start()
        failed = _wait_ready([gateway], 60.0, stop)
        if failed is None and not stop["now"] and _exited_soon(gateway):
            failed = gateway  # something else answered on the port; ours could not listen
        if failed is not None:
            print(f"cadenza up: the gateway did not start (log: {gateway.log}):\n{gateway.tail()}", file=sys.stderr)
            return 1
        controller = _controller(pool_obj, replicas, gateway, run_dir, token) if auto else None
        _write_state(state_file, replicas, gateway, controller)
        if not stop["now"]:
            logger.info("pool %s: serving on %s/v1 (%d replicas ready%s)", name, gateway.url, len(replicas),
                        ", SLO controller on" if controller else "")
        while not stop["now"]:
            _supervise(everyone, replicas, gateway, state_file, controller)
            if controller is not None and controller.due():
                try:
                    controller.tick()
                except Exception:  # noqa: BLE001 - a controller bug must not take the pool down
                    logger.exception("controller: evaluation failed; holding")
                _write_state(state_file, replicas, gateway, controller)
            time.sleep(0.5)
        return 0
    finally:
        _shutdown(everyone, stop)
        if state_file is not None:
            state_file.unlink(missing_ok=True)  # its pids and ports are gone
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _controller(pool_obj: dict, replicas: list[Process], gateway: Process, run_dir: Path,
                token: str) -> ControlLoop:
    pool = Pool(pool_obj["metadata"]["name"], pool_obj["metadata"].get("namespace", "default"), pool_obj["spec"])

    def route(urls: dict[str, list[str]]) -> None:
        write_routes(run_dir / "gateway.json", urls)
        gateway.stop(signal.SIGHUP)  # re-read now, not at the next poll

    return local_loop(pool, {r.name: r.url for r in replicas}, gateway.url, route, token)


def _exited_soon(p: Process, within_s: float = 1.0) -> bool:
    try:
        p.proc.wait(timeout=within_s)
        return True
    except subprocess.TimeoutExpired:
        return False


def _supervise(everyone: list[Process], replicas: list[Process], gateway: Process, state_file: Path | None,
               controller: ControlLoop | None = None) -> None:
    now = time.monotonic()
    for p in everyone:
        if p.proc is None or p.proc.poll() is None:
            continue
        if not p.restart_at:
            backoff = min(MAX_BACKOFF_S, 2.0 ** min(p.restarts, 5)) if now - p.started < 60 else 1.0
            p.restart_at = now + backoff
            logger.warning("%s exited with %s; restarting in %.0f s (log: %s)", p.name, p.proc.returncode, backoff, p.log)
            if controller is not None and p in replicas:
                controller.actuation.backend.unroute(p.name)  # routed again once its role's settings are back
        elif now >= p.restart_at:
            p.restarts += 1
            p.restart_at = 0.0
            p.start()
            _write_state(state_file, replicas, gateway, controller)


def _shutdown(everyone: list[Process], stop: dict) -> None:
    """The gateway first (no new work), then the replicas; SIGKILL after the grace period, or as
    soon as a second signal asks for it."""
    if any(p.proc is not None and p.proc.poll() is None for p in everyone):
        logger.info("stopping (Ctrl-C again to stop at once)")
    for p in reversed(everyone):
        p.stop()
    deadline = time.monotonic() + GRACE_S
    for p in everyone:
        if p.proc is None:
            continue
        while p.proc.poll() is None and time.monotonic() < deadline and not stop["force"]:
            time.sleep(0.1)
        if p.proc.poll() is None:
            p.stop(signal.SIGKILL)
            p.proc.wait()
