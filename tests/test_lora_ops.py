"""Segmented LoRA ops: batch metadata, torch reference and Triton kernels against an fp32 oracle.

The oracle is a per-token loop written here, independent of both implementations:
    t[r] = x[r] @ A[slot[r]].T,   y[r] += t[r] @ B[slot[r]].T   (tokens with slot -1 skipped)
Batches vary adapter popularity (identical, distinct, uniform, zipf, skewed, some -1 tokens),
token count (1, 3, 7, 133) and request shape (decode: 1 token each; prefill: long requests).

On a machine without CUDA the Triton kernels run in Triton's interpreter: TRITON_INTERPRET=1
is read when @triton.jit decorates, so the `triton_ops` fixture sets it (for this module
only) before lora.ops.sgmv_triton is first imported. With CUDA the same checks run natively
in the gpu-marked tests. Because the interpreter accepts code the compiler rejects, the
kernels are also compiled ahead of time for sm_90 (no GPU needed).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from lora.ops import (
    BACKEND_ENV,
    Backend,
    HostSegment,
    LoraBatchMetadata,
    build_lora_metadata,
    expand,
    expand_reference,
    resolve_backend,
    shrink,
    shrink_reference,
)

HAS_CUDA = torch.cuda.is_available()
POPULARITIES = ("identical", "distinct", "uniform", "zipf", "skewed", "with_none")
TOKEN_COUNTS = (1, 3, 7, 133)
LAYOUTS = ("decode", "prefill")
NUM_SLOTS = 6
H_IN, H_OUT, RANK = 72, 40, 8               # not multiples of the kernels' tiles
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}

ShrinkFn = Callable[..., torch.Tensor]
ExpandFn = Callable[..., None]


# --------------------------------------------------------------------------- batches


def request_lengths(num_tokens: int, layout: str, rng: np.random.Generator) -> list[int]:
    """decode: num_tokens requests of 1 token; prefill: at most 4 long requests."""
    if layout == "decode":
        return [1] * num_tokens
    num_requests = min(4, num_tokens)
    cuts = np.sort(rng.choice(np.arange(1, num_tokens), num_requests - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [num_tokens]])).tolist()


def request_slots(popularity: str, num_requests: int, rng: np.random.Generator) -> list[int]:
    """One slot per request (-1: no adapter), drawn with the given popularity."""
    if popularity == "identical":
        return [3] * num_requests
    if popularity == "distinct":
        perm = rng.permutation(NUM_SLOTS)
        return [int(perm[i % NUM_SLOTS]) for i in range(num_requests)]
    if popularity == "uniform":
        return rng.integers(0, NUM_SLOTS, num_requests).tolist()
    if popularity == "zipf":
        weights = 1.0 / np.arange(1, NUM_SLOTS + 1) ** 1.5
        return rng.choice(NUM_SLOTS, num_requests, p=weights / weights.sum()).tolist()
    if popularity == "skewed":
        hot = rng.random(num_requests) < 0.9
        return np.where(hot, 1, rng.integers(2, NUM_SLOTS, num_requests)).tolist()
    assert popularity == "with_none"
    return rng.integers(-1, NUM_SLOTS, num_requests).tolist()


def make_token_slots(popularity: str, num_tokens: int, layout: str, seed: int = 0) -> list[int]:
    """Flat-batch slot per token: requests contiguous, in no particular slot order."""
    rng = np.random.default_rng(seed)
    lengths = request_lengths(num_tokens, layout, rng)
    slots = request_slots(popularity, len(lengths), rng)
    return [slot for slot, length in zip(slots, lengths, strict=True) for _ in range(length)]


def make_tensors(num_tokens: int, h_in: int, h_out: int, rank: int, dtype: torch.dtype,
                 device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """x, A, B, y0 with O(1) values (A scaled by 1/sqrt(H_in), B by 1/sqrt(R))."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        "x": torch.randn(num_tokens, h_in, generator=gen),
        "lora_a": torch.randn(NUM_SLOTS, rank, h_in, generator=gen) / h_in**0.5,
        "lora_b": torch.randn(NUM_SLOTS, h_out, rank, generator=gen) / rank**0.5,
        "y0": torch.randn(num_tokens, h_out, generator=gen),
    }
    return {name: value.to(dtype).to(device) for name, value in tensors.items()}


