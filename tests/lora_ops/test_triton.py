"""Segmented LoRA Triton kernels against the fp32 oracle (tests/lora_ops/oracle.py).

On a machine without CUDA the kernels run in Triton's interpreter (conftest.py); with CUDA
the same checks run natively in the gpu-marked tests. Because the interpreter accepts code
the compiler rejects, the kernels are also compiled ahead of time for sm_90 (no GPU needed).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

from lora.ops import (
    BACKEND_ENV,
    LoraBatchMetadata,
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
    HAS_CUDA,
    LAYOUTS,
    POPULARITIES,
    RANK,
    TOKEN_COUNTS,
    TOL,
    check_ops,
    make_tensors,
    make_token_slots,
    oracle,
)

# --------------------------------------------------------------------------- triton kernels


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


@pytest.mark.parametrize("splits", [2, 3, 7])
@pytest.mark.parametrize("popularity", ["with_none", "identical"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_split_shrink_matches_oracle(interpreted: ModuleType, splits: int,
                                            popularity: str, dtype: torch.dtype) -> None:
    # H_in 300 is three BLOCK_K tiles of 128, the last one partial: 2 splits take 2 + 1
    # tiles, 3 take one each, 7 are capped at 3. "identical" has no base-only rows, so the
    # partial buffer is not zeroed first.
    token_slots = make_token_slots(popularity, 7, "decode", seed=3)
    tensors = make_tensors(7, 300, H_OUT, RANK, dtype, "cpu")
    meta = build_lora_metadata(token_slots, "cpu")
    t_ref, _ = oracle(tensors, token_slots)
    out = torch.full((7, RANK), 7.0, dtype=dtype)
    assert interpreted.sgmv_shrink(tensors["x"], tensors["lora_a"], meta, out,
                                   splits=splits) is out
    torch.testing.assert_close(out.float(), t_ref.float(), rtol=TOL[dtype], atol=TOL[dtype])
    unsplit = interpreted.sgmv_shrink(tensors["x"], tensors["lora_a"], meta, splits=1)
    torch.testing.assert_close(out.float(), unsplit.float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize(("programs", "k_tiles", "sms"),
                         [(1, 32, 132), (4, 32, 132), (40, 32, 132), (500, 32, 132),
                          (3, 7, 8), (1, 1, 132), (64, 5, 16)])
def test_shrink_splits_fill_the_gpu_without_empty_splits(triton_ops: ModuleType, programs: int,
                                                          k_tiles: int, sms: int) -> None:
    splits, per_split = triton_ops.shrink_splits(programs, k_tiles, sms)
    assert 1 <= splits <= k_tiles
    assert (splits - 1) * per_split < k_tiles <= splits * per_split   # none empty, all covered
    target = triton_ops.SPLIT_TARGET_PROGRAMS_PER_SM * sms
    if programs >= target:
        assert splits == 1                                              # already full
    elif splits < k_tiles:
        assert programs * splits * 2 > target                           # not stopped early


def test_shrink_splits_reject_nonsense(triton_ops: ModuleType) -> None:
    with pytest.raises(ValueError, match="positive"):
        triton_ops.shrink_splits(0, 4, 8)
    tensors = make_tensors(2, H_IN, H_OUT, RANK, torch.float32, "cpu")
    with pytest.raises(ValueError, match="splits"):
        triton_ops.sgmv_shrink(tensors["x"][:2], tensors["lora_a"],
                               build_lora_metadata([0, 1], "cpu"), splits=0)


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
