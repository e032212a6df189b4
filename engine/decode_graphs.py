"""Decode-only steps on persistent buffers, captured once per batch size as CUDA graphs and
replayed.

A decode step's model forward is hundreds of small kernels (per layer: norms, projections,
rope, attention, MLP); launched one by one from Python, the launches cost more than the
kernels (measured on an H200 with a Llama-3-8B shape at 64 sequences: 34.7 ms of forward for
~4 ms of weight reads). A CUDA graph replays the whole forward as one launch. It records
device addresses, so everything the forward reads lives in buffers kept for the engine's
life, sized for the largest graph, and each step only writes its values into them:

    token ids, positions, cache slots      [max_batch]            copied from the step
    context lengths, block tables          [max_batch], [max_batch, W]  int32, one copy
    LoRA rows grouped by slot              sorted rows + one segment per slot

Batch sizes are bucketed (1, 2, 4, 8, then every 8), all captured at start-up (on a GPU);
a step of n decodes runs the graph of
the smallest bucket >= n, its extra rows padded: they read and write one spare KV block the
cache manager never hands out, and their outputs are dropped. The attention plan is built
for the model's whole context length (a fixed number of splits; splits past a sequence's end
exit at once), and the LoRA metadata always has one segment per slot (empty ones exit at
once), so a replay is right for any mix of lengths and adapters, not only the one seen at
capture. Steps with prefill chunks, or more decodes than the largest bucket, run eagerly.

Off a GPU the same buffers run without capture and without padding: on a CPU, attention is
the compiled decode kernel of engine/cpu_kernels reading the same tables (or the Triton
kernels in the interpreter, which tests use).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from engine.attention import AttentionMetadata
from engine.cpu_kernels import PagedDecodeOp
from engine.models.llama import LlamaForFlatBatch
from engine.paged_decode import DecodeBatch
from engine.triton_attention import TritonAttentionPlan
from lora.ops import HostSegment, LoraBatchMetadata


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (which is always one)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return [*sizes, max_num_seqs]


@dataclass
class _Graph:
    """One batch size's captured forward (graph None: not captured, run directly)."""

    graph: torch.cuda.CUDAGraph | None
    metas: dict[int | None, AttentionMetadata]
    lora: LoraBatchMetadata | None
    hidden: torch.Tensor | None
    """[size, hidden] the replay's output (None until captured)."""


