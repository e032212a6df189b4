"""EngineConfig: every knob of one engine instance, frozen and validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from prefix_cache.adaptive import PrefixCachingMode

PreemptionMode = Literal["recompute", "swap"]
SchedulingPolicy = Literal["fcfs", "priority"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
"""The float types weights are loaded in or converted to, by torch's names (light to import: the
CLI lists them)."""
AttentionBackend = Literal["auto", "torch", "triton"]
LoadFormat = Literal["safetensors", "dummy"]
GenerationConfigMode = Literal["auto", "off"]
KVEventFormat = Literal["array", "map"]

_GIB = 1 << 30


@dataclass(frozen=True)
class EngineConfig:
    """Configuration of one engine instance (one model replica).

    User mistakes raise ValueError naming the offending value; see each field's comment for
    what it trades.
    """

    model: str
    """Local Hugging Face model directory (config.json, *.safetensors, tokenizer files)."""

    dtype: DType = "auto"
    """Weights, activations, KV cache and LoRA slots dtype (sampling is always float32);
    "auto" takes the checkpoint's torch_dtype on a GPU, and on a CPU bfloat16 where it has
    AMX tile units (Intel Sapphire Rapids and later: 2-3x faster prefill than float32),
    float32 elsewhere (bf16 matmuls without AMX are slower than fp32 ones)."""

    device: str = "auto"
    """"cpu", "cuda", "cuda:N" or "auto" (cuda when available)."""

    cpu_threads: int | None = None
    """Threads for the model's math on a CPU (torch's intra-op threads; unset: one per
    core). Engines sharing a machine should split its cores: `loragate serve --instances N`
    gives each of its engines cores // N unless this is set."""

    block_size: int = 16
    """Tokens per KV block. Chunk boundaries and prefix-cache hits are multiples of this."""

    num_kv_blocks: int | None = None
    """Exact number of KV blocks; overrides kv_cache_memory_bytes when set."""

    kv_cache_memory_bytes: int = _GIB
    """Memory budget for the KV cache when num_kv_blocks is not given."""

    max_num_batched_tokens: int = 1024
    """Token budget of one step: decodes (1 each) plus prefill chunks. Larger gives more
    throughput per step, smaller gives lower inter-token latency for running requests."""

    max_num_seqs: int = 128
    """Most requests running (holding KV blocks and scheduled each step) at once."""

    enable_chunked_prefill: bool = True
    """Cut prompts that do not fit the remaining budget into block-aligned chunks. Off: a
    prompt that does not fit the budget waits, and a prompt over the whole budget is refused."""

    long_prefill_token_threshold: int = 0
    """Cap on one request's prefill chunk per step (0 = no cap beyond the budget), so that one
    long prompt cannot take the whole budget from other prefills."""

    preemption_mode: PreemptionMode = "recompute"
    """What a preempted request loses when blocks run out: "recompute" frees its KV and
    recomputes it later; "swap" copies its KV blocks to CPU swap space and back."""

    swap_space_bytes: int = 256 << 20
    """CPU memory for swapped-out KV blocks (preemption_mode="swap")."""

    scheduling_policy: SchedulingPolicy = "fcfs"
    """"fcfs": arrival order. "priority": larger Request.priority is served first and
    preempted last; ties by arrival."""

    max_model_len: int | None = None
    """Longest prompt + output; defaults to the model's max_position_embeddings."""

    prefix_caching: PrefixCachingMode = "on"
    """Reuse the KV of identical prefixes (same tokens, adapter and cache salt): "on",
    "off", or "auto" (switches itself off while the rolling hit rate on long prompts stays
    under prefix_auto_threshold, and probes again periodically)."""

    cascade_attention: bool = True
    """On a CPU, read KV blocks that several running requests share (cached prefixes) once
    per step instead of once per request (engine/cascade_attention.py). Off: the reference
    attention, which copies every request's context. Ignored on a GPU, for sliding-window
    layers (Gemma's global layers still use it) and for models that soft-cap attention
    scores (Gemma 2)."""

    prefix_auto_threshold: float = 0.30
    """Hit rate under which prefix_caching="auto" turns caching off."""

    cache_aware_window: int = 16
    """When at most cache_aware_max_queue requests wait, admit the one with the longest
    cached prefix among the first cache_aware_window of the head's priority (0 = plain
    queue order)."""

    cache_aware_max_queue: int = 64
    """Queue length above which admission is plain queue order (the scan stays cheap)."""

    max_admission_delay_s: float = 2.0
    """A request that waited longer than this is admitted before better-cached ones."""

    prefix_publish_every: int = 4
    """Publish every Nth block's chain hash for the gateway's prefix index."""

    kv_events_endpoint: str | None = None
    """Publish the prefix cache's block stored / removed events in vLLM's KV events format
    (msgpack batches on a ZMQ PUB socket, one per step that changed the cache) for routers
    that index every engine's blocks, e.g. llm-d's precise prefix-cache scorer. A wildcard
    ("tcp://*:5557"), ipc:// or inproc:// endpoint is bound, any other is connected to (a
    router that binds). None: off, at no cost. Needs prefix_caching on or auto."""

    kv_events_replay_endpoint: str | None = None
    """ROUTER socket (bound, e.g. "tcp://*:5558") serving missed KV event batches from the
    replay buffer to subscribers that saw a gap in the sequence numbers."""

    kv_events_topic: str = ""
    """Topic frame of every KV event message (llm-d subscribes to "kv@<pod>@<model>")."""

    kv_events_buffer_steps: int = 10_000
    """KV event batches kept for replay."""

    kv_events_format: KVEventFormat = "array"
    """Encoding of each KV event: "array" ([tag, fields...], what vLLM before 0.26 sends and
    every llm-d release reads) or "map" ({"type": tag, ...}, what vLLM 0.26+ sends)."""

    max_loras: int = 4
    """Device slots for adapters: the most distinct adapters in one step (0 disables LoRA).
    More slots batch more adapters together but take memory for their A/B buffers."""

    max_cpu_loras: int = 16
    """Adapters kept validated in host memory (LRU); others are reloaded from disk on use."""

    max_lora_rank: int = 16
    """Largest adapter rank accepted; slot buffers are sized for it."""

    lora_starvation_steps: int = 32
    """Steps a request may wait for a free adapter slot before the scheduler stops admitting
    requests of other adapters, so busy slots drain and it gets one."""

    kv_pool_shares: tuple[tuple[str, float, float], ...] = ()
    """Per-pool (adapter name, or "base") floor and cap as fractions of the KV blocks:
    (name, floor, cap). A floor is reserved for that pool; a cap bounds its blocks in use
    and makes it preempt its own requests first; cached blocks above a pool's share (its
    cap, else an equal split) are evicted first."""

    kv_pool_default_cap: float = 1.0
    """Cap (fraction of the KV blocks) of every pool not named in kv_pool_shares."""

    prepack_weights: bool = True
    """On a CPU with float32 weights (or bfloat16 ones on a CPU with AMX), reorder every
    projection's weight (and the LM head's) once at load into oneDNN's blocked layout and run
    the GEMMs through oneDNN (lora/cpu_gemm.py): 2-2.5x faster fp32 GEMMs than torch's default
    BLAS path on the AMD EPYC hosts measured, 1.1-2x faster bf16 ones on a Xeon with AMX. A
    tied LM head gets a packed copy of its own (vocab x hidden more memory). Ignored on a GPU
    and for other dtypes. Off: F.linear, the reference path."""

    native_kernels: bool = True
    """On a CPU, run decode attention with the compiled kernel of engine/cpu_kernels, which
    reads the paged KV cache in place, and a Llama layer's element-wise steps (residual add +
    RMSNorm, rope, SiLU-and-multiply) as fused compiled ops (built with the host's C++
    compiler on first use, a minute or two once, then cached); where they cannot be built the
    engine logs why and keeps the torch paths. Off: torch's flash kernel over contexts copied
    out of the cache and eager element-wise ops, the reference."""

    attention_backend: AttentionBackend = "auto"
    """"auto": the Triton paged attention kernels (engine/triton_attention) on a GPU, the
    torch path (with native_kernels on a CPU) elsewhere. "triton" off a GPU needs
    TRITON_INTERPRET=1 (the interpreter, for tests); "torch": the reference path everywhere."""

    cuda_graphs: bool = True
    """Decode-only steps run on persistent buffers updated in place (engine/decode_graphs.py):
    on a GPU (Triton attention) as CUDA graphs captured once per batch size (1, 2, 4, 8, then
    every 8 up to max_num_seqs) at start-up, which removes the per-kernel launch cost of an
    eager forward; on a CPU with the compiled decode kernel when cascade_attention is off.
    Steps with prefill chunks stay eager. Off: every step builds its inputs anew and runs
    eagerly (debugging, or to save the graphs' memory)."""

    load_format: LoadFormat = "safetensors"
    """"safetensors": the checkpoint's weights. "dummy": seeded random weights of the
    config's shape built on the device, no weight files read (benchmarks of a model shape
    without its weights, as vLLM's --load-format dummy)."""

    generation_config: GenerationConfigMode = "auto"
    """"auto": a request that leaves temperature, top_p, top_k, min_p or repetition_penalty
    unset gets the value the model's generation_config.json recommends, if it names one (as
    vLLM's --generation-config auto, its default; engine/generation_defaults.py). "off":
    OpenAI's defaults (temperature 1, top_p 1, no top-k, min-p or repetition penalty)."""

    grammar_compile_timeout_s: float = 10.0
    """A structured-output spec (JSON schema, regex, grammar) whose compile takes longer is
    refused with a 400 naming its field: compiles cannot be interrupted, and a 30-character
    schema can take a minute. 0: no bound (each new spec then also compiles once instead of
    twice: the bound times it in a helper process first)."""

    seed: int = 0
    """Seed of the generator used by sampled requests that give no seed of their own."""

    extra_stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    """Token ids that end every request besides the model's EOS ids."""

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        if self.num_kv_blocks is not None:
            _positive("num_kv_blocks", self.num_kv_blocks)
        if self.cpu_threads is not None:
            _positive("cpu_threads", self.cpu_threads)
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got "
                             f"{self.long_prefill_token_threshold}")
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold needs enable_chunked_prefill=True: "
                             "without chunks a capped prompt could never be scheduled")
        if 0 < self.long_prefill_token_threshold < self.block_size:
            raise ValueError(
                f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) must be 0 "
                f"or at least block_size ({self.block_size}): chunks end on block boundaries"
            )
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"block_size ({self.block_size}) so a block-aligned chunk fits in a step"
            )
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got "
                             f"{self.preemption_mode!r}")
        if self.preemption_mode == "swap" and self.swap_space_bytes <= 0:
            raise ValueError(f"preemption_mode='swap' needs swap_space_bytes > 0, got "
                             f"{self.swap_space_bytes}")
        if self.swap_space_bytes < 0:
            raise ValueError(f"swap_space_bytes must be >= 0, got {self.swap_space_bytes}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got "
                             f"{self.scheduling_policy!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got "
                             f"{self.dtype!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton, got "
                             f"{self.attention_backend!r}")
        if self.generation_config not in ("auto", "off"):
            raise ValueError(f"generation_config must be auto or off, got "
                             f"{self.generation_config!r}")
        if self.load_format not in ("safetensors", "dummy"):
            raise ValueError(f"load_format must be safetensors or dummy, got "
                             f"{self.load_format!r}")
        if self.prefix_caching not in ("on", "off", "auto"):
            raise ValueError(f"prefix_caching must be 'on', 'off' or 'auto', got "
                             f"{self.prefix_caching!r}")
        if not 0.0 <= self.grammar_compile_timeout_s < float("inf"):
            raise ValueError(f"grammar_compile_timeout_s must be >= 0 (0: no bound), got "
                             f"{self.grammar_compile_timeout_s}")
        if not 0.0 <= self.prefix_auto_threshold <= 1.0:
            raise ValueError(f"prefix_auto_threshold must be in [0, 1], got "
                             f"{self.prefix_auto_threshold}")
        if self.cache_aware_window < 0 or self.cache_aware_max_queue < 0:
            raise ValueError(f"cache_aware_window ({self.cache_aware_window}) and "
                             f"cache_aware_max_queue ({self.cache_aware_max_queue}) must be >= 0")
        if self.max_admission_delay_s < 0:
            raise ValueError(f"max_admission_delay_s must be >= 0, got "
                             f"{self.max_admission_delay_s}")
        _positive("prefix_publish_every", self.prefix_publish_every)
        _positive("kv_events_buffer_steps", self.kv_events_buffer_steps)
        if self.kv_events_format not in ("array", "map"):
            raise ValueError(f"kv_events_format must be 'array' or 'map', got "
                             f"{self.kv_events_format!r}")
        if self.kv_events_endpoint is not None and self.prefix_caching == "off":
            raise ValueError("kv_events_endpoint needs prefix_caching 'on' or 'auto': with "
                             "caching off no block is ever cached, so no event would be sent")
        object.__setattr__(self, "kv_pool_shares", tuple(
            (str(name), float(floor), float(cap)) for name, floor, cap in self.kv_pool_shares))
        for name, floor, cap in self.kv_pool_shares:
            if not 0.0 <= floor <= cap <= 1.0:
                raise ValueError(f"kv_pool_shares entry {name!r} needs 0 <= floor <= cap <= 1, "
                                 f"got floor={floor}, cap={cap}")
        if sum(floor for _, floor, _ in self.kv_pool_shares) > 1.0:
            raise ValueError("kv_pool_shares floors add up to more than the whole cache")
        if not 0.0 < self.kv_pool_default_cap <= 1.0:
            raise ValueError(f"kv_pool_default_cap must be in (0, 1], got "
                             f"{self.kv_pool_default_cap}")
        if self.max_loras < 0:
            raise ValueError(f"max_loras must be >= 0, got {self.max_loras}")
        _positive("max_cpu_loras", self.max_cpu_loras)
        _positive("max_lora_rank", self.max_lora_rank)
        _positive("lora_starvation_steps", self.lora_starvation_steps)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
