"""`loragate serve`: the gateway in this process, and its local engines.

One local instance (the default) runs in this process (gateway/local_engine.py): the
gateway drives its AsyncEngine directly, without an HTTP hop. Several (``--instances N``),
or one with ``engine_process`` (`--engine-process`), are child processes (`loragate engine`
on free loopback ports) so a crash in one never takes the gateway or the others down; a
supervisor restarts them. Shutdown order on SIGTERM/SIGINT: the gateway drains (stops
admitting, finishes in-flight streams), then the engines are sent SIGTERM and drain in turn;
an engine still alive after the drain timeout is killed.

Engine processes always require an engine token: the configured one, or one made up per
run. It reaches them through the environment (argv is visible to every user in `ps`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI

from engine.adapter_roots import ROOTS_ENV, AdapterRoots
from engine.config import EngineConfig
from engine.config_args import field_default
from engine.http.auth import TOKEN_ENV
from engine.http.draining import DrainingServer
from engine.http.guarded_protocol import guarded_protocol
from engine.http.listen import check_port_free
from engine.kv_events import for_instance
from engine.models.loader import load_hf_config
from engine.parent_watch import child_env
from gateway.app import check_engine_sources, count_unrouted, create_app, open_store
from gateway.auth import StateView
from gateway.config import GatewayConfig
from gateway.engine_supervisor import EngineSupervisor
from gateway.local_engine import LocalEngine
from gateway.ready_banner import ready_banner
from gateway.stop_signals import StoppedWhileStarting, StopSignals
from gateway.store import StateStore

log = logging.getLogger(__name__)


_HANDED_OUT: set[int] = set()
"""Ports free_port() gave before in this process."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now that this process has not handed out before: the OS may give the same
    ephemeral port to two binds in a row while the first taker has not bound it yet, and two
    servers started at once would then share one port."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise OSError(f"no free port on {host} that was not handed out already")


def engine_flags(config: EngineConfig) -> list[str]:
    """Flags that make `loragate engine` build this exact config (non-defaults only)."""
    flags: list[str] = []
    for f in dataclasses.fields(EngineConfig):
        value = getattr(config, f.name)
        if f.name == "model" or value == field_default(f):
            continue
        if isinstance(value, tuple):
            text = ",".join(":".join(map(str, v)) if isinstance(v, tuple) else str(v)
                            for v in value)
        else:
            text = str(value)
        flags += [f"--{f.name.replace('_', '-')}", text]
    return flags