class DecodeGraphs:
    """The persistent buffers and the graphs of decode-only steps for one model runner."""

    def __init__(self, model: LlamaForFlatBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 max_num_seqs: int, max_blocks: int, block_size: int,
                 windows: Sequence[int | None], max_context: int, pad_block: int,
                 num_lora_slots: int, block_m: int, device: torch.device, capture: bool,
                 cpu_kernel: PagedDecodeOp | None = None) -> None:
        """cpu_kernel: attend with the compiled CPU decode kernel instead of Triton's."""
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.block_size = block_size
        self.windows = tuple(windows)
        self.max_context = max_context
        self.pad_block = pad_block
        self.num_lora_slots = num_lora_slots
        self.block_m = block_m
        self.device = device
        self.capture = capture and device.type == "cuda"
        self.cpu_kernel = cpu_kernel
        n, width = self.sizes[-1], max_blocks
        pin = device.type == "cuda"
        # int32: context lengths, then block tables. int64: slots, context lengths again
        # (the CPU kernel's type), LoRA rows grouped by slot, then per slot its segment
        # start and length.
        self._width = width
        self._host32 = torch.zeros(n * (1 + width), dtype=torch.int32, pin_memory=pin)
        self._host64 = torch.zeros(3 * n + 2 * num_lora_slots, dtype=torch.int64,
                                   pin_memory=pin)
        self._np32: npt.NDArray[np.int32] = self._host32.numpy()
        self._np64: npt.NDArray[np.int64] = self._host64.numpy()
        self._dev32 = self._host32.to(device) if pin else self._host32
        self._dev64 = self._host64.to(device) if pin else self._host64
        self._ids = torch.zeros(n, dtype=torch.int64, device=device)
        self._positions = torch.zeros(n, dtype=torch.int64, device=device)
        self._seg_slots = torch.arange(num_lora_slots, dtype=torch.int64, device=device)
        self._rows = torch.arange(n, dtype=torch.int64, device=device)
        self._graphs: dict[tuple[int, bool], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None

    def capture_all(self, with_lora: bool) -> None:
        """Capture every batch size's graph now (engine start-up), without and, if asked,
        with adapters, so that no step pays for a capture. Every row is a padding row while
        capturing: the warm-up forward writes only to the spare block."""
        big = self.sizes[-1]
        self._np32[:big] = 1
        self._np32[big:].reshape(big, self._width)[:, 0] = self.pad_block
        self._np64[:big] = self.pad_block * self.block_size
        self._np64[big:2 * big] = 1
        self._np64[2 * big:] = 0
        if self._dev32 is not self._host32:
            self._dev32.copy_(self._host32)
            self._dev64.copy_(self._host64)
        self._ids.zero_()
        self._positions.zero_()
        for size in self.sizes:
            for lora in (False, True) if with_lora else (False,):
                if (size, lora) not in self._graphs:
                    self._graphs[size, lora] = self._build(size, lora)

    def handles(self, num_decodes: int, num_prefills: int) -> bool:
        return num_prefills == 0 and 0 < num_decodes <= self.sizes[-1]

    def stage(self, input_ids: torch.Tensor, positions: torch.Tensor,
              decodes: Sequence[tuple[npt.NDArray[np.int64], int]], rows: Sequence[int],
              tables: npt.NDArray[np.int64], token_slots: torch.Tensor | None
              ) -> tuple[int, int, bool]:
        """Write a step of n decodes into the buffers: (block table, context length) each
        and their rows of ``tables`` (the runner's persistent block tables, as wide as these
        buffers), their token ids and positions (device), and their LoRA slots (host, -1 for
        none) or None when no decode has an adapter. Returns what run() takes."""
        n = len(decodes)
        # Uncaptured runs need no padding: the exact size is its own "bucket".
        size = next(s for s in self.sizes if s >= n) if self.capture else n
        self._write(np.fromiter((ctx for _, ctx in decodes), np.int64, n),
                    np.asarray(rows, dtype=np.int64), tables, size, token_slots)
        self._ids[:n].copy_(input_ids)
        self._positions[:n].copy_(positions)
        if size > n:
            self._ids[n:size].zero_()
            self._positions[n:size].zero_()
        return n, size, token_slots is not None

    def run(self, staged: tuple[int, int, bool]) -> torch.Tensor:
        """The staged step's hidden states [n, hidden]: a graph replay, or the forward on
        the buffers where nothing is captured."""
        n, size, with_lora = staged
        entry = self._graphs.get((size, with_lora))
        if entry is None:
            entry = self._graphs[size, with_lora] = self._build(size, with_lora)
        if entry.graph is None:
            return self._run(size, entry)[:n]
        entry.graph.replay()
        assert entry.hidden is not None
        return entry.hidden[:n]

    def _write(self, context_lens: npt.NDArray[np.int64], rows: npt.NDArray[np.int64],
               batch_tables: npt.NDArray[np.int64], size: int,
               token_slots: torch.Tensor | None) -> None:
        """The step's values into the host buffers (vectorized: one gather of the decodes'
        table rows), padding rows n..size, then one copy each."""
        n, bs, big = context_lens.size, self.block_size, self.sizes[-1]
        lens, tables = self._np32[:big], self._np32[big:].reshape(big, self._width)
        slots, lens64 = self._np64[:big], self._np64[big:2 * big]
        tables[:n] = batch_tables[rows]
        lens[:n] = context_lens
        lens64[:n] = context_lens
        last = context_lens - 1
        slots[:n] = batch_tables[rows, last // bs] * bs + last % bs
        lens[n:size] = 1
        lens64[n:size] = 1
        tables[n:size, 0] = self.pad_block
        slots[n:size] = self.pad_block * bs
        if token_slots is not None:
            self._write_lora(token_slots.numpy()[:n])
        if self._dev32 is not self._host32:
            self._dev32.copy_(self._host32, non_blocking=True)
            self._dev64.copy_(self._host64, non_blocking=True)

    def _write_lora(self, row_slots: npt.NDArray[np.int64]) -> None:
        """Rows grouped by slot (stable), and each slot's segment; padding rows have none."""
        big = self.sizes[-1]
        sorted_rows = self._np64[2 * big:3 * big]
        starts = self._np64[3 * big:3 * big + self.num_lora_slots]
        lengths = self._np64[3 * big + self.num_lora_slots:]
        order = np.argsort(row_slots, kind="stable")
        with_adapter = order[row_slots[order] >= 0]
        sorted_rows[:with_adapter.size] = with_adapter
        counts = np.bincount(row_slots[with_adapter], minlength=self.num_lora_slots)
        lengths[:] = counts
        starts[:] = np.cumsum(counts) - counts

    def _build(self, size: int, with_lora: bool) -> _Graph:
        big, slots = self.sizes[-1], self.num_lora_slots
        tables = self._dev32[big:].view(big, self._width)[:size]
        if self.cpu_kernel is not None:
            metas = {w: AttentionMetadata(
                slot_mapping=self._dev64[:size], num_decodes=size, prefills=[],
                decodes=[DecodeBatch(rows=self._rows[:size], block_tables=tables,
                                     bias=self._rows[:0], lengths=self._dev64[big:big + size],
                                     sliding_window=w, kernel=self.cpu_kernel)])
                     for w in self.windows}
        else:
            none = self._dev32[:0]
            plan = TritonAttentionPlan(
                num_decodes=size, decode_block_tables=tables,
                decode_context_lens=self._dev32[:size], max_decode_context=self.max_context,
                prefill_block_tables=none.view(0, 1), tile_seq=none, tile_first=none,
                query_start=none, query_len=none, start_pos=none, block_m=self.block_m)
            metas = {w: AttentionMetadata(slot_mapping=self._dev64[:size], num_decodes=size,
                                          decodes=[], prefills=[], triton=plan.with_window(w))
                     for w in self.windows}
        lora = None
        if with_lora:
            # Every slot a segment, possibly empty: the kernels' grids never depend on the
            # step's mix of adapters, so one capture serves them all.
            lora = LoraBatchMetadata(
                sorted_token_ids=self._dev64[2 * big:2 * big + size],
                seg_starts=self._dev64[3 * big:3 * big + slots],
                seg_lens=self._dev64[3 * big + slots:], seg_slots=self._seg_slots,
                num_tokens=size, num_lora_tokens=0, num_segments=slots, max_seg_len=size,
                host_segments=tuple(HostSegment(s, 0, 0, 0, False) for s in range(slots)),
                padded_rows=self._seg_slots[:0], padded_valid=self._seg_slots[:0])
        entry = _Graph(None, metas, lora, None)
        if self.capture:
            self._run(size, entry)  # compiles the kernels before capture; warms the allocator
            torch.cuda.synchronize(self.device)
            entry.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(entry.graph, pool=self._pool):
                entry.hidden = self._run(size, entry)
        return entry

    def _run(self, size: int, entry: _Graph) -> torch.Tensor:
        return self.model(self._ids[:size], self._positions[:size], self.kv_caches,
                          entry.metas, entry.lora)
