"""Compile hf_cascade's Triton kernels for an H100 (sm_90) on a machine without a GPU, and report ptxas's registers
and spills.

Why. CI runs the kernels under Triton's interpreter (``TRITON_INTERPRET=1``), which executes the Python of a kernel
and never compiles it: a kernel that only the compiler rejects passes CI and fails on the GPU (as a fused-kernel
change did once: two branches of a runtime ``if`` that each named a tensor ``valid`` of another shape; Triton joins
the names both branches assign, and the interpreter does not care). Compiling needs no GPU: ``triton.compile`` with
an explicit target runs Triton's front end, its passes and the ptxas bundled with the wheel.

    python benchmarks/check_kernel_compile.py            # every kernel at the launch choices the H100 uses
    python benchmarks/check_kernel_compile.py --verbose  # + registers / spills per kernel

Run in a process of its own: ``main`` clears ``TRITON_INTERPRET`` before importing the kernels. Exits non-zero, naming the
kernel and the error, if any kernel fails to compile. ``tests/test_kernel_compile.py`` runs it in CI.
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Pointer dtypes by argument name (every other pointer is fp32); the H100 runs bf16 models.
_POINTERS = {
    "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "pk_ptr": "*bf16", "pv_ptr": "*bf16", "sk_ptr": "*bf16",
    "sv_ptr": "*bf16", "key_ptr": "*bf16", "value_ptr": "*bf16", "keys_ptr": "*bf16", "values_ptr": "*bf16",
    "out_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16", "mask_ptr": "*u8", "key_len_ptr": "*i64",
    "positions_ptr": "*i64", "length_ptr": "*i64", "rows_ptr": "*i64", "row_start_ptr": "*i64",
    "node_starts_ptr": "*i64", "tile_node_ptr": "*i32", "tile_m0_ptr": "*i32",
    "lower_ptr": "*i64", "plower_ptr": "*i64", "slower_ptr": "*i64",
}
_FLOATS = {"sm_scale", "softcap"}

# (module, kernel, constexprs, launch options): the launch choices of the decode step and the prefill (H100).
KERNELS = [
    ("_cascade_kernel", "_cascade_fwd_kernel",
     dict(MASK_MODE=2, HAS_SOFTCAP=False, HAS_KEY_LEN=True, HAS_LOWER=False, EVEN_D=True, EVEN_DV=True, INPUT_PRECISION="tf32",
          BLOCK_MP=64, BLOCK_MS=16, BLOCK_N=32, BLOCK_D=128, BLOCK_DV=128), dict(num_warps=4, num_stages=4)),
    ("_cascade_kernel", "_cascade_fwd_kernel",
     dict(MASK_MODE=1, HAS_SOFTCAP=True, HAS_KEY_LEN=False, HAS_LOWER=False, EVEN_D=False, EVEN_DV=False, INPUT_PRECISION="tf32",
          BLOCK_MP=128, BLOCK_MS=64, BLOCK_N=32, BLOCK_D=128, BLOCK_DV=128), dict(num_warps=8, num_stages=3)),
    ("_prefix_kernel", "_prefix_fwd_kernel",
     dict(HAS_SOFTCAP=False, HAS_LOWER=False, EVEN_D=True, EVEN_DV=True, INPUT_PRECISION="tf32", BLOCK_M=128, BLOCK_N=64, BLOCK_D=128,
          BLOCK_DV=128), dict(num_warps=8, num_stages=3)),
    ("_prefix_kernel", "_state_combine_kernel",
     dict(EVEN_D=True, BLOCK_M=16, BLOCK_D=128, SLOTS_PER_STEP=2), dict(num_warps=4)),
    ("_suffix_kernel", "_suffix_fwd_kernel",
     dict(MASK_MODE=2, HAS_SOFTCAP=False, HAS_PREFIX=True, HAS_KEY_LEN=True, HAS_LOWER=False, EVEN_D=True, EVEN_DV=True,
          INPUT_PRECISION="tf32", BLOCK_M=64, BLOCK_N=32, BLOCK_D=128, BLOCK_DV=128), dict(num_warps=4, num_stages=3)),
    ("_suffix_kernel", "_suffix_fwd_kernel",  # fp32 (exact dots), a small head dim, no prefix
     dict(MASK_MODE=1, HAS_SOFTCAP=True, HAS_PREFIX=False, HAS_KEY_LEN=False, HAS_LOWER=False, EVEN_D=False, EVEN_DV=False,
          INPUT_PRECISION="ieee", BLOCK_M=32, BLOCK_N=32, BLOCK_D=64, BLOCK_DV=64), dict(num_warps=4, num_stages=2)),
    ("_prefix_kernel", "_prefix_fwd_kernel",
     dict(HAS_SOFTCAP=True, HAS_LOWER=False, EVEN_D=False, EVEN_DV=False, INPUT_PRECISION="ieee", BLOCK_M=64, BLOCK_N=32, BLOCK_D=32,
          BLOCK_DV=32), dict(num_warps=4, num_stages=2)),
    # MLA-style K/V head sizes (DeepSeek-V3: q/k 192, v 128): the prefix pass and the fused launch.
    ("_prefix_kernel", "_prefix_fwd_kernel",
     dict(HAS_SOFTCAP=False, HAS_LOWER=False, EVEN_D=False, EVEN_DV=True, INPUT_PRECISION="tf32", BLOCK_M=64, BLOCK_N=32, BLOCK_D=256,
          BLOCK_DV=128), dict(num_warps=4, num_stages=2)),
    ("_cascade_kernel", "_cascade_fwd_kernel",
     dict(MASK_MODE=2, HAS_SOFTCAP=False, HAS_KEY_LEN=True, HAS_LOWER=False, EVEN_D=False, EVEN_DV=True, INPUT_PRECISION="tf32",
          BLOCK_MP=64, BLOCK_MS=16, BLOCK_N=32, BLOCK_D=256, BLOCK_DV=128), dict(num_warps=4, num_stages=2)),
    # Sliding windows / chunks beyond the window: per-query lower bounds (bf16, d=128 and Gemma 3's 256).
    ("_cascade_kernel", "_cascade_fwd_kernel",
     dict(MASK_MODE=2, HAS_SOFTCAP=False, HAS_KEY_LEN=True, HAS_LOWER=True, EVEN_D=True, EVEN_DV=True,
          INPUT_PRECISION="tf32", BLOCK_MP=64, BLOCK_MS=16, BLOCK_N=32, BLOCK_D=128, BLOCK_DV=128),
     dict(num_warps=4, num_stages=4)),
    ("_prefix_kernel", "_prefix_fwd_kernel",
     dict(HAS_SOFTCAP=False, HAS_LOWER=True, EVEN_D=True, EVEN_DV=True, INPUT_PRECISION="tf32", BLOCK_M=128,
          BLOCK_N=64, BLOCK_D=128, BLOCK_DV=128), dict(num_warps=8, num_stages=3)),
    ("_suffix_kernel", "_suffix_fwd_kernel",
     dict(MASK_MODE=2, HAS_SOFTCAP=True, HAS_PREFIX=True, HAS_KEY_LEN=True, HAS_LOWER=True, EVEN_D=True,
          EVEN_DV=True, INPUT_PRECISION="tf32", BLOCK_M=64, BLOCK_N=32, BLOCK_D=256, BLOCK_DV=256),
     dict(num_warps=8, num_stages=2)),
    # Gemma 3's decode step (d=256: the prefix and suffix launches apart) and a long prefill with no shared level.
    ("_prefix_kernel", "_prefix_fwd_kernel",
     dict(HAS_SOFTCAP=False, HAS_LOWER=True, EVEN_D=True, EVEN_DV=True, INPUT_PRECISION="tf32", BLOCK_M=64,
          BLOCK_N=32, BLOCK_D=256, BLOCK_DV=256), dict(num_warps=8, num_stages=2)),
    ("_suffix_kernel", "_suffix_fwd_kernel",
     dict(MASK_MODE=1, HAS_SOFTCAP=False, HAS_PREFIX=False, HAS_KEY_LEN=False, HAS_LOWER=True, EVEN_D=True,
          EVEN_DV=True, INPUT_PRECISION="tf32", BLOCK_M=64, BLOCK_N=32, BLOCK_D=256, BLOCK_DV=256),
     dict(num_warps=8, num_stages=2)),
    ("_merge_kernel", "_merge_attention_states_kernel", dict(BLOCK_R=16, BLOCK_D=128), dict(num_warps=4)),
    # The context-parallel combine's N-way merge of the gathered states (ops/merge_states.py).
    ("_merge_kernel", "_merge_states_kernel", dict(BLOCK_R=16, BLOCK_D=128), dict(num_warps=4)),
    ("_kv_write_kernel", "_write_suffix_kv_kernel", dict(BLOCK_D=128, BLOCK_DV=128), dict(num_warps=1)),
]


def signature(fn, constexprs: dict) -> dict:
    """Triton's signature of ``fn``'s arguments: constexprs by value, pointers by :data:`_POINTERS`, floats, ints."""
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = _POINTERS.get(name, "*fp32")
        elif name in _FLOATS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def ptxas_path() -> str | None:
    """The ptxas this Triton compiles sm_90 with, or None where it has none (no CUDA backend tools)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        try:
            path = get_ptxas(90).path
        except TypeError:  # a Triton whose get_ptxas takes no architecture
            path = get_ptxas().path
    except Exception:  # noqa: BLE001
        return None
    return path if path and os.path.exists(path) else None