@dataclass
class EngineProcess:
    """One child `loragate engine` process and where its log goes."""

    url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    command: list[str] = dataclasses.field(default_factory=list)
    env: dict[str, str] | None = None
    """The command line and environment it was started with (a restart uses them again)."""

    def respawn(self) -> None:
        """Start the same engine again on the same port (its previous process exited); its
        output is appended to the same log."""
        with open(self.log_path, "ab") as out:
            self.process = subprocess.Popen(self.command, stdout=out,
                                            stderr=subprocess.STDOUT, env=self.env)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def threads_per_engine(engines: int) -> int:
    """This process's cores (its CPU affinity) split evenly over engines, at least one."""
    return max(1, len(os.sched_getaffinity(0)) // engines)


def start_engines(config: EngineConfig, count: int, log_dir: Path,
                  adapters: dict[str, str], token: str | None = None,
                  adapter_roots: Sequence[str] = (),
                  drain_timeout_s: float | None = None) -> list[EngineProcess]:
    """`loragate engine` children on free loopback ports, requiring token when one is given;
    adapters registered through their API must lie in adapter_roots (or be one of
    adapters)."""
    env = child_env(os.environ)  # an engine outlives no gateway (engine/parent_watch.py)
    if token is not None:
        env[TOKEN_ENV] = token
    if adapter_roots:
        env[ROOTS_ENV] = os.pathsep.join(adapter_roots)
    if config.cpu_threads is not None:  # every thread of the process, not only the engine's
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(config.cpu_threads)
    engines: list[EngineProcess] = []
    try:
        for index in range(count):
            engines.append(_start_engine(config, index, log_dir, adapters, env,
                                         drain_timeout_s))
    except BaseException:  # a stop (or a failure) midway: the caller never gets the list
        stop_engines(engines, 1.0)
        raise
    return engines


def _start_engine(config: EngineConfig, index: int, log_dir: Path, adapters: dict[str, str],
                  env: dict[str, str], drain_timeout_s: float | None) -> EngineProcess:
    """Engine number ``index`` of start_engines, on a free loopback port."""
    port = free_port()
    log_path = log_dir / f"engine-{index}.log"
    # Each engine its own KV event sockets (one config serves them all).
    own = dataclasses.replace(
        config, kv_events_endpoint=for_instance(config.kv_events_endpoint, index),
        kv_events_replay_endpoint=for_instance(config.kv_events_replay_endpoint, index))
    command = [sys.executable, "-m", "engine.http", "--model", config.model,
               "--host", "127.0.0.1", "--port", str(port),
               "--instance-id", f"engine-{index}", *engine_flags(own)]
    if drain_timeout_s is not None:  # the gateway's: engines drain no longer than it
        command += ["--drain-timeout-s", repr(drain_timeout_s)]
    for name, path in adapters.items():
        command += ["--lora", f"{name}={path}"]
    with open(log_path, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    return EngineProcess(f"http://127.0.0.1:{port}", process, log_path, command, env)


PROGRESS_EVERY_S = 5.0
"""wait_ready prints which engines are still loading this often."""


def wait_ready(engines: list[EngineProcess], timeout_s: float,
               progress_every_s: float = PROGRESS_EVERY_S) -> None:
    """Block until every engine answers /health with 200; RuntimeError if one dies. Prints
    a line each time an engine becomes ready and, every progress_every_s, which are still
    loading (loading the weights and the warm-up step take a while on a CPU)."""
    start = time.monotonic()
    deadline = start + timeout_s
    next_progress = start + progress_every_s
    pending = list(engines)
    with httpx.Client(timeout=2.0) as client:
        while pending:
            for engine in list(pending):
                if engine.process.poll() is not None:
                    raise RuntimeError(f"engine {engine.url} exited with code "
                                       f"{engine.process.returncode}:\n{engine.log_tail()}")
                try:
                    if client.get(engine.url + "/health").status_code == 200:
                        pending.remove(engine)
                        print(f"engine {engine.url} ready after "
                              f"{time.monotonic() - start:.0f}s", flush=True)
                except httpx.HTTPError:
                    pass
            if pending and time.monotonic() >= next_progress:
                next_progress += progress_every_s
                print(f"waiting for {len(pending)} engine(s) to load the model and warm up "
                      f"({time.monotonic() - start:.0f}s): "
                      f"{', '.join(e.url for e in pending)}", flush=True)
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"engines not ready after {timeout_s:g}s: "
                                   f"{[e.url for e in pending]}")
            if pending:
                time.sleep(0.2)


ENGINE_EXIT_GRACE_S = 10.0
"""Beyond its drain: what an engine process may take to exit (its server's shutdown, its
threads joined; 2-4 s on a busy 2-core box) before it is killed, and counted as failed."""


def stop_engines(engines: list[EngineProcess], timeout_s: float) -> None:
    """SIGTERM every engine (each drains for up to timeout_s), then wait for their exits;
    kill one that has not exited ENGINE_EXIT_GRACE_S later."""
    for engine in engines:
        if engine.process.poll() is None:
            engine.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s + ENGINE_EXIT_GRACE_S
    for engine in engines:
        try:
            engine.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            engine.process.kill()
            engine.process.wait()


def run_gateway(config: GatewayConfig, engine_urls: list[str], tokenizer_dir: str,
                adapters: dict[str, str], withheld: Collection[str] = (),
                banner: Callable[[StateView], str] | None = None,
                watch_adapter_dir: str | None = None, local: LocalEngine | None = None,
                store: StateStore | None = None) -> None:
    """Serve the gateway until SIGTERM/SIGINT, then drain."""
    app = create_app(config, engine_urls, tokenizer_dir, adapters,
                     watch_adapter_dir=watch_adapter_dir, local=local, store=store,
                     withheld=withheld)
    server = DrainingServer(uvicorn.Config(
        app, host=config.host, port=config.port, log_level="warning",
        http=guarded_protocol(config.header_read_timeout_s, config.max_header_bytes,
                              config.write_timeout_s, lambda status, code: count_unrouted(
                                  app, status, code))),
        config.drain_timeout_s)
    server.on_drain = lambda: start_drain(app, config.drain_timeout_s)
    server.on_deadline = lambda: cut_off(app)

    async def main() -> None:
        serving = asyncio.create_task(server.serve())
        while not server.started and not serving.done():
            await asyncio.sleep(0.05)
        if server.started and banner:
            print(banner(app.state.gateway.view), flush=True)
        await serving

    asyncio.run(main())
    if not server.started:
        raise RuntimeError(f"the gateway could not listen on {config.host}:{config.port}")


def cut_off(app: FastAPI) -> None:
    """End the requests the drain did not see finish (gateway/shutdown_cutoff.py)."""
    gateway = getattr(app.state, "gateway", None)
    if gateway is not None:
        gateway.stopping = True  # its streams count as 503s, not as clients that left
    count = app.state.shutdown_cutoff.cut_off()
    log.warning("shutting down: %d request(s) still running are ended with a "
                "'shutting_down' error", count)


def start_drain(app: FastAPI, timeout_s: float) -> None:
    """Turn new generation requests away and say what is left to finish."""
    app.state.draining = True
    gateway = getattr(app.state, "gateway", None)
    in_flight = sum(i.in_flight for i in gateway.pool.instances.values()) if gateway else 0
    log.info("shutting down: the gateway drains (no new requests; %d in flight, waiting up "
             "to %gs for them)", in_flight, timeout_s)


def serve(gateway_config: GatewayConfig, engine_config: EngineConfig | None, instances: int,
          engine_urls: list[str], tokenizer_dir: str, adapters: dict[str, str],
          adapter_roots: Sequence[str] = (), watch_adapter_dir: str | None = None,
          engine_process: bool = False, start_training: Callable[[], bool] | None = None,
          withheld: Collection[str] = ()) -> None:
    """Start local engines (unless engine_urls are given, or instances is 0: then engines
    come from the Redis registry) and the gateway in front: one in this process unless
    engine_process, else engine processes, which get the gateway's engine token (a fresh
    random one when it has none). Local engines load adapters only from adapter_roots (and
    the directories of ``adapters``). ``start_training`` runs once the checks passed; False:
    nothing trains into watch_adapter_dir, which is then not watched. ``withheld``: adapters
    given but not served now (an adapter directory's member that did not load)."""
    # Configuration before the network: each refusal names the first problem.
    load_hf_config(tokenizer_dir)  # a missing or foreign model directory
    check_engine_sources(gateway_config, engine_urls, has_local_engine=instances > 0)
    check_port_free(gateway_config.host, gateway_config.port)
    # Before any model loads: a state file another gateway holds, or a Redis server that
    # does not answer, is one line now rather than a traceback after the engines' load.
    store = open_store(gateway_config, check=True)
    if start_training is not None and not start_training():
        watch_adapter_dir = None
    engines: list[EngineProcess] = []
    log_dir = Path(tempfile.mkdtemp(prefix="loragate-engines-"))
    supervisor: EngineSupervisor | None = None
    local: LocalEngine | None = None
    clean = stopped = False
    signals = StopSignals()
    with signals:  # while engines load, a stop cleans up; while cleaning up, it waits
        try:
            if not engine_urls and instances == 1 and not engine_process:
                assert engine_config is not None
                local = start_local_engine(engine_config, adapters, adapter_roots,
                                           gateway_config.served_model_name)
            elif not engine_urls and instances > 0:
                assert engine_config is not None
                if engine_config.cpu_threads is None and instances > 1:
                    # Each engine would take every core: 2 engines on 2 cores ran 8x slower
                    # than with a core each, their threads preempting each other mid-matmul.
                    engine_config = dataclasses.replace(
                        engine_config, cpu_threads=threads_per_engine(instances))
                threads = (f", {engine_config.cpu_threads} CPU thread(s) each"
                           if engine_config.cpu_threads else "")
                print(f"starting {instances} engine instance(s) on {engine_config.model} "
                      f"(logs in {log_dir}{threads})", flush=True)
                token = gateway_config.engine_token or secrets.token_urlsafe(32)
                gateway_config = dataclasses.replace(gateway_config, engine_token=token)
                with signals.deferred():  # a stop mid-spawn would lose a child it started
                    engines = start_engines(engine_config, instances, log_dir, adapters,
                                            token, adapter_roots,
                                            gateway_config.drain_timeout_s)
                wait_ready(engines, gateway_config.startup_timeout_s)
                engine_urls = [e.url for e in engines]
                supervisor = EngineSupervisor(engines)
                supervisor.start()
            # uvicorn holds the signals while it serves (a drain), then gives them back.
            run_gateway(gateway_config, engine_urls, tokenizer_dir, adapters, withheld,
                        banner=functools.partial(ready_banner, gateway_config, tokenizer_dir),
                        watch_adapter_dir=watch_adapter_dir, local=local, store=store)
            clean = True
        except StoppedWhileStarting as stop:  # the operator's stop, not a failure
            print(f"{stop}: stopped before the gateway listened", file=sys.stderr, flush=True)
            clean = stopped = True
        finally:
            signals.stopping = True  # from here a signal changes nothing: cleanup is under way
            if local is not None:
                local.shutdown()
            if supervisor is not None:
                supervisor.stop()  # before the engines: their exits now are no crash
                clean = clean and not any(supervisor.restarts(e) for e in engines)
            if engines:
                print(f"stopping {len(engines)} engine instance(s) (draining, up to "
                      f"{gateway_config.drain_timeout_s:g}s)", flush=True)
            stop_engines(engines, gateway_config.drain_timeout_s)
            if stopped:  # engines stopped mid-load exit by the signal: no crash to keep
                shutil.rmtree(log_dir, ignore_errors=True)
            else:
                keep_logs(log_dir, engines, clean)


def start_local_engine(config: EngineConfig, adapters: dict[str, str],
                       adapter_roots: Sequence[str], model_name: str | None) -> LocalEngine:
    """The engine of a single local instance, in this process (loads the model and warms
    up); RuntimeError, with the reason, when it cannot be built."""
    print(f"starting the engine in this process on {config.model}", flush=True)
    start = time.monotonic()
    roots = AdapterRoots([*adapter_roots, *adapters.values()])
    try:
        local = LocalEngine(config, roots, model_name=model_name)
    except Exception as exc:
        log.debug("the engine could not start", exc_info=True)
        # A refusal (ValueError, OSError) says what is wrong; anything else is a bug, whose
        # type helps whoever reads the report.
        reason = str(exc) if isinstance(exc, ValueError | OSError) else \
            f"{type(exc).__name__}: {exc}"
        raise RuntimeError(f"the engine could not start: {reason}") from None
    print(f"engine ready after {time.monotonic() - start:.0f}s", flush=True)
    return local


def keep_logs(log_dir: Path, engines: list[EngineProcess], clean: bool) -> None:
    """Remove the engines' log directory after a clean run; keep it, and say where, when
    serving failed, an engine exited on its own (clean is then False) or did not stop
    cleanly: its log tells why."""
    crashed = [e for e in engines if e.process.returncode not in (0, None)]
    if clean and not crashed:
        shutil.rmtree(log_dir, ignore_errors=True)
    elif engines:
        print(f"engine logs kept in {log_dir}", file=sys.stderr, flush=True)
    else:
        shutil.rmtree(log_dir, ignore_errors=True)  # nothing was written there

