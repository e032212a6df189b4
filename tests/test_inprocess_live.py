"""`loragate serve` with one local instance runs its engine in the gateway's process: no
engine process, the same OpenAI API, adapter admin, hang-ups that free the engine's blocks,
and the engine's metrics on the gateway's /metrics."""

from __future__ import annotations

import concurrent.futures
import io
import signal
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.exposure import instance_tag
from gateway.serve import free_port
from tests.live_http import instances, metric, poll, sse_events
from tests.live_servers import LiveServer, _spawn, running

ADMIN = "lg-admin-inprocess-test"
HEADERS = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def serve(tiny_model_dir: Path, tiny_adapters: dict[str, Path],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    port = free_port()
    server = _spawn(["serve", "--model", str(tiny_model_dir), "--port", str(port),
                     "--poll-interval-s", "0.2", "--num-kv-blocks", "64", "--admin-key", ADMIN,
                     "--lora", f"a0={tiny_adapters['a0']}"],
                    tmp_path_factory.mktemp("inprocess") / "serve.log", port)
    with running(server):
        yield server


def _body(model: str, max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {"model": model, "prompt": [5, 6, 7, 8], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream}


def _local(url: str) -> dict[str, Any]:
    return instances(url, ADMIN)["local"]


def _idle(url: str) -> bool:
    local = _local(url)
    return (local["in_flight"], local["num_running"], local["kv_usage"]) == (0, 0, 0.0)


def test_one_instance_serves_in_the_gateways_process(serve: LiveServer,
                                                     tiny_model_dir: Path) -> None:
    assert list(instances(serve.url, ADMIN)) == ["local"]
    assert _children(serve.process.pid) == []
    for model in (tiny_model_dir.name, "a0"):
        whole = httpx.post(serve.url + "/v1/completions", json=_body(model, 5),
                           headers=HEADERS, timeout=60)
        assert whole.status_code == 200, whole.text
        assert whole.json()["usage"]["completion_tokens"] == 5
        with httpx.stream("POST", serve.url + "/v1/completions", json=_body(model, 5, True),
                          headers=HEADERS, timeout=60) as response:
            events = list(sse_events(response))
        assert events[-1] == "[DONE]"
        text = "".join(e["choices"][0]["text"] for e in events[:-1])
        assert text == whole.json()["choices"][0]["text"]
    page = httpx.get(serve.url + "/metrics", headers=HEADERS).text
    assert metric(page, "loragate_generation_tokens_total") >= 20  # the engine's series
    assert metric(page, "loragate_time_to_first_token_seconds_count") >= 4
    assert metric(page, "loragate_gateway_requests_total", status="200") >= 4


def test_every_response_is_counted_by_route_status_and_code(serve: LiveServer,
                                                          tiny_model_dir: Path) -> None:
    # Refusals made before any work count too: bad JSON fields, an unknown model, a body
    # over the limit (refused by the guard before routing).
    def count(**labels: str) -> float:
        page = httpx.get(serve.url + "/metrics", headers=HEADERS).text
        return metric(page, "loragate_gateway_responses_total", **labels)

    route = "/v1/completions"
    before = {key: count(route=route, status=status, code=code) for key, (status, code) in {
        "ok": ("200", "none"), "bad": ("400", "none"), "unknown": ("404", "model_not_found"),
    }.items()}
    # Refused by the guard before routing: still labelled by the route they asked for,
    # with the code their body carries.
    refused = {"413": "request_too_large", "415": "unsupported_encoding",
               "401": "invalid_api_key"}
    refused_before = {status: count(route=route, status=status, code=code)
                      for status, code in refused.items()}

    def post(body: dict[str, object]) -> httpx.Response:
        return httpx.post(serve.url + route, json=body, headers=HEADERS, timeout=60)

    assert post(_body(tiny_model_dir.name, 2)).status_code == 200
    assert post({**_body(tiny_model_dir.name, 2), "temperature": -1}).status_code == 400
    assert post(_body("no-such-model", 2)).status_code == 404
    huge = httpx.post(serve.url + route, content=b"x" * (9 << 20), headers=HEADERS, timeout=60)
    assert huge.status_code == 413
    gzipped = httpx.post(serve.url + route, content=b"{}", timeout=60,
                         headers={**HEADERS, "Content-Encoding": "gzip"})
    assert gzipped.status_code == 415
    stranger = httpx.post(serve.url + route, json=_body(tiny_model_dir.name, 2), timeout=60,
                          headers={"Authorization": "Bearer not-a-key"})
    assert stranger.status_code == 401
    # Labels are the full templates the client calls, admin routes of every kind included.
    for path, template in (("/admin/tenants", "/admin/tenants"),
                           ("/admin/tenants/nobody/keys", "/admin/tenants/{tenant_id}/keys"),
                           ("/admin/adapters", "/admin/adapters"),
                           ("/v1/models/a/b", "/v1/models/{model_id}")):
        was = count(route=template)
        httpx.get(serve.url + path, headers=HEADERS, timeout=60)
        assert count(route=template) == was + 1, path
    assert count(route=route, status="200", code="none") == before["ok"] + 1
    assert count(route=route, status="400", code="none") == before["bad"] + 1
    assert count(route=route, status="404", code="model_not_found") == before["unknown"] + 1
    for status, code in refused.items():
        assert count(route=route, status=status, code=code) == refused_before[status] + 1
    assert count(route="unmatched") == 0


def test_a_client_hanging_up_frees_the_engine(serve: LiveServer, tiny_model_dir: Path
                                              ) -> None:
    def generated() -> float:
        page = httpx.get(serve.url + "/metrics", headers=HEADERS).text
        return metric(page, "loragate_generation_tokens_total")

    poll(lambda: _idle(serve.url), "the engine to be idle")
    before = generated()
    with httpx.stream("POST", serve.url + "/v1/completions",
                      json=_body(tiny_model_dir.name, 1000, True), headers=HEADERS,
                      timeout=60) as response:
        events = sse_events(response)
        assert next(events)["choices"][0]["finish_reason"] is None
        assert _local(serve.url)["in_flight"] == 1
    poll(lambda: _idle(serve.url), "the engine to end the abandoned request")
    assert generated() - before < 1000


def test_adapter_admin_reaches_the_in_process_engine(serve: LiveServer) -> None:
    def adapter() -> dict[str, Any]:
        return dict(_local(serve.url)["adapters"].get("a0", {}))

    def post(action: str, **body: Any) -> dict[str, Any]:
        response = httpx.post(f"{serve.url}/admin/adapters/a0/{action}", json=body,
                              headers=HEADERS, timeout=30)
        assert response.status_code == 200, response.text
        return dict(response.json())

    # Named by its opaque id, as in /instances and x-loragate-instance: never "local".
    local_id = _local(serve.url)["public_id"]
    assert local_id == instance_tag("local", ADMIN)
    assert post("pin", pinned=True) == {"name": "a0", "instances": {local_id: "ok"}}
    assert adapter()["pinned"] is True
    post("pin", pinned=False, instance=local_id)
    assert post("unload") == {"name": "a0", "instances": {local_id: "ok"}}
    assert adapter() == {}
    assert post("load")["instances"] == {local_id: "ok"}
    assert adapter()["digest"]


def test_uploads_and_the_adapter_roots_hold_in_process(serve: LiveServer,
                                                       tiny_adapters: dict[str, Path]) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        archive.add(tiny_adapters["a1"], arcname="a1")
    upload = httpx.post(serve.url + "/admin/adapters/upload?name=up&public=true",
                        content=buffer.getvalue(), headers=HEADERS, timeout=60)
    assert upload.status_code == 201, upload.text
    answer = httpx.post(serve.url + "/v1/completions", json=_body("up", 3), headers=HEADERS,
                        timeout=60)
    assert answer.status_code == 200, answer.text
    # A path outside the roots (here: the tiny model's other adapter, not given to serve)
    # is refused by the engine, as an engine process would refuse it: at registration.
    outside = httpx.post(serve.url + "/admin/adapters", json={
        "name": "outside", "path": str(tiny_adapters["a1"]), "public": True},
        headers=HEADERS, timeout=60)
    assert outside.status_code == 400, outside.text
    assert outside.json()["error"]["param"] == "path"
    assert "outside the engine's adapter roots" in outside.json()["error"]["message"]
    unknown = httpx.post(serve.url + "/v1/completions", json=_body("outside", 3),
                         headers=HEADERS, timeout=60)
    assert unknown.status_code == 404  # nothing was recorded


def test_sigterm_drains_and_exits_cleanly(tiny_model_dir: Path, tmp_path: Path) -> None:
    server = _serve_alone(tiny_model_dir, tmp_path)
    with running(server):
        with httpx.stream("POST", server.url + "/v1/completions",
                          json=_body(tiny_model_dir.name, 1000, True), timeout=60) as response:
            events = sse_events(response)
            seen = [next(events)]
            server.process.send_signal(signal.SIGTERM)
            # While the stream finishes the gateway still listens, and says it is draining.
            health = poll(lambda: (lambda r: r if r.status_code == 503 else None)(
                httpx.get(server.url + "/health", timeout=10)), "/health to say draining")
            assert health.json()["status"] == "draining"
            assert health.headers["retry-after"]
            new = httpx.post(server.url + "/v1/completions", json=_body(tiny_model_dir.name, 2),
                             timeout=10)
            assert (new.status_code, new.json()["error"]["code"]) == (503, "draining")
            assert new.headers["retry-after"]
            seen += list(events)
        assert seen[-1] == "[DONE]"
        finish = [e["choices"][0]["finish_reason"] for e in seen[:-1] if e["choices"]]
        assert finish[-1] == "length"
        assert server.process.wait(60) == 0
    log = server.log()
    assert "starting the engine in this process" in log and "engine ready after" in log
    assert "stopping 1 engine instance" not in log  # there was no engine process


def test_requests_left_at_the_drain_deadline_end_as_a_shutdown(tiny_model_dir: Path,
                                                               tmp_path: Path) -> None:
    server = _serve_alone(tiny_model_dir, tmp_path, "--drain-timeout-s", "0.5")
    with running(server), concurrent.futures.ThreadPoolExecutor(1) as pool:
        whole = pool.submit(httpx.post, server.url + "/v1/completions",
                            json=_body(tiny_model_dir.name, 1000), timeout=60)
        responses_body = {"model": tiny_model_dir.name, "input": "hi", "stream": True,
                          "max_output_tokens": 1000, "ignore_eos": True, "temperature": 0}
        with httpx.stream("POST", server.url + "/v1/completions",
                          json=_body(tiny_model_dir.name, 1000, True), timeout=60) as response, \
                httpx.stream("POST", server.url + "/v1/responses", json=responses_body,
                             timeout=60) as named:
            events, named_events = sse_events(response), sse_events(named)
            seen, told = [next(events)], [next(named_events)]
            server.process.send_signal(signal.SIGTERM)
            seen += list(events)
            told += list(named_events)
        # Not a silent cut: an error event that says why, then the stream's end.
        assert seen[-1] == "[DONE]"
        assert seen[-2]["error"]["code"] == "shutting_down", seen[-2]
        assert len(seen) < 1000
        # The Responses stream ends in its own framing: an error event, then
        # response.failed, numbered on from the events before them, and no [DONE].
        assert [e["type"] for e in told[-2:]] == ["error", "response.failed"], told[-2:]
        assert told[-2]["code"] == "shutting_down"
        assert told[-1]["response"]["status"] == "failed"
        assert [e["sequence_number"] for e in told] == list(range(len(told)))
        answer = whole.result()
        assert (answer.status_code, answer.json()["error"]["code"]) == (503, "shutting_down")
        assert answer.headers["retry-after"] == "1"  # another replica can take it
        assert server.process.wait(60) == 0
    log = server.log()
    assert "3 request(s) still running are ended with a 'shutting_down' error" in log, log
    assert "Traceback" not in log and "CancelledError" not in log, log
    assert " 499 " not in log, log  # neither request is logged as a client that left


def test_a_second_ctrl_c_ends_the_drain_at_once_and_cleanly(tiny_model_dir: Path,
                                                             tmp_path: Path) -> None:
    server = _serve_alone(tiny_model_dir, tmp_path)
    with running(server):
        with httpx.stream("POST", server.url + "/v1/completions",
                          json=_body(tiny_model_dir.name, 1000, True), timeout=60) as response:
            events = sse_events(response)
            seen = [next(events)]
            server.process.send_signal(signal.SIGINT)
            poll(lambda: httpx.get(server.url + "/health", timeout=10).status_code == 503,
                 "the drain to begin")
            server.process.send_signal(signal.SIGINT)  # the operator insists
            seen += list(events)
        assert seen[-1] == "[DONE]"
        assert seen[-2]["error"]["code"] == "shutting_down", seen[-2]
        assert server.process.wait(60) == 0
    log = server.log()
    assert "Traceback" not in log and "CancelledError" not in log, log


def _serve_alone(model_dir: Path, tmp_path: Path, *flags: str) -> LiveServer:
    """A `loragate serve` of its own (a test that stops it), its engine in its process."""
    port = free_port()
    return _spawn(["serve", "--model", str(model_dir), "--port", str(port),
                   "--num-kv-blocks", "64", *flags], tmp_path / "serve.log", port)


def _children(pid: int) -> list[int]:
    """Pids of the child processes of pid."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(entry.name))
    return children
