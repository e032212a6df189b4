"""Segmented LoRA ops: batch metadata, the torch reference and backend dispatch against the
fp32 oracle (tests/lora_ops/oracle.py)."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from lora.ops import (
    BACKEND_ENV,
    Backend,
    HostSegment,
    LoraBatchMetadata,
    add_lora,
    add_lora_reference,
    build_lora_metadata,
    expand,
    expand_reference,
    resolve_backend,
    shrink,
    shrink_reference,
)
from tests.lora_ops.oracle import (
    H_IN,
    H_OUT,
    LAYOUTS,
    POPULARITIES,
    RANK,
    TOKEN_COUNTS,
    check_add,
    check_add_sliced,
    check_ops,
    make_tensors,
    make_token_slots,
)

# --------------------------------------------------------------------------- metadata


def test_metadata_groups_tokens_by_slot_stably() -> None:
    meta = build_lora_metadata([2, 2, -1, 0, 0, 0, 2, 1], "cpu")
    assert meta.sorted_token_ids.tolist() == [3, 4, 5, 7, 0, 1, 6]
    assert meta.seg_starts.tolist() == [0, 3, 4]
    assert meta.seg_lens.tolist() == [3, 1, 3]
    assert meta.seg_slots.tolist() == [0, 1, 2]
    assert (meta.num_tokens, meta.num_lora_tokens, meta.num_segments, meta.max_seg_len) == (
        8, 7, 3, 3)
    assert meta.host_segments == (
        HostSegment(slot=0, start=0, length=3, row_start=3, contiguous=True),
        HostSegment(slot=1, start=3, length=1, row_start=7, contiguous=True),
        HostSegment(slot=2, start=4, length=3, row_start=0, contiguous=False),
    )
    assert meta.max_slot == 2
    # Grouped layout: segments padded to length 3, holes point at the zero row T = 8.
    assert meta.padded_rows.tolist() == [3, 4, 5, 7, 8, 8, 0, 1, 6]
    assert meta.padded_valid.tolist() == [0, 1, 2, 3, 6, 7, 8]
    assert meta.padding_ratio == 9 / 7
    for tensor in (meta.sorted_token_ids, meta.seg_starts, meta.seg_lens, meta.seg_slots,
                   meta.padded_rows, meta.padded_valid):
        assert tensor.dtype == torch.int64


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "per_segment"])
def test_reference_forms_agree(grouped: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both torch forms give the oracle's answer on a decode batch over many slots."""
    from lora.ops import sgmv_reference

    monkeypatch.setattr(sgmv_reference, "GROUPED_MIN_SEGMENTS", 1 if grouped else 10**9)
    slots = make_token_slots("uniform", 133, "decode")
    assert sgmv_reference._grouped(build_lora_metadata(slots, "cpu")) is grouped
    check_ops(shrink_reference, expand_reference, slots, torch.float32, "cpu")


@pytest.mark.parametrize("token_slots", [[-1, -1, -1], []])
def test_metadata_without_lora_tokens_has_no_segments(token_slots: list[int]) -> None:
    meta = build_lora_metadata(token_slots, "cpu")
    assert (meta.num_tokens, meta.num_lora_tokens, meta.num_segments, meta.max_seg_len) == (
        len(token_slots), 0, 0, 0)
    assert meta.sorted_token_ids.numel() == meta.seg_slots.numel() == 0
    assert meta.host_segments == () and meta.max_slot == -1


def test_metadata_accepts_a_tensor() -> None:
    from_list = build_lora_metadata([1, 1, 0, -1, 1], "cpu")
    from_tensor = build_lora_metadata(torch.tensor([1, 1, 0, -1, 1], dtype=torch.int32), "cpu")
    assert from_tensor.sorted_token_ids.tolist() == from_list.sorted_token_ids.tolist() == [
        2, 0, 1, 4]
    assert from_tensor.host_segments == from_list.host_segments


