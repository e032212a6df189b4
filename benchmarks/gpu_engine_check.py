"""Engine-level figures for benchmarks/gpu_check.py, on a random-weight model of a given shape
(no weights to download: load_format="dummy" builds seeded weights on the device).

- throughput of one mixed workload through the engine, and through transformers with static
  batching (padded batches, every sequence run to its batch's longest output: the way
  serving worked before continuous batching), counting only the tokens each request asked for;
- the decode-only step time at a fixed batch against the model forward inside it, with the
  decode graphs (engine/decode_graphs.py) and with every step eager;
- the same workload with every request on one of 16 LoRA adapters against none (alternated,
  twice each), and a shorter one on the engine against PEFT's per-adapter batching.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from engine.config import EngineConfig
from engine.demo_model import EOS, train_tokenizer
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

LLAMA3_8B_SHAPE = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                   "max_position_embeddings": 8192, "rope_theta": 500000.0}
TINY_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
              "max_position_embeddings": 1024}
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class Workload:
    """Requests as (prompt ids, output tokens), all arriving at once."""

    requests: list[tuple[list[int], int]]

    @classmethod
    def mixed(cls, n: int, prompt: tuple[int, int], output: tuple[int, int], vocab: int,
              seed: int = 0) -> Workload:
        rng = random.Random(seed)
        return cls([([rng.randrange(10, vocab) for _ in range(rng.randint(*prompt))],
                     rng.randint(*output)) for _ in range(n)])

    @property
    def output_tokens(self) -> int:
        return sum(out for _, out in self.requests)

    @property
    def total_tokens(self) -> int:
        return sum(len(p) + out for p, out in self.requests)


def write_model_dir(path: Path, shape: dict[str, Any]) -> Path:
    """config.json and a trained tokenizer (no weights: the engine loads with
    load_format="dummy"). The tokenizer's vocabulary may be smaller than the model's; ids
    past it decode to nothing, which is all a throughput run needs."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(min(shape["vocab_size"], 8192))
    tokenizer.save_pretrained(str(path))
    LlamaConfig(**shape, tie_word_embeddings=False, dtype="bfloat16",
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.convert_tokens_to_ids(EOS),
                pad_token_id=tokenizer.pad_token_id).save_pretrained(str(path))
    return path


def write_adapters(root: Path, shape: dict[str, Any], count: int, rank: int) -> list[Path]:
    """``count`` PEFT-format adapters (seeded random A and B) on q/k/v/o of every layer."""
    hidden, layers = shape["hidden_size"], shape["num_hidden_layers"]
    kv_width = hidden // shape["num_attention_heads"] * shape["num_key_value_heads"]
    widths = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv_width),
              "v_proj": (hidden, kv_width), "o_proj": (hidden, hidden)}
    paths = []
    for i in range(count):
        gen = torch.Generator().manual_seed(1000 + i)
        tensors = {}
        for layer in range(layers):
            for module, (width_in, width_out) in widths.items():
                key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
                tensors[f"{key}.lora_A.weight"] = (
                    torch.randn(rank, width_in, generator=gen) * 0.01).to(torch.bfloat16)
                tensors[f"{key}.lora_B.weight"] = (
                    torch.randn(width_out, rank, generator=gen) * 0.01).to(torch.bfloat16)
        path = root / f"adapter-{i}"
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
            "target_modules": list(LORA_TARGETS), "task_type": "CAUSAL_LM"}))
        paths.append(path)
    return paths


def run_engine(engine: LLMEngine, workload: Workload, adapters: list[str] | None = None,
               tag: str = "w") -> dict[str, float]:
    """All requests at once, greedy, to their full length; seconds and tokens per second."""
    t0 = time.perf_counter()
    for i, (prompt, out) in enumerate(workload.requests):
        engine.add_request(f"{tag}{i}", prompt, SamplingParams(
            max_tokens=out, temperature=0.0, ignore_eos=True),
            lora=adapters[i % len(adapters)] if adapters else None)
    while engine.has_unfinished_requests():
        engine.step()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "output_tok_per_s": workload.output_tokens / seconds,
            "total_tok_per_s": workload.total_tokens / seconds}


def decode_step_timing(engine: LLMEngine, seqs: int, prompt_len: int, steps: int,
                       vocab: int) -> dict[str, float]:
    """Mean decode-only step time with ``seqs`` running, the model forward inside it and the
    other phases (engine.metrics' per-step timing; the forward phase ends with a device
    sync)."""
    rng = random.Random(1)
    for i in range(seqs):
        engine.add_request(f"d{i}", [rng.randrange(10, vocab) for _ in range(prompt_len)],
                           SamplingParams(max_tokens=steps + 64, temperature=0.0,
                                          ignore_eos=True))
    # Prefill (several steps) until every request has its first token, then 3 warm steps.
    while engine.stats().num_waiting or any(
            len(r.output_token_ids) == 0 for r in engine.scheduler.requests.values()):
        engine.step()
    for _ in range(3):
        engine.step()
    phases = dict.fromkeys(("schedule", "prepare", "forward", "sample", "output"), 0.0)
    for _ in range(steps):
        engine.step()
        timing = engine.metrics.last_step
        assert timing is not None
        for name in phases:
            phases[name] += getattr(timing, name) / steps
    for i in range(seqs):
        engine.abort_request(f"d{i}")
    step = sum(phases.values())
    return {"seqs": seqs, "step_ms": step * 1e3, "forward_ms": phases["forward"] * 1e3,
            "step_over_forward": step / phases["forward"],
            **{f"{name}_ms": seconds * 1e3 for name, seconds in phases.items()
               if name != "forward"}}