def oracle(tensors: dict[str, torch.Tensor],
           token_slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 per-token loop: (t [T, R], y [T, H_out] = y0 + t @ B.T) on CPU."""
    x, a, b = (tensors[n].float().cpu() for n in ("x", "lora_a", "lora_b"))
    y = tensors["y0"].float().cpu().clone()
    t = torch.zeros(x.shape[0], a.shape[1])
    for row, slot in enumerate(token_slots):
        if slot >= 0:
            t[row] = x[row] @ a[slot].T
            y[row] += t[row] @ b[slot].T
    return t, y


def check_ops(shrink_fn: ShrinkFn, expand_fn: ExpandFn, token_slots: list[int],
              dtype: torch.dtype, device: str, h_in: int = H_IN, h_out: int = H_OUT,
              rank: int = RANK) -> None:
    """shrink, expand (fed the oracle's t) and the chain, each against the oracle."""
    tensors = make_tensors(len(token_slots), h_in, h_out, rank, dtype, device)
    meta = build_lora_metadata(token_slots, device)
    t_ref, y_ref = oracle(tensors, token_slots)
    no_lora = torch.tensor([s < 0 for s in token_slots], dtype=torch.bool)
    tol = TOL[dtype]

    t = shrink_fn(tensors["x"], tensors["lora_a"], meta)
    assert t.dtype == dtype and t.shape == (len(token_slots), rank)
    torch.testing.assert_close(t.float().cpu(), t_ref, rtol=tol, atol=tol)
    assert not t.cpu()[no_lora].any()                   # base-only rows exactly zero

    y = tensors["y0"].clone()
    expand_fn(t_ref.to(dtype).to(device), tensors["lora_b"], meta, y)
    torch.testing.assert_close(y.float().cpu(), y_ref, rtol=tol, atol=tol)
    assert torch.equal(y.cpu()[no_lora], tensors["y0"].cpu()[no_lora])  # untouched

    y = tensors["y0"].clone()
    expand_fn(shrink_fn(tensors["x"], tensors["lora_a"], meta), tensors["lora_b"], meta, y)
    torch.testing.assert_close(y.float().cpu(), y_ref, rtol=2 * tol, atol=2 * tol)


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
def test_reference_matches_oracle(popularity: str, num_tokens: int, layout: str,
                                  dtype: torch.dtype) -> None:
    check_ops(shrink_reference, expand_reference,
              make_token_slots(popularity, num_tokens, layout), dtype, "cpu")


def test_reference_without_lora_tokens_is_a_no_op() -> None:
    tensors = make_tensors(5, H_IN, H_OUT, RANK, torch.float32, "cpu")
    meta = build_lora_metadata([-1] * 5, "cpu")
    out = torch.full((5, RANK), 7.0)
    assert shrink_reference(tensors["x"], tensors["lora_a"], meta, out) is out
    assert not out.any()
    y = tensors["y0"].clone()
    expand_reference(out, tensors["lora_b"], meta, y)
    assert torch.equal(y, tensors["y0"])


# --------------------------------------------------------------------------- triton kernels


@pytest.fixture(scope="module")
def triton_ops() -> Iterator[ModuleType]:
    """lora.ops.sgmv_triton with interpreted kernels off CUDA, native kernels on CUDA."""
    pytest.importorskip("triton")
    with pytest.MonkeyPatch.context() as mp:
        if not HAS_CUDA:
            mp.setenv("TRITON_INTERPRET", "1")
        name = "lora.ops.sgmv_triton"
        module = importlib.import_module(name)
        if not HAS_CUDA and not module.kernels_interpreted():
            # Imported earlier (by another test) without the interpreter: decorate again.
            module = importlib.reload(sys.modules[name])
        yield module


@pytest.fixture
def interpreted(triton_ops: ModuleType) -> ModuleType:
    if not triton_ops.kernels_interpreted():
        pytest.skip("kernels compiled for CUDA; the gpu tests cover them")
    return triton_ops


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("popularity", POPULARITIES)
def test_triton_fp32_matches_oracle(interpreted: ModuleType, popularity: str, num_tokens: int,
                                    layout: str) -> None:
    check_ops(interpreted.sgmv_shrink, interpreted.sgmv_expand,
              make_token_slots(popularity, num_tokens, layout), torch.float32, "cpu")


@pytest.mark.parametrize(
    ("h_in", "h_out", "rank"),
    # (300, 40, 80): several K trips in both kernels and two rank tiles in shrink.
    [(40, 96, 4), (96, 33, 16), (17, 72, 8), (72, 40, 5), (300, 40, 80)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
def test_triton_dtypes_and_shapes(interpreted: ModuleType, h_in: int, h_out: int, rank: int,
                                  dtype: torch.dtype) -> None:
    check_ops(interpreted.sgmv_shrink, interpreted.sgmv_expand,
              make_token_slots("with_none", 133, "prefill", seed=1), dtype, "cpu",
              h_in=h_in, h_out=h_out, rank=rank)


def test_triton_handles_strided_rows_and_a_preset_out(interpreted: ModuleType) -> None:
    token_slots = make_token_slots("with_none", 7, "decode", seed=2)
    tensors = make_tensors(7, H_IN, H_OUT, RANK, torch.float32, "cpu")
    meta = build_lora_metadata(token_slots, "cpu")
    t_ref, y_ref = oracle(tensors, token_slots)
    out = torch.full((7, RANK), 7.0)                  # garbage in base-only rows gets zeroed
    assert interpreted.sgmv_shrink(tensors["x"], tensors["lora_a"], meta, out) is out
    torch.testing.assert_close(out, t_ref, rtol=1e-5, atol=1e-5)
    fused = torch.zeros(7, H_OUT + 24)                # y: a column slice of a fused output
    y = fused[:, 8:8 + H_OUT]
    y.copy_(tensors["y0"])
    interpreted.sgmv_expand(out, tensors["lora_b"], meta, y)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    assert not fused[:, :8].any() and not fused[:, 8 + H_OUT:].any()


def test_triton_without_lora_tokens_is_a_no_op(interpreted: ModuleType) -> None:
    tensors = make_tensors(3, H_IN, H_OUT, RANK, torch.float32, "cpu")
    meta = build_lora_metadata([-1, -1, -1], "cpu")
    t = interpreted.sgmv_shrink(tensors["x"], tensors["lora_a"], meta)
    assert not t.any()
    y = tensors["y0"].clone()
    interpreted.sgmv_expand(t, tensors["lora_b"], meta, y)
    assert torch.equal(y, tensors["y0"])


KERNEL_TENSOR_ARGS = {"x_ptr", "a_ptr", "out_ptr", "t_ptr", "b_ptr", "y_ptr"}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_kernels_compile_for_sm90_without_a_gpu(triton_ops: ModuleType, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # The interpreter runs the kernels as Python and would miss what only the compiler
    # rejects; compiling ahead of time for an H100-class target needs no GPU.
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    if "nvidia" not in triton.backends.backends:
        pytest.skip("triton built without the nvidia backend")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    for kernel, blocks in ((triton_ops._sgmv_shrink_kernel, (32, 16, 128)),
                           (triton_ops._sgmv_expand_kernel, (64, 64, 16))):
        fn = JITFunction(getattr(kernel, "fn", kernel))  # the undecorated Python function
        signature = {
            name: "constexpr" if name.startswith(("BLOCK_", "DOT_"))
            else "*bf16" if name in KERNEL_TENSOR_ARGS
            else "*i64" if name.endswith("_ptr") else "i32"
            for name in fn.arg_names
        }
        constexprs = dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K"), blocks, strict=True))
        source = ASTSource(fn, signature, constexprs={**constexprs, "DOT_IN_FP32": False})
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
        assert "mma" in compiled.asm["ptx"]          # bf16 tiles go to the tensor cores


def _good_args() -> tuple[dict[str, torch.Tensor], LoraBatchMetadata]:
    tensors = make_tensors(4, H_IN, H_OUT, RANK, torch.float32, "cpu")
    tensors["t"] = torch.zeros(4, RANK)
    return tensors, build_lora_metadata([0, 0, -1, 5], "cpu")


SHRINK_ERRORS: list[tuple[str, Callable[[dict[str, torch.Tensor]], None], str]] = [
    ("int dtype", lambda a: a.update(x=a["x"].int()), "dtype"),
    ("float64", lambda a: a.update(x=a["x"].double(), lora_a=a["lora_a"].double()), "float32"),
    ("dtype mismatch", lambda a: a.update(lora_a=a["lora_a"].half()), "does not match"),
    ("rows != tokens", lambda a: a.update(x=a["x"][:3]), r"x must have shape \[4, \*\]"),
    ("x 3-D", lambda a: a.update(x=a["x"][None]), "x must have shape"),
    ("H_in mismatch", lambda a: a.update(lora_a=a["lora_a"][:, :, :-1]), "lora_a must have"),
    ("lora_a 2-D", lambda a: a.update(lora_a=a["lora_a"][0]), "lora_a must have"),
    ("too few slots", lambda a: a.update(lora_a=a["lora_a"][:5]), "slot 5"),
    ("out shape", lambda a: a.update(out=torch.zeros(4, RANK + 1)), "out must have"),
    ("strided x", lambda a: a.update(x=torch.zeros(H_IN, 4).t()), "last dimension"),
    ("device", lambda a: a.update(x=a["x"].to("meta"), lora_a=a["lora_a"].to("meta")),
     "metadata is on"),
]

EXPAND_ERRORS: list[tuple[str, Callable[[dict[str, torch.Tensor]], None], str]] = [
    ("dtype mismatch", lambda a: a.update(y0=a["y0"].bfloat16()), "does not match"),
    ("rank mismatch", lambda a: a.update(t=torch.zeros(4, RANK + 1)), "lora_b must have"),
    ("y shape", lambda a: a.update(y0=a["y0"][:, :-1]), "y must have"),
    ("too few slots", lambda a: a.update(lora_b=a["lora_b"][:2]), "slot 5"),
    ("strided lora_b", lambda a: a.update(lora_b=a["lora_b"].transpose(1, 2).contiguous()
                                          .transpose(1, 2)), "last dimension"),
    ("device", lambda a: a.update(y0=a["y0"].to("meta")), "y is on"),
]


@pytest.mark.parametrize(("case", "mutate", "message"), SHRINK_ERRORS,
                         ids=[c[0] for c in SHRINK_ERRORS])
def test_sgmv_shrink_rejects_bad_input(triton_ops: ModuleType, case: str,
                                       mutate: Callable[[dict[str, torch.Tensor]], None],
                                       message: str) -> None:
    args, meta = _good_args()
    mutate(args)
    with pytest.raises(ValueError, match=message):
        triton_ops.sgmv_shrink(args["x"], args["lora_a"], meta, args.get("out"))
    if case not in ("strided x",):                    # the torch path accepts any strides
        with pytest.raises(ValueError, match=message):
            shrink_reference(args["x"], args["lora_a"], meta, args.get("out"))


@pytest.mark.parametrize(("case", "mutate", "message"), EXPAND_ERRORS,
                         ids=[c[0] for c in EXPAND_ERRORS])
def test_sgmv_expand_rejects_bad_input(triton_ops: ModuleType, case: str,
                                       mutate: Callable[[dict[str, torch.Tensor]], None],
                                       message: str) -> None:
    args, meta = _good_args()
    mutate(args)
    with pytest.raises(ValueError, match=message):
        triton_ops.sgmv_expand(args["t"], args["lora_b"], meta, args["y0"])
    if case not in ("strided lora_b",):
        with pytest.raises(ValueError, match=message):
            expand_reference(args["t"], args["lora_b"], meta, args["y0"])


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

    check_ops(shrink_fn, expand_fn, make_token_slots("zipf", 133, "decode"), torch.float32,
              "cpu")


# --------------------------------------------------------------------------- gpu


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
def test_triton_on_cuda_matches_oracle(triton_ops: ModuleType, popularity: str,
                                       num_tokens: int, layout: str, dtype: torch.dtype) -> None:
    check_ops(triton_ops.sgmv_shrink, triton_ops.sgmv_expand,
              make_token_slots(popularity, num_tokens, layout), dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_on_cuda_matches_oracle(dtype: torch.dtype) -> None:
    check_ops(shrink_reference, expand_reference, make_token_slots("skewed", 133, "prefill"),
              dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_auto_backend_on_cuda_is_triton(triton_ops: ModuleType,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert resolve_backend("auto", torch.device("cuda")) == "triton"
    check_ops(shrink, expand, make_token_slots("uniform", 133, "decode"), torch.bfloat16, "cuda")