@pytest.mark.parametrize(
    ("token_slots", "message"),
    [([0, -2], ">= -1"), (torch.zeros(2, 2, dtype=torch.int64), "1-D"),
     (torch.zeros(3), "integer")],
)
def test_metadata_rejects_bad_slots(token_slots: list[int] | torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_lora_metadata(token_slots, "cpu")


# --------------------------------------------------------------------------- torch reference


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fused", [False, True], ids=["shrink_expand", "fused"])
def test_reference_matches_oracle(popularity: str, num_tokens: int, layout: str,
                                  dtype: torch.dtype, fused: bool) -> None:
    slots = make_token_slots(popularity, num_tokens, layout)
    if fused:
        check_add(add_lora_reference, slots, dtype, "cpu")
    else:
        check_ops(shrink_reference, expand_reference, slots, dtype, "cpu")


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "per_segment"])
def test_fused_reference_on_a_mixed_step(grouped: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decodes over every slot, then two prefill chunks: the chunks are sliced in place,
    the decodes gathered (grouped or per slot) and added back."""
    from lora.ops import sgmv_reference

    monkeypatch.setattr(sgmv_reference, "GROUPED_MIN_SEGMENTS", 1 if grouped else 10**9)
    slots = [i % 6 for i in range(30)] + [-1] * 3 + [2] * 40 + [5] * 17 + [4] * 5
    meta = build_lora_metadata(slots, "cpu")
    assert [(r.slot, r.row_start, r.length) for r in meta.in_place_runs] == [(2, 33, 40),
                                                                            (5, 73, 17)]
    assert meta.rest is not None and meta.rest.num_lora_tokens == 35
    assert sgmv_reference._grouped(meta.rest) is grouped
    check_add(add_lora_reference, slots, torch.float32, "cpu")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("popularity", ["identical", "zipf", "with_none"])
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "per_segment"])
def test_merged_projection_matches_oracle_per_part(
        popularity: str, num_tokens: int, layout: str, grouped: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """q/k/v-like merged projection: one shrink with the stacked A's, each part's delta in
    its own output columns, equal to three separate projections."""
    from lora.ops import sgmv_reference

    monkeypatch.setattr(sgmv_reference, "GROUPED_MIN_SEGMENTS", 1 if grouped else 10**9)
    check_add_sliced(add_lora_reference, make_token_slots(popularity, num_tokens, layout),
                     torch.float32, "cpu")


def test_merged_projection_on_a_mixed_step() -> None:
    slots = [i % 6 for i in range(30)] + [-1] * 3 + [2] * 40 + [5] * 17 + [4] * 5
    check_add_sliced(add_lora_reference, slots, torch.float32, "cpu")
    check_add_sliced(add_lora_reference, slots, torch.bfloat16, "cpu", slices=(64, 24))


@pytest.mark.parametrize("slices", [(40, 20), (90,)])
def test_merged_projection_rejects_slices_that_do_not_fit(slices: tuple[int, ...]) -> None:
    tensors = make_tensors(4, H_IN, 88, RANK, torch.float32, "cpu")
    a = torch.cat([tensors["lora_a"]] * 2, dim=1)
    with pytest.raises(ValueError, match="do not fit"):
        add_lora_reference(tensors["x"], a, tensors["lora_b"], build_lora_metadata(
            [0] * 4, "cpu"), tensors["y0"], slices)


def test_metadata_lists_long_runs_and_the_rest() -> None:
    # Rows 0-19: slot 2 (one run, in place); 20: slot 0; 21-23: slot 1; 24: slot 2 again.
    meta = build_lora_metadata([2] * 20 + [0, 1, 1, 1, 2], "cpu")
    assert meta.in_place_runs == (HostSegment(slot=2, start=-1, length=20, row_start=0,
                                              contiguous=True),)
    assert meta.rest is not None and meta.rest.in_place_runs == () and meta.rest.rest is None
    assert meta.rest.sorted_token_ids.tolist() == [20, 21, 22, 23, 24]
    assert meta.rest.seg_slots.tolist() == [0, 1, 2]
    short = build_lora_metadata([2] * 15 + [0], "cpu")
    assert short.in_place_runs == () and short.rest is None


def test_reference_without_lora_tokens_is_a_no_op() -> None:
    tensors = make_tensors(5, H_IN, H_OUT, RANK, torch.float32, "cpu")
    meta = build_lora_metadata([-1] * 5, "cpu")
    out = torch.full((5, RANK), 7.0)
    assert shrink_reference(tensors["x"], tensors["lora_a"], meta, out) is out
    assert not out.any()
    y = tensors["y0"].clone()
    expand_reference(out, tensors["lora_b"], meta, y)
    assert torch.equal(y, tensors["y0"])


# --------------------------------------------------------------------------- dispatch


def test_backend_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert resolve_backend("auto", cpu) == "torch"
    assert resolve_backend("torch", cuda) == "torch"
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert resolve_backend("auto", cuda) == "torch"
    monkeypatch.setenv(BACKEND_ENV, "bogus")
    with pytest.raises(ValueError, match=BACKEND_ENV):
        resolve_backend("auto", cpu)
    with pytest.raises(ValueError, match="LoRA backend must be"):
        resolve_backend("cuda", cpu)  # type: ignore[arg-type]


def test_backend_resolution_with_triton(triton_ops: ModuleType,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert resolve_backend("auto", torch.device("cuda")) == "triton"
    assert resolve_backend("triton", torch.device("cpu")) == "triton"
    monkeypatch.setenv(BACKEND_ENV, "triton")
    assert resolve_backend("auto", torch.device("cpu")) == "triton"


@pytest.mark.parametrize("backend", ["torch", "triton", "env-triton"])
def test_dispatcher_matches_oracle(request: pytest.FixtureRequest,
                                   monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    if backend != "torch":
        request.getfixturevalue("interpreted")
    monkeypatch.setenv(BACKEND_ENV, "triton" if backend == "env-triton" else "auto")
    chosen: Backend = "auto" if backend == "env-triton" else backend  # type: ignore[assignment]

    def shrink_fn(x: torch.Tensor, lora_a: torch.Tensor, meta: LoraBatchMetadata) -> torch.Tensor:
        return shrink(x, lora_a, meta, backend=chosen)

    def expand_fn(t: torch.Tensor, lora_b: torch.Tensor, meta: LoraBatchMetadata,
                  y: torch.Tensor) -> None:
        expand(t, lora_b, meta, y, backend=chosen)

    def add_fn(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
               meta: LoraBatchMetadata, y: torch.Tensor) -> None:
        add_lora(x, lora_a, lora_b, meta, y, backend=chosen)

    check_ops(shrink_fn, expand_fn, make_token_slots("zipf", 133, "decode"), torch.float32,
              "cpu")
    check_add(add_fn, make_token_slots("zipf", 133, "prefill"), torch.float32, "cpu")

    def add_sliced_fn(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                      meta: LoraBatchMetadata, y: torch.Tensor, slices: tuple[int, ...]) -> None:
        add_lora(x, lora_a, lora_b, meta, y, slices=slices, backend=chosen)

    check_add_sliced(add_sliced_fn, make_token_slots("with_none", 133, "prefill"),
                     torch.float32, "cpu")
