"""SchedulerOutput -> flat tensors -> forward -> sampled tokens. Owns the model, the KV
tensors, the swap tensors and its own copies of the running requests (engine/input_batch.py);
owns no scheduling state."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.attention import build_step_metadata
from engine.cascade_spans import span_kernel_fits
from engine.config import EngineConfig
from engine.cpu_kernels import load_fused_ops, load_paged_decode, load_span_attention
from engine.decode_graphs import DecodeGraphs
from engine.grammar_matchers import GrammarMatchers
from engine.input_batch import InputBatch
from engine.kv_cache import blocks_for
from engine.lazy_zeros import lazy_zeros
from engine.logits_processors import PenaltyCounts, RowState, adjust_logits
from engine.models.llama import LlamaForFlatBatch
from engine.paged_decode import CopyBuffers
from engine.prompt_logprobs import PromptLogprob, plan_prompt_rows, score_prompt_rows
from engine.sampler import NO_TOKEN, NON_FINITE, Sampler
from engine.scheduler_output import SchedulerOutput
from engine.triton_attention import default_block_m, resolve_attention_backend
from lora.layers import LoraSlots
from lora.ops import build_lora_metadata, resolve_backend


@dataclass
class RunnerOutput:
    """Tokens sampled this step, keyed by request id, and where the time went."""

    sampled: dict[str, int] = field(default_factory=dict)
    no_token: list[str] = field(default_factory=list)
    """Requests due a token whose constraints allowed none (nothing sampled for them)."""
    non_finite: list[str] = field(default_factory=list)
    """Requests due a token whose logits were NaN or +inf (nothing sampled for them)."""
    grammar_over_budget: dict[str, str] = field(default_factory=dict)
    """Requests whose grammar cost too much to match, with why (their tokens dropped)."""
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[PromptLogprob]]] = field(default_factory=dict)
    """Per request asking for them: (first prompt position scored, one entry per position)."""
    prepare_seconds: float = 0.0
    forward_seconds: float = 0.0
    sample_seconds: float = 0.0


def kv_bytes_per_block(model: LlamaForFlatBatch, block_size: int, dtype: torch.dtype) -> int:
    s = model.shape
    elem = torch.empty(0, dtype=dtype).element_size()
    return 2 * s.num_layers * block_size * s.num_kv_heads * s.head_dim * elem


class ModelRunner:
    """Runs one step's flat batch: decodes first (one query each), then prefill chunks."""

    def __init__(self, config: EngineConfig, model: LlamaForFlatBatch, device: torch.device,
                 dtype: torch.dtype, stop_token_ids: frozenset[int] = frozenset()) -> None:
        self.model = model
        self.device = device
        self.block_size = config.block_size
        triton = resolve_attention_backend(config.attention_backend, device) == "triton"
        self.triton_block_m = default_block_m(device) if triton else None
        # Cascade attention has no score soft-capping (Gemma 2): such models never plan it.
        self.cascade_attention = (config.cascade_attention and model.shape.attn_softcap is None
                                  and not triton)
        self.layer_windows = tuple(dict.fromkeys(model.shape.layer_windows))
        self.copy_buffers = CopyBuffers()
        # Built (compiled on first use) here, on the engine's thread, not in the first step.
        native = config.native_kernels and device.type == "cpu"
        self.decode_kernel = load_paged_decode() if native and not triton else None
        # Cascade attention's nodes and chunks in one compiled call per layer (float32 only).
        self.span_kernel = (load_span_attention() if native and not triton
                            and span_kernel_fits(dtype, model.shape.head_dim) else None)
        model.use_fused_ops(load_fused_ops() if native else None)
        per_block = kv_bytes_per_block(model, config.block_size, dtype)
        self.num_blocks = config.num_kv_blocks or config.kv_cache_memory_bytes // per_block
        if self.num_blocks < 1:
            raise ValueError(f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} holds no "
                             f"block of {per_block} bytes")
        self.num_swap_blocks = (
            config.swap_space_bytes // per_block if config.preemption_mode == "swap" else 0)
        s = model.shape
        block_shape = (config.block_size, s.num_kv_heads, s.head_dim)
        # Decode-only steps run on persistent buffers (engine/decode_graphs.py) with the
        # Triton kernels, or on a CPU with the compiled decode kernel when cascade attention
        # (which plans each step's shared blocks anew) is off. Captured graphs pad their
        # batches with rows that write to one spare block, past the blocks the cache manager
        # hands out (self.num_blocks).
        static_cpu = self.decode_kernel is not None and not self.cascade_attention
        graphs = config.cuda_graphs and (triton or static_cpu)
        cache_blocks = self.num_blocks + (1 if graphs else 0)
        self.kv_caches = [
            (lazy_zeros((cache_blocks, *block_shape), dtype, device),
             lazy_zeros((cache_blocks, *block_shape), dtype, device))
            for _ in range(s.num_layers)
        ]
        def host_blocks() -> torch.Tensor:  # pinned for the copies from and to a GPU
            swap_shape = (self.num_swap_blocks, *block_shape)
            if device.type == "cuda":
                return torch.zeros(swap_shape, dtype=dtype, pin_memory=True)
            return lazy_zeros(swap_shape, dtype, torch.device("cpu"))

        self.swap_caches = [(host_blocks(), host_blocks()) for _ in range(s.num_layers)] \
            if self.num_swap_blocks else []
        self.sampler = Sampler(config.seed, device)
        self.grammars = GrammarMatchers(config.max_num_seqs)
        self.stop_token_ids = stop_token_ids
        """The model's end-of-sequence ids (banned, with a request's own, under min_tokens)."""
        self.penalty_counts = PenaltyCounts(config.max_num_seqs, s.vocab_size, device)
        # A table never holds more blocks than the cache, nor than the model's context.
        max_blocks = min(self.num_blocks,
                         blocks_for(s.max_position_embeddings, config.block_size))
        self.batch = InputBatch(config.max_num_seqs, max_blocks, config.max_num_batched_tokens,
                                config.block_size, device)
        self.lora_slots = (LoraSlots(model.model.layers, s.lora_targets(), config.max_loras,
                                     config.max_lora_rank, dtype, device)
                           if config.max_loras else None)
        self.decode_graphs = DecodeGraphs(
            model, self.kv_caches, config.max_num_seqs, max_blocks, config.block_size,
            self.layer_windows, config.max_model_len or s.max_position_embeddings,
            pad_block=self.num_blocks, num_lora_slots=config.max_loras,
            block_m=default_block_m(device), device=device, capture=True,
            cpu_kernel=self.decode_kernel if static_cpu and not triton else None,
        ) if graphs else None
        # Graph steps with adapters need the Triton LoRA kernels (the torch path reads the
        # step's segments on the host, which a replay cannot change); else they run eagerly.
        self.graph_lora = graphs and resolve_backend("auto", device) == "triton"
        if self.decode_graphs is not None and self.decode_graphs.capture:
            self.decode_graphs.capture_all(with_lora=self.graph_lora and config.max_loras > 0)

    def release(self, request_ids: list[str]) -> None:
        """Drop the per-request sampling state (generators, grammar matchers) of requests
        that ended."""
        self.sampler.release(request_ids)
        self.grammars.release(request_ids)

    def abandon(self, sched: SchedulerOutput) -> None:
        """A step that is not run (nothing to do) or failed (the scheduler rolls its
        requests back to recompute): forget every request it ended, preempted or scheduled,
        whether or not execute() got to apply it. Those that run again come back whole."""
        self.release(sched.finished_request_ids)
        self.batch.forget(sched.finished_request_ids + sched.preempted_request_ids
                          + [c.request_id for c in sched.chunks])

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        out = RunnerOutput()
        self.release(sched.finished_request_ids)
        t0 = time.perf_counter()
        self.batch.apply(sched)
        for new in sched.new_requests:
            if new.sampling_params.penalized:
                self.penalty_counts.start(self.batch.requests[new.request_id].row,
                                          new.token_ids[:new.num_prompt_tokens],
                                          new.token_ids[new.num_prompt_tokens:])
        self._swap(sched)
        for slot, adapter in sched.lora_loads:
            assert self.lora_slots is not None
            self.lora_slots.load(slot, adapter)
        if not sched.chunks:
            return out
        chunks = sorted(sched.chunks, key=lambda c: c.num_tokens != 1)  # decodes first
        inputs = self.batch.prepare(chunks)
        graphs = self.decode_graphs
        if (graphs is not None and graphs.handles(len(inputs.decodes), len(inputs.prefills))
                and (self.graph_lora or not inputs.has_lora)):
            staged = graphs.stage(inputs.input_ids, inputs.positions, inputs.decodes,
                                  inputs.decode_rows, self.batch.tables,
                                  inputs.token_slots if inputs.has_lora else None)
            t1 = self._sync_time()
            hidden = graphs.run(staged)
        else:
            meta = build_step_metadata(inputs.decodes, inputs.prefills, self.block_size,
                                       self.layer_windows, self.device,
                                       cascade=self.cascade_attention,
                                       buffers=self.copy_buffers, kernel=self.decode_kernel,
                                       triton_block_m=self.triton_block_m,
                                       span_kernel=self.span_kernel)
            # The runs and rest layout serve only the torch path's fused op.
            lora = build_lora_metadata(
                inputs.token_slots, self.device,
                find_runs=resolve_backend("auto", self.device) == "torch"
            ) if inputs.has_lora else None
            t1 = self._sync_time()
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, meta, lora)
        logits = self.model.compute_logits(hidden[inputs.sample_rows])
        prompt_rows = plan_prompt_rows(chunks, self.batch.requests)
        if prompt_rows:
            out.prompt_logprobs = score_prompt_rows(hidden, prompt_rows, self.batch.requests,
                                                    self.model.compute_logits)
        t2 = self._sync_time()
        ids = [c.request_id for c in chunks if c.sample]
        rows = self.batch.row_states(ids)
        # The grammar first: the logprobs reported are the distribution over the tokens the
        # grammar allows (as vLLM's), before penalties and biases.
        tokens, logprobs = self.sampler.sample(
            self.grammars.mask(logits, logits, ids), ids, rows,
            lambda raw: adjust_logits(raw, rows, self.stop_token_ids, self.penalty_counts))
        sampled = list(zip(ids, rows, tokens, logprobs, strict=True))
        if min(tokens, default=0) < 0:
            out.no_token = [r for r, token in zip(ids, tokens, strict=True) if token == NO_TOKEN]
            out.non_finite = [r for r, token in zip(ids, tokens, strict=True)
                              if token == NON_FINITE]
            sampled = [s for s in sampled if s[2] >= 0]
        out.grammar_over_budget = self.grammars.accept([s[0] for s in sampled],
                                                       [s[2] for s in sampled])
        # Rows dropped above get no token: their requests end (LLMEngine.step).
        sampled = [s for s in sampled if s[0] not in out.grammar_over_budget]
        self._count_penalized([s[1] for s in sampled], [s[2] for s in sampled])
        for request_id, _, token, lp in sampled:
            self.batch.append_sampled(request_id, token)
            out.sampled[request_id] = token
            if lp is not None:
                out.logprobs[request_id] = lp
        t3 = time.perf_counter()
        out.prepare_seconds, out.forward_seconds, out.sample_seconds = t1 - t0, t2 - t1, t3 - t2
        return out

    def _count_penalized(self, rows: list[RowState], tokens: list[int]) -> None:
        counted = [(r.counts_row, token) for r, token in zip(rows, tokens, strict=True)
                   if r.params.penalized]
        if counted:
            self.penalty_counts.add(
                torch.tensor([row for row, _ in counted], dtype=torch.int64, device=self.device),
                torch.tensor([token for _, token in counted], dtype=torch.int64,
                             device=self.device))

    def _swap(self, sched: SchedulerOutput) -> None:
        # Swap-outs first: their device blocks may be reused by this very step.
        for pairs, out_dir in ((sched.blocks_to_swap_out, True), (sched.blocks_to_swap_in, False)):
            if not pairs:
                continue
            src = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
            dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
            for device_kv, swap_kv in zip(self.kv_caches, self.swap_caches, strict=True):
                for dev_t, cpu_t in zip(device_kv, swap_kv, strict=True):
                    if out_dir:
                        cpu_t[dst] = dev_t[src.to(self.device)].to("cpu")
                    else:
                        dev_t[dst.to(self.device)] = cpu_t[src].to(self.device)

    def _sync_time(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()
