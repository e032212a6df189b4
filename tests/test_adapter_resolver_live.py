"""The opt-in adapter resolver through `loragate serve` (embedded engine, tiny model) and the
official `openai` client: a request naming an adapter that lies in a resolver root loads it
on first use (once, however many requests race for it) and is served with it; names outside
the roots, path tricks and broken directories are plain 404s, and the server keeps serving."""

from __future__ import annotations

import concurrent.futures
import shutil
from pathlib import Path

import httpx
import openai

from tests.live_servers import running, start_serve


def test_unknown_models_load_from_the_resolver_roots(tiny_model_dir: Path,
                                                     tiny_adapters: dict[str, Path],
                                                     tmp_path: Path) -> None:
    root = tmp_path / "resolvable"
    root.mkdir()
    shutil.copytree(tiny_adapters["a1"], root / "style-a")
    shutil.copytree(tiny_adapters["a0"], root / "style-b")
    (root / "broken").mkdir()
    (root / "broken" / "adapter_config.json").write_text("{not json")
    (tmp_path / "outside").mkdir()
    shutil.copytree(tiny_adapters["a0"], tmp_path / "outside" / "hidden")
    server = start_serve(tmp_path, "--model", str(tiny_model_dir), "--num-kv-blocks", "64",
                         "--adapter-resolver-roots", str(root))
    with running(server), openai.OpenAI(base_url=server.url + "/v1", api_key="unused",
                                        max_retries=0, timeout=60.0) as client:
        base = tiny_model_dir.name
        assert [m.id for m in client.models.list()] == [base]

        def ask(model: str) -> str:
            done = client.completions.create(model=model, prompt="hello world", max_tokens=8,
                                             temperature=0, extra_body={"ignore_eos": True})
            return done.choices[0].text

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(ask, ["style-a"] * 4))
        assert len(set(texts)) == 1 and texts[0] != ask(base)
        assert ask("style-b") not in (texts[0], ask(base))
        assert {m.id for m in client.models.list()} == {base, "style-a", "style-b"}
        for name in ("nope", "broken", "../outside/hidden", "hidden", "style-a/.."):
            answer = httpx.post(server.url + "/v1/completions", timeout=30.0, json={
                "model": name, "prompt": "hi", "max_tokens": 2})
            assert answer.status_code == 404, (name, answer.text)
            assert answer.json()["error"]["code"] == "model_not_found"
        assert ask("style-a") == texts[0]
        log = server.log()
        assert log.count("adapter resolver: registered style-a") == 1