def _static_batches(model: Any, workload: Workload, batch: int,
                    device: torch.device, pad: int) -> float:
    """Seconds of generate (a transformers or PEFT model) over padded batches of ``batch``
    requests (left padding), each batch run to its longest output."""
    t0 = time.perf_counter()
    for start in range(0, len(workload.requests), batch):
        group = workload.requests[start:start + batch]
        width = max(len(p) for p, _ in group)
        ids = torch.full((len(group), width), pad, dtype=torch.int64)
        mask = torch.zeros((len(group), width), dtype=torch.int64)
        for row, (prompt, _) in enumerate(group):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        longest = max(out for _, out in group)
        model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                       max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                       pad_token_id=pad)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _rates(workload: Workload, seconds: float) -> dict[str, float]:
    return {"seconds": seconds, "output_tok_per_s": workload.output_tokens / seconds,
            "total_tok_per_s": workload.total_tokens / seconds}


@torch.inference_mode()
def transformers_baselines(model_dir: Path, workload: Workload, batch: int,
                           peft_workload: Workload, adapters: list[Path],
                           device: torch.device, dtype: torch.dtype, record: dict[str, Any]
                           ) -> None:
    """transformers with static batching over ``workload`` (throughput counts only the
    tokens each request asked for), then the same model as a PEFT model holding every
    adapter, serving ``peft_workload`` (request i on adapter i mod n) in per-adapter static
    batches with set_adapter() between them: how adapters are served without a multi-LoRA
    engine. Random weights of the same shape, built on the device."""
    from peft import PeftModel

    config = LlamaConfig.from_pretrained(str(model_dir))
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype).eval()
    pad = config.pad_token_id or 0
    record["transformers_static"] = _rates(workload, _static_batches(model, workload, batch,
                                                                     device, pad))
    peft = PeftModel.from_pretrained(model, str(adapters[0]), adapter_name="a0")
    for i, path in enumerate(adapters[1:], 1):
        peft.load_adapter(str(path), adapter_name=f"a{i}")
    by_adapter: dict[int, list[tuple[list[int], int]]] = {}
    for i, request in enumerate(peft_workload.requests):
        by_adapter.setdefault(i % len(adapters), []).append(request)
    seconds = 0.0
    for index, requests in sorted(by_adapter.items()):
        peft.set_adapter(f"a{index}")
        seconds += _static_batches(peft, Workload(requests), batch, device, pad)
    record["peft_per_adapter"] = _rates(peft_workload, seconds)
    del model, peft


def engine_checks(work_dir: Path, shape: dict[str, Any], device: torch.device,
                  dtype_name: str, workload: Workload, peft_workload: Workload,
                  engine_knobs: dict[str, Any],
                  hf_batch: int, decode_seqs: int, decode_prompt: int, decode_steps: int,
                  num_adapters: int, rank: int, record: dict[str, Any]) -> None:
    """Fill ``record`` section by section (a failure later keeps what came before)."""
    model_dir = write_model_dir(work_dir / "model", shape)
    adapters = write_adapters(work_dir / "adapters", shape, num_adapters, rank)
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(
        model=str(model_dir), load_format="dummy", dtype=dtype_name,  # type: ignore[arg-type]
        device=str(device), max_loras=num_adapters, max_lora_rank=rank,
        max_cpu_loras=num_adapters, prefix_caching="off", **engine_knobs))
    for i, path in enumerate(adapters):
        engine.load_lora(f"a{i}", str(path))
    record["engine_build_s"] = time.perf_counter() - t0
    record["attention_backend"] = "triton" if engine.runner.triton_block_m else "torch"
    # Compile the kernels' variants for the workload's shapes (the decode graphs were
    # captured at start-up): the workload once with short outputs, untimed.
    run_engine(engine, Workload([(p, min(out, 4)) for p, out in workload.requests]),
               tag="warm")
    names = [f"a{i}" for i in range(num_adapters)]
    # Base and adapters alternated, twice each: the first timed run of a fresh engine has
    # measured slower than the ones after it, whatever it ran.
    runs: dict[str, list[dict[str, float]]] = {"engine": [], "engine_16_adapters": []}
    for repeat in range(2):
        runs["engine"].append(run_engine(engine, workload, tag=f"b{repeat}-"))
        runs["engine_16_adapters"].append(run_engine(engine, workload, names,
                                                     tag=f"l{repeat}-"))
    record["runs"] = runs
    for key, results in runs.items():
        record[key] = max(results, key=lambda r: r["output_tok_per_s"])
    record["adapters_over_base"] = (record["engine_16_adapters"]["output_tok_per_s"]
                                    / record["engine"]["output_tok_per_s"])
    record["engine_peft_workload"] = run_engine(engine, peft_workload, names, tag="p")
    # The same engine with its decode graphs set aside: every step eager.
    graphs, engine.runner.decode_graphs = engine.runner.decode_graphs, None
    record["decode_step_eager"] = decode_step_timing(engine, decode_seqs, decode_prompt,
                                                     decode_steps, shape["vocab_size"])
    engine.runner.decode_graphs = graphs
    record["decode_step"] = decode_step_timing(engine, decode_seqs, decode_prompt,
                                               decode_steps, shape["vocab_size"])
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    transformers_baselines(model_dir, workload, hf_batch, peft_workload, adapters, device,
                           {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype_name],
                           record)
    record["engine_over_transformers"] = (record["engine"]["output_tok_per_s"]
                                          / record["transformers_static"]["output_tok_per_s"])
    record["adapters_over_peft"] = (record["engine_peft_workload"]["output_tok_per_s"]
                                    / record["peft_per_adapter"]["output_tok_per_s"])
