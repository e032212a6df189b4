"""The metrics the Gateway API Inference Extension's endpoint picker reads (vLLM's names),
scraped from a live engine with prometheus_client's own parser while a request with an
adapter runs: queue and running counts, KV usage as a fraction, and the LoRA info gauge with
max_lora and the adapters on the device."""

from __future__ import annotations

import json
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.engine_server.helpers import GREEDY, NUM_KV_BLOCKS, long_prompt, wait_idle


def _scrape(http: httpx.Client) -> dict[str, list[tuple[dict[str, str], float]]]:
    families = text_string_to_metric_families(http.get("/metrics").text)
    return {f.name: [(s.labels, s.value) for s in f.samples] for f in families
            if f.name.startswith("vllm:")}


def test_the_endpoint_picker_metrics_under_vllm_names(http: httpx.Client) -> None:
    body = {"prompt_token_ids": long_prompt(7), "lora": "a0", "stream": True,
            "params": {**GREEDY, "max_tokens": 400, "ignore_eos": True}}
    with http.stream("POST", "/generate", json=body) as stream:
        lines = stream.iter_lines()
        json.loads(next(lines))  # running: its first token is out
        before = time.time()
        metrics = _scrape(http)
    wait_idle(http)
    [(labels, running)] = metrics["vllm:num_requests_running"]
    assert running == 1.0 and labels["model_name"]
    [(_, waiting)] = metrics["vllm:num_requests_waiting"]
    assert waiting == 0.0
    [(_, usage)] = metrics["vllm:kv_cache_usage_perc"]
    assert 0.0 < usage <= 1.0
    assert metrics["vllm:gpu_cache_usage_perc"] == metrics["vllm:kv_cache_usage_perc"]
    [(lora, stamp)] = metrics["vllm:lora_requests_info"]
    assert stamp >= before - 1.0  # the picker keeps the newest series by this value
    assert int(lora["max_lora"]) >= 1
    assert "a0" in lora["running_lora_adapters"].split(",")
    assert lora["waiting_lora_adapters"] == ""
    [(config, _)] = metrics["vllm:cache_config_info"]
    assert config["num_gpu_blocks"] == str(NUM_KV_BLOCKS) and int(config["block_size"]) > 0
    idle = _scrape(http)
    assert idle["vllm:num_requests_running"][0][1] == 0.0
    # Residency, not only use: a0 keeps its slot after its request ended.
    assert "a0" in idle["vllm:lora_requests_info"][0][0]["running_lora_adapters"].split(",")