def ptxas_report(ptx: str) -> str:
    """ptxas -v's register and spill lines for ``ptx`` (sm_90a), or why there are none."""
    ptxas = ptxas_path()
    if ptxas is None:
        return "no ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        out = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull], capture_output=True,
                             text=True, timeout=600)
    finally:
        os.unlink(f.name)
    lines = [line.split(":", 1)[-1].strip() for line in out.stderr.splitlines()
             if "registers" in line or "spill" in line]
    return "; ".join(lines) or out.stderr.strip()[:200]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--verbose", action="store_true", help="ptxas's registers and spills per kernel")
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # before any kernel module is imported: compile, do not interpret
    import triton
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", 90, 32)
    failed = 0
    for module, name, constexprs, options in KERNELS:
        fn = getattr(importlib.import_module(f"hf_cascade.ops.{module}"), name)
        label = f"{name} {constexprs}"
        try:
            src = triton.compiler.ASTSource(fn=fn, signature=signature(fn, constexprs), constexprs=constexprs)
            compiled = triton.compile(src, target=target, options=options)
        except Exception as err:  # noqa: BLE001 (report every kernel, then fail)
            failed += 1
            print(f"FAILED {label}\n{type(err).__name__}: {err}", flush=True)
            continue
        report = f": {ptxas_report(compiled.asm['ptx'])}" if args.verbose else ""
        print(f"ok {name}{report}", flush=True)
    print(f"compiled {len(KERNELS) - failed} of {len(KERNELS)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
