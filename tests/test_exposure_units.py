"""The exposure rules without a live server: Host matching, instance ids, the new config
fields (flags and env), and the Guard middleware's Host check over a real ASGI app."""

from __future__ import annotations

import argparse
import asyncio
import re

import httpx
import pytest
from fastapi import FastAPI

from engine.config_args import add_config_args, build_config
from gateway.config import GatewayConfig
from gateway.exposure import host_allowed, instance_tag
from gateway.guard import Guard


@pytest.mark.parametrize(("host", "allowed"), [
    ("localhost", True), ("localhost:8000", True), ("LOCALHOST.", True),
    ("127.0.0.1:8000", True), ("127.5.6.7", True), ("[::1]:8000", True), ("[::1]", True),
    ("gw.corp.example:443", True), ("a.b.corp.example", True), ("api.example", True),
    ("corp.example", False), ("evil.example", False), ("localhost.evil.example", False),
    ("127.0.0.1.evil.example", False), ("[::2]:80", False), ("", False), (None, False),
])
def test_host_allowed(host: str | None, allowed: bool) -> None:
    assert host_allowed(host, ("*.corp.example", "API.example")) is allowed


def test_any_host_with_a_star() -> None:
    assert host_allowed("evil.example", ("*",))


def test_instance_tags_are_opaque_stable_and_keyed() -> None:
    url = "http://10.0.0.7:8100"
    tag = instance_tag(url, "admin-key")
    assert re.fullmatch(r"instance-[0-9a-f]{12}", tag)
    assert instance_tag(url + "/", "admin-key") == tag  # same instance, same id
    assert instance_tag(url, "other-key") != tag != instance_tag(url)
    assert "10.0.0.7" not in tag and "8100" not in tag


def test_new_fields_come_from_flags_and_env() -> None:
    parser = argparse.ArgumentParser()
    add_config_args(parser, GatewayConfig)
    args = parser.parse_args(["--debug-headers", "true", "--body-read-timeout-s", "2.5"])
    config = build_config(GatewayConfig, args, {}, {
        "LORAGATE_ALLOWED_HOSTS": "gw.example, *.corp.example",
        "LORAGATE_METRICS_TOKEN": "scrape", "LORAGATE_HEADER_READ_TIMEOUT_S": "3"})
    assert (config.debug_headers, config.body_read_timeout_s, config.allowed_hosts,
            config.metrics_token, config.header_read_timeout_s, config.max_header_bytes) == (
        True, 2.5, ("gw.example", "*.corp.example"), "scrape", 3.0, 65536)
    defaults = GatewayConfig()
    assert (defaults.debug_headers, defaults.allowed_hosts, defaults.metrics_token,
            defaults.header_read_timeout_s, defaults.body_read_timeout_s) == (
        False, (), None, 10.0, 30.0)


def test_a_refused_value_names_the_flag_or_variable_it_came_from() -> None:
    parser = argparse.ArgumentParser()
    add_config_args(parser, GatewayConfig)
    args = parser.parse_args(["--drain-timeout-s", "0", "--allowed-hosts", "a*.b"])
    with pytest.raises(ValueError, match=re.escape(
            "--drain-timeout-s: drain_timeout_s must be a finite number > 0, got 0.0")):
        build_config(GatewayConfig, args, {}, {})
    with pytest.raises(ValueError, match=re.escape(
            "LORAGATE_ALLOWED_HOSTS: allowed_hosts: 'a*.b' is not a host name")):
        build_config(GatewayConfig, parser.parse_args([]), {},
                     {"LORAGATE_ALLOWED_HOSTS": "a*.b"})


@pytest.mark.parametrize(("changes", "message"), [
    ({"allowed_hosts": ("a*.example",)}, "allowed_hosts: 'a*.example' is not a host name, "
                                         "'*.domain' or '*'"),
    ({"allowed_hosts": ("",)}, "allowed_hosts: '' is not a host name, '*.domain' or '*'"),
    ({"allowed_hosts": ("http://x",)}, "allowed_hosts: 'http://x' is not a host name, "
                                       "'*.domain' or '*'"),
    ({"metrics_token": " "}, "metrics_token must not be empty"),
    ({"body_read_timeout_s": 0}, "body_read_timeout_s must be a finite number > 0, got 0"),
    ({"header_read_timeout_s": -1.0},
     "header_read_timeout_s must be a finite number > 0, got -1.0"),
    ({"max_header_bytes": 100}, "max_header_bytes must be an integer >= 1024, got 100"),
])
def test_new_fields_refuse_bad_values(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        GatewayConfig(**changes)  # type: ignore[arg-type]


def _guarded(restrict: bool, allowed: tuple[str, ...]) -> Guard:
    app = FastAPI()

    @app.get("/ping")
    async def ping() -> dict[str, bool]:
        return {"ok": True}

    async def anyone(_: object) -> None:
        return None

    return Guard(app, max_bytes=lambda _: 1024, draining=lambda: False, retry_after_s=1,
                 body_timeout_s=5.0, restrict_hosts=lambda: restrict, allowed_hosts=allowed,
                 caller_refusal=anyone)


async def _status(guard: Guard, host: str) -> tuple[int, str | None]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guard),
                                 base_url="http://ignored") as client:
        response = await client.get("/ping", headers={"Host": host})
    code = response.json()["error"]["code"] if response.status_code != 200 else None
    return response.status_code, code


def test_guard_checks_host_only_when_restricted() -> None:
    restricted = _guarded(True, ("gw.example",))
    assert asyncio.run(_status(restricted, "evil.example")) == (400, "host_not_allowed")
    assert asyncio.run(_status(restricted, "gw.example:8000")) == (200, None)
    assert asyncio.run(_status(restricted, "localhost:8000")) == (200, None)
    assert asyncio.run(_status(_guarded(False, ()), "evil.example")) == (200, None)


def test_help_states_each_default_once() -> None:
    parser = argparse.ArgumentParser()
    add_config_args(parser, GatewayConfig)
    helps = {action.dest: action.help or "" for action in parser._actions}
    for dest in ("redis_url", "state_path", "served_model_name"):
        assert helps[dest].lower().count("default") == 1, helps[dest]
    assert helps["drain_timeout_s"].endswith("(default 30.0; env LORAGATE_DRAIN_TIMEOUT_S)")
