"""Compile the Triton attention kernels ahead of time for sm_90 (an H100/H200), no GPU needed.

The interpreter runs kernels as Python and accepts code the compiler rejects; this catches that
on a CPU-only machine. Run as its own process (test_compile.py does), since the kernels must be
decorated without TRITON_INTERPRET: `python -m tests.triton_attention.aot_compile`. Prints one
line per compiled kernel variant and exits non-zero on the first failure.
"""

from __future__ import annotations

import os
import sys

FLOAT_ARGS = {"scale", "softcap"}
POINTER_TYPES = {
    "q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
    "block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "tile_seq_ptr": "*i32",
    "tile_first_ptr": "*i32", "query_start_ptr": "*i32", "query_len_ptr": "*i32",
    "start_pos_ptr": "*i32", "lse_ptr": "*fp32", "part_ptr": "*fp32", "part_lse_ptr": "*fp32",
}


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the kernels must be decorated for the compiler")
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.triton_attention import decode, prefill

    if "nvidia" not in triton.backends.backends:
        print("SKIP: triton built without the nvidia backend")
        return 0
    base = {"PAGE": 16, "HEAD_DIM": 128, "HEAD_DIM_PAD": 128, "BLOCK_N": 64,
            "DOT_IN_FP32": False}
    variants = []
    for softcap in (False, True):
        for window in (False, True):
            flags = {"USE_SOFTCAP": softcap, "USE_WINDOW": window}
            for out_type in ("*bf16", "*fp32"):  # one split (final output) / several
                variants.append((decode._decode_split_kernel,
                                 {**base, **flags, "GROUP": 4, "GROUP_PAD": 16},
                                 {"out_ptr": out_type}))
            variants.append((prefill._prefill_kernel,
                             {**base, **flags, "GROUP": 4, "BLOCK_M": 64}, {"out_ptr": "*bf16"}))
    variants.append((decode._merge_splits_kernel,
                     {"HEAD_DIM": 128, "HEAD_DIM_PAD": 128, "SPLITS_PAD": 8},
                     {"out_ptr": "*bf16"}))
    for kernel, constexprs, overrides in variants:
        signature = {}
        for name in kernel.arg_names:
            if name in constexprs:
                signature[name] = "constexpr"
            elif name in overrides:
                signature[name] = overrides[name]
            elif name in POINTER_TYPES:
                signature[name] = POINTER_TYPES[name]
            elif name in FLOAT_ARGS:
                signature[name] = "fp32"
            else:
                signature[name] = "i32"
        compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32))
        uses_mma = "mma" in compiled.asm["ptx"]
        print(f"compiled {kernel.__name__} {sorted(k for k, v in constexprs.items() if v is True)}"
              f" {overrides} mma={uses_mma}")
        if kernel is not decode._merge_splits_kernel and not uses_mma:
            print("FAIL: bf16 tiles did not go to the tensor cores")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
