"""The admin API's adapter lifecycle against a live gateway and engine (max_lora_rank 8):
identity by name + digest across delete and re-upload, deletes that wait for the engines and
remove only the directories uploads created, engines that start without the bad or outside
adapters of their adapter dir, and vLLM's runtime load / unload endpoints. What an upload or
registration must be to be accepted is in test_adapter_upload_intake_live.py.
"""

from __future__ import annotations

import functools
import json
import shutil
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from gateway.exposure import instance_tag
from tests.adapter_lifecycle_helpers import (
    ADMIN,
    PROMPT,
    Setup,
    admin,
    complete,
    deleted,
    live_setup,
    reference,
    register,
    streaming,
    tar_dir,
    text_of,
    upload,
)
from tests.live_http import engine_is_idle, poll, wait_engines_idle
from tests.live_servers import running, start_engine, start_gateway


@pytest.fixture(scope="module")
def setup(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    with live_setup(tiny_model_dir, tmp_path_factory) as running_setup:
        yield running_setup


# ------------------------------------------------------------------ identity, delete
def _created(response: httpx.Response) -> httpx.Response | None:
    return response if response.status_code == 201 else None


def test_reupload_under_a_force_deleted_name_serves_only_the_new_weights(
        setup: Setup) -> None:
    """The attack: A's private adapter is busy, the admin force-deletes it and uploads B's
    under the same name as soon as the name is accepted; B must get B's weights."""
    want_new = reference(setup, "tb", "ref-new", setup.new)
    want_old = reference(setup, "ta", "ref-old", setup.old)
    assert want_new != want_old
    assert upload(setup, "shared", tar_dir(setup.old), "&owner=ta").status_code == 201
    with streaming(setup, "ta", "shared", max_tokens=900) as events:
        next(events)  # A's request is running on the engine
        drain = threading.Thread(target=lambda: list(events))
        drain.start()  # and runs to its end
        forced = admin(setup, "DELETE", "/admin/adapters/shared?force=true")
        assert forced.status_code in (200, 202), forced.text
        poll(lambda: _created(upload(setup, "shared", tar_dir(setup.new), "&owner=tb")),
             "the name to be accepted again", timeout_s=120, interval_s=0.2)
        assert text_of(complete(setup, "tb", "shared")) == want_new
        drain.join(120)
    wait_engines_idle(setup.engine.url)


def test_racing_registrations_of_one_name_record_one_and_serve_its_weights(
        setup: Setup) -> None:
    """Registrations load on the engines before they are recorded: of several racing for a
    name (different tenants, different weights), one is recorded, the others get 409, and
    the name answers with the recorded weights whatever the engine loaded last."""
    want = {"ta": reference(setup, "ta", "race-ref-old", setup.old),
            "tb": reference(setup, "tb", "race-ref-new", setup.new)}
    owners = ["ta", "tb"] * 3
    with ThreadPoolExecutor(len(owners)) as pool:
        answers = list(pool.map(lambda owner: register(
            setup, "race", setup.old if owner == "ta" else setup.new, owner=owner), owners))
    assert sorted(a.status_code for a in answers) == [201] + [409] * 5, \
        [a.text for a in answers]
    winner = owners[[a.status_code for a in answers].index(201)]
    assert text_of(complete(setup, winner, "race")) == want[winner]
    loser = "tb" if winner == "ta" else "ta"
    assert complete(setup, loser, "race").status_code == 404


def test_requests_run_on_the_registered_weights_whatever_the_gateway_last_saw(
        setup: Setup, tiny_model_dir: Path) -> None:
    """An engine may hold other weights under a registered name than its gateway last saw
    (a registration that lost the race for the name loaded its own there, then unloaded
    them). Requests carry the digest they mean: the engine refuses them, the gateway loads
    the registered weights again, and the answer is theirs. This gateway polls once a
    minute, so it sees nothing change in between."""
    want_old = reference(setup, "ta", "stale-ref-old", setup.old)
    assert want_old != reference(setup, "ta", "stale-ref-new", setup.new)
    slow = start_gateway(tiny_model_dir, [setup.engine.url], setup.root, "--admin-key", ADMIN,
                         "--poll-interval-s", "60")
    with running(slow):
        view = Setup(setup.engine, slow, setup.uploads, setup.root, setup.old, setup.new, {})
        assert admin(view, "POST", "/admin/tenants", json={"tenant_id": "ta"}
                     ).status_code == 201
        view.keys["ta"] = admin(view, "POST", "/admin/tenants/ta/keys").json()["key"]
        assert register(view, "stale", setup.old, owner="ta").status_code == 201
        assert text_of(complete(view, "ta", "stale")) == want_old
        replaced = httpx.post(setup.engine.url + "/adapters", timeout=60.0,
                              json={"name": "stale", "path": str(setup.new)})
        assert replaced.status_code == 200, replaced.text
        assert text_of(complete(view, "ta", "stale")) == want_old
        old_digest = admin(view, "GET", "/admin/adapters/stale").json()["digest"]
        held = {a["name"]: a["digest"] for a in
                httpx.get(setup.engine.url + "/adapters", timeout=60.0).json()}
        assert held["stale"] == old_digest
        assert admin(view, "DELETE", "/admin/adapters/stale").status_code == 200
    wait_engines_idle(setup.engine.url)


def test_force_delete_of_a_busy_adapter_is_pending_until_its_requests_end(
        setup: Setup) -> None:
    tag = instance_tag(setup.engine.url, ADMIN)  # the engine's id: never its URL
    assert upload(setup, "bot", tar_dir(setup.old), "&owner=ta").status_code == 201
    bot = Path(admin(setup, "GET", "/admin/adapters/bot").json()["path"])
    assert bot.parent == setup.uploads.resolve()
    with streaming(setup, "ta", "bot", max_tokens=900) as events:
        next(events)  # A's request is running
        busy = admin(setup, "DELETE", "/admin/adapters/bot")
        assert busy.status_code == 409
        assert f"is in use on ['{tag}']" in busy.json()["error"]["message"]
        # vLLM's unload takes no force: its refusal points at the call that does.
        vllm_busy = admin(setup, "POST", "/v1/unload_lora_adapter", json={"lora_name": "bot"})
        assert vllm_busy.status_code == 409
        assert "DELETE /admin/adapters/bot?force=true" in vllm_busy.json()["error"]["message"]
        pending = admin(setup, "DELETE", "/admin/adapters/bot?force=true")
        assert pending.status_code == 202, pending.text
        assert pending.json()["status"] == "pending_delete"
        assert pending.json()["held_by"] == [tag]
        assert set(pending.json()["unloaded"]) <= {tag}
        assert "http://" not in busy.text + pending.text
        assert admin(setup, "GET", "/admin/adapters/bot").json()["status"] == "deleting"
        assert complete(setup, "ta", "bot").status_code == 404  # no new requests
        refused = upload(setup, "bot", tar_dir(setup.new), "&owner=tb")
        assert refused.status_code == 409
        assert refused.json()["error"]["code"] == "adapter_deleting"
        assert (bot / "adapter_model.safetensors").is_file()
    # A's request ends (the client went away): the delete completes by itself.
    poll(functools.partial(deleted, setup, "bot"), "the pending delete to complete")
    # The record goes first (nothing loads the files after), then the directory.
    poll(lambda: not bot.exists(), "the deleted upload's directory to go")
    assert upload(setup, "bot", tar_dir(setup.new), "&owner=tb").status_code == 201
    # A directory of its own per upload: the new one never reuses the old one's.
    assert Path(admin(setup, "GET", "/admin/adapters/bot").json()["path"]) != bot
    wait_engines_idle(setup.engine.url)


def test_admin_answers_name_instances_by_their_opaque_id(setup: Setup) -> None:
    """Admin bodies name an instance by the id x-loragate-instance and /instances' public_id
    carry, never by its URL; placement calls take that id (or the URL) in ``instance``."""
    tag = instance_tag(setup.engine.url, ADMIN)
    registered = register(setup, "ids", setup.new, owner="tb")
    assert registered.status_code == 201, registered.text
    shown = admin(setup, "GET", "/instances").json()
    assert [i["public_id"] for i in shown] == [tag]
    served = complete(setup, "tb", "ids")
    assert served.headers["x-loragate-instance"] == tag
    wait_engines_idle(setup.engine.url)
    status = admin(setup, "GET", "/admin/adapters/ids")
    assert list(registered.json()["instances"]) == list(status.json()["instances"]) == [tag]
    placements = [
        admin(setup, "POST", "/admin/adapters/ids/pin", json={"instance": tag}),
        admin(setup, "POST", "/admin/adapters/ids/pin",
              json={"instance": setup.engine.url, "pinned": False}),
        admin(setup, "POST", "/admin/adapters/ids/unload", json={}),
        admin(setup, "POST", "/admin/adapters/ids/load", json={})]
    assert [p.json()["instances"] for p in placements] == [{tag: "ok"}] * 4
    admin(setup, "POST", "/admin/adapters/ids/unload", json={})
    again = admin(setup, "POST", "/admin/adapters/ids/unload", json={})
    assert again.status_code == 200 and again.json()["instances"] == {tag: "not loaded"}
    assert admin(setup, "POST", "/admin/adapters/ids/load", json={}).status_code == 200
    unknown = admin(setup, "POST", "/admin/adapters/ids/load",
                    json={"instance": "http://10.0.0.1:9"})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "instance"
    deleted = admin(setup, "DELETE", "/admin/adapters/ids")
    assert deleted.json() == {"name": "ids", "status": "deleted", "unloaded": {tag: "ok"}}
    for answer in (registered, status, *placements, unknown, deleted):
        assert "http://" not in answer.text, answer.text


def test_engine_holding_other_weights_under_the_name_is_reloaded_or_refused(
        setup: Setup) -> None:
    want_new = reference(setup, "tb", "ref-new-2", setup.new)
    # An engine that kept an adapter the gateway no longer knows (it was unreachable when
    # that adapter was deleted): same name, the old weights.
    engine = httpx.Client(base_url=setup.engine.url, timeout=60.0)
    with engine:
        uploaded = upload(setup, "kept", tar_dir(setup.new), "&owner=tb")
        assert uploaded.status_code == 201  # and loaded on the engine: the new weights
        assert engine.post("/adapters", json={"name": "kept", "path": str(setup.old)}
                           ).status_code == 200  # replaced there behind the gateway's back

        def gateway_sees_the_old_weights() -> bool:
            status = admin(setup, "GET", "/admin/adapters/kept").json()
            return status["instances"][instance_tag(setup.engine.url, ADMIN)]["digest"] not in (
                None, uploaded.json()["digest"])

        poll(gateway_sees_the_old_weights, "a poll to report the engine's other weights")
        body = {"prompt_token_ids": PROMPT, "lora": "kept", "request_id": "old-user",
                "params": {"max_tokens": 900, "ignore_eos": True}}
        with engine.stream("POST", "/generate", json=body) as response:
            lines = response.iter_lines()  # kept: a dropped iterator closes the connection
            assert json.loads(next(lines))["finished"] is False
            busy = complete(setup, "tb", "kept")
            assert busy.status_code == 503, busy.text
            assert busy.json()["error"]["code"] == "adapter_busy"
            assert busy.headers["retry-after"] == "1"
            engine.post("/abort", json={"request_id": "old-user"})
        poll(functools.partial(engine_is_idle, setup.engine.url), "the engine to be idle")
        assert text_of(complete(setup, "tb", "kept")) == want_new  # reloaded: new digest


def test_delete_removes_only_directories_its_upload_created(setup: Setup) -> None:
    operator_dir = shutil.copytree(setup.new, setup.root / "operator-adapter")
    # A sibling whose path starts with the uploads directory's path.
    evil = shutil.copytree(setup.new, setup.root / "uploads-evil" / "x")
    for name, path in (("by-path", operator_dir), ("evil", evil)):
        assert register(setup, name, path, owner="tb").status_code == 201
        assert admin(setup, "DELETE", f"/admin/adapters/{name}").status_code == 200
        assert (path / "adapter_model.safetensors").is_file()
    assert upload(setup, "up", tar_dir(setup.new), "&owner=tb").status_code == 201
    up = Path(admin(setup, "GET", "/admin/adapters/up").json()["path"])
    # A second name reaches no tenant the upload's own does not: not another, not everyone.
    for fields in ({"owner": "ta"}, {"public": True}):
        refused = register(setup, "up-wider", up, **fields)
        assert refused.status_code == 400, refused.text
        assert (refused.json()["error"]["param"], refused.json()["error"]["code"]) == (
            "path", "adapter_private")
    vllm = admin(setup, "POST", "/v1/load_lora_adapter",
                 json={"lora_name": "up-wider", "lora_path": str(up)})
    assert (vllm.status_code, vllm.json()["error"]["param"]) == (400, "lora_path")
    assert complete(setup, "ta", "up-wider").status_code == 404
    assert register(setup, "up-alias", up, owner="tb").status_code == 201
    assert admin(setup, "DELETE", "/admin/adapters/up-alias").status_code == 200
    assert (up / "adapter_model.safetensors").is_file()
    assert complete(setup, "tb", "up").status_code == 200
    wait_engines_idle(setup.engine.url)
    assert admin(setup, "DELETE", "/admin/adapters/up").status_code == 200
    assert not up.exists()  # the last record of the upload went


# ------------------------------------------------------------------- engine startup
def test_engine_starts_without_the_bad_or_outside_adapters_of_its_adapter_dir(
        setup: Setup, tiny_model_dir: Path, tmp_path: Path) -> None:
    adapter_dir = tmp_path / "adapters"
    adapter_dir.mkdir()
    shutil.copytree(setup.new, adapter_dir / "good")
    corrupt = shutil.copytree(setup.new, adapter_dir / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"garbage")
    outside = shutil.copytree(setup.old, tmp_path / "outside")
    (adapter_dir / "linked").symlink_to(outside, target_is_directory=True)
    engine = start_engine(tiny_model_dir, tmp_path, "--num-kv-blocks", "64",
                          "--adapter-dir", str(adapter_dir))
    try:
        engine.wait_ready()
        listed = httpx.get(engine.url + "/adapters", timeout=10.0).json()
        assert [a["name"] for a in listed] == ["good"]
        served = httpx.post(engine.url + "/generate", timeout=60.0, json={
            "prompt_token_ids": PROMPT, "lora": "good", "stream": False,
            "params": {"max_tokens": 4, "temperature": 0}})
        assert served.status_code == 200, served.text
        assert "not serving the adapter directory's corrupt" in engine.log()
    finally:
        engine.stop()


def test_parse_adapters_skips_links_that_lead_outside_the_dir(
        tiny_adapters: dict[str, Path], tmp_path: Path) -> None:
    from engine.adapter_roots import parse_adapters

    adapter_dir = tmp_path / "adapters"
    adapter_dir.mkdir()
    inside = shutil.copytree(tiny_adapters["a0"], adapter_dir / "real")
    (adapter_dir / "alias").symlink_to(inside, target_is_directory=True)  # stays inside
    (adapter_dir / "outside").symlink_to(tiny_adapters["a1"], target_is_directory=True)
    leaky = shutil.copytree(tiny_adapters["a0"], adapter_dir / "leaky")
    (leaky / "adapter_model.safetensors").unlink()
    (leaky / "adapter_model.safetensors").symlink_to(
        tiny_adapters["a1"] / "adapter_model.safetensors")
    assert parse_adapters([], str(adapter_dir)) == {"alias": str(inside.resolve()),
                                                   "real": str(inside.resolve())}


# ------------------------------------------------------------ vLLM's runtime endpoints

def test_vllm_runtime_adapter_endpoints_register_and_remove(setup: Setup) -> None:
    # vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter, behind the admin key.
    body = {"lora_name": "vllm-style", "lora_path": str(setup.old)}
    refused = httpx.post(setup.gateway.url + "/v1/load_lora_adapter", json=body, timeout=60,
                         headers={"Authorization": f"Bearer {setup.keys['ta']}"})
    assert refused.status_code in (401, 403)
    # A tenant's key is refused before the body is read, as on /admin/ (the body never comes).
    host, port = setup.gateway.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"POST /v1/load_lora_adapter HTTP/1.1\r\nHost: {host}\r\n"
                     f"Authorization: Bearer {setup.keys['ta']}\r\nContent-Type: "
                     f"application/json\r\nContent-Length: 8000000\r\n\r\n{{".encode())
        assert sock.recv(4096).startswith(b"HTTP/1.1 401 ")
    loaded = admin(setup, "POST", "/v1/load_lora_adapter", json=body)
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'vllm-style' added successfully."
    # Public (vLLM has no tenants): both tenants may use it, and it serves those weights.
    want = reference(setup, "ta", "vllm-style-ref", setup.old)
    assert text_of(complete(setup, "ta", "vllm-style")) == want
    assert text_of(complete(setup, "tb", "vllm-style")) == want
    again = admin(setup, "POST", "/v1/load_lora_adapter", json=body)
    assert again.status_code == 409
    # vLLM's in-place replacement is not done here: refused, naming the field.
    inplace = admin(setup, "POST", "/v1/load_lora_adapter", json={**body, "load_inplace": True})
    assert inplace.status_code == 400, inplace.text
    assert inplace.json()["error"]["param"] == "load_inplace"
    wait_engines_idle(setup.engine.url)
    removed = admin(setup, "POST", "/v1/unload_lora_adapter",
                    json={"lora_name": "vllm-style"})
    assert removed.status_code == 200, removed.text
    assert complete(setup, "ta", "vllm-style").status_code == 404
    assert admin(setup, "POST", "/v1/unload_lora_adapter",
                 json={"lora_name": "vllm-style"}).status_code == 404
