"""The PEFT-style multi-adapter baseline: one transformers ``PeftModel`` holding every adapter,
requests grouped by adapter, ``set_adapter`` and a static left-padded ``generate`` per batch
of same-adapter requests (how a team serves adapters without a multi-LoRA engine)."""

from __future__ import annotations

import time
from collections import OrderedDict
from pathlib import Path

import torch
from peft import PeftModel

from benchmarks.throughput import RunResult, left_pad, load_hf_model, warmup_requests
from benchmarks.workloads import BenchRequest, total_output_tokens


def peft_generate_batch(model: PeftModel, batch: list[BenchRequest], pad_id: int) -> None:
    """Greedy generation of the batch with the active adapter, up to its longest output."""
    ids, mask = left_pad(batch, pad_id, model.device)
    new_tokens = max(r.output_len for r in batch)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         pad_token_id=pad_id)
    assert out.shape == (len(batch), ids.shape[1] + new_tokens), out.shape


def group_by_adapter(requests: list[BenchRequest], adapters: list[str], max_batch: int
                     ) -> list[tuple[str, list[BenchRequest]]]:
    """Batches of at most max_batch same-adapter requests: adapters in order of first
    arrival, requests in arrival order within an adapter."""
    groups: OrderedDict[str, list[BenchRequest]] = OrderedDict()
    for r, name in zip(requests, adapters, strict=True):
        groups.setdefault(name, []).append(r)
    return [(name, group[i:i + max_batch]) for name, group in groups.items()
            for i in range(0, len(group), max_batch)]


def run_peft_baseline(model_dir: str, requests: list[BenchRequest], adapters: list[str],
                      paths: dict[str, Path], device: torch.device, max_batch: int
                      ) -> RunResult:
    """PEFT per-adapter batching: one PeftModel with every used adapter loaded, and
    set_adapter() before each static batch of same-adapter requests."""
    names = sorted(set(adapters), key=lambda n: int(n.rsplit("-", 1)[1]))
    base = load_hf_model(model_dir, device)
    pad_id = int(base.config.pad_token_id)
    vocab_size = int(base.config.vocab_size)
    model = PeftModel.from_pretrained(base, str(paths[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(paths[name]), adapter_name=name)
    model.eval()
    batches = group_by_adapter(requests, adapters, max_batch)
    with torch.inference_mode():
        model.set_adapter(names[0])
        peft_generate_batch(model, warmup_requests(vocab_size)[:1], pad_id)  # untimed
        start, cpu_start = time.perf_counter(), time.process_time()
        for number, (name, batch) in enumerate(batches, 1):
            model.set_adapter(name)
            peft_generate_batch(model, batch, pad_id)
            print(f"  peft batch {number}/{len(batches)} ({name}, {len(batch)} requests) "
                  f"done ({time.perf_counter() - start:.1f}s)", flush=True)
        seconds = time.perf_counter() - start
    return RunResult("peft per-adapter batching", len(requests), total_output_tokens(requests),
                     seconds, time.process_time() - cpu_start)
