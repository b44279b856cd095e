"""The Gluon kernels (MLA decode, MXFP4 experts) compile for Hopper (sm_90) with the installed triton, no GPU needed.

Gluon does not run under `TRITON_INTERPRET`, so the CPU tests never reach these kernels, and Gluon is experimental:
its names move between triton releases (triton 3.9 removed `async_copy_global_to_shared` and `thread_barrier`, which
the kernels called until `k3_kernels.gluon_compat`). CI installs the newest triton, so compiling here is what tells
us a release broke them. One launch configuration of each kernel, at K3's shapes; `benchmarks/compile_check.py`
compiles all of them.

The compiles run in a fresh process: once the interpreter has run a kernel in this one, it has patched the language
builtins that Gluon's code generation also calls.
"""

import inspect
import os
import subprocess
import sys

import pytest


def _compile(fn, types, constexprs, num_warps, div16=()):
    """Compile for sm_90 as the launcher would: pointers and the ints named in div16 (strides and widths, multiples
    of 16 at K3's shapes) known to be 16-aligned, which the 16-byte copies need."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    params = list(inspect.signature(fn.fn).parameters)
    signature = {p: types.get(p, "constexpr" if p in constexprs else "i32") for p in params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params)
             if signature[p].startswith("*") or p in div16}
    kernel = triton.compile(GluonASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps})
    if "wgmma" not in kernel.asm["ptx"]:
        raise AssertionError("no wgmma in the PTX")


def _cases():
    import torch
    from k3_kernels.mla import gluon_decode
    from k3_kernels.moe import gluon_moe

    mla = dict(Q="*bf16", QPE="*bf16", POOL="*bf16", BT="*i32", LENS="*i32", MASK="*u8", O="*bf16",
               PART_O="*fp32", PART_LSE="*fp32", qk_scale_log2="fp32")
    mla_div16 = ("H", "s_qb", "s_qt", "s_qh", "s_pb", "s_pt", "s_ph", "s_pool_p", "s_pool_s", "s_ob", "s_ot", "s_oh")
    for has_mask in (False, True):
        cex = dict(gluon_decode._constexprs(64, 2, 64, torch.bfloat16), HAS_MASK=has_mask, ONE_SPLIT=False)
        yield f"MLA split kernel, mask={has_mask}", (gluon_decode._mla_split_gluon, mla, cex, 8, mla_div16)
    moe = dict(W="*u8", WS="*u8", SORTED="*i32", BLOCK_EXPERT="*i32")
    moe_div16 = ("D", "I", "DW", "DS", "IW", "IS")
    yield "MXFP4 gate / up", (gluon_moe._gate_up_situ, dict(moe, X="*bf16", H="*bf16", beta="fp32",
                                                             linear_beta="fp32"),
                              gluon_moe._constexprs(64, 2, 3), 4, moe_div16)
    yield "MXFP4 down", (gluon_moe._down, dict(moe, H="*bf16", OUT="*fp32", TOPW="*fp32"),
                         dict(gluon_moe._constexprs(64, 2, 3), **gluon_moe._down_constexprs(64)), 4, moe_div16)


def _main() -> int:
    failed = 0
    for name, args in _cases():
        try:
            _compile(*args)
            print(f"ok   {name}")
        except Exception as exc:  # noqa: BLE001 - every kernel is tried, each failure reported
            failed += 1
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[-2000:]}")
    return 1 if failed else 0


def test_gluon_kernels_compile_for_hopper():
    pytest.importorskip("triton")
    pytest.importorskip("triton.experimental.gluon")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-P", __file__], env=env, capture_output=True, text=True, timeout=900,
                         check=False)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert run.stdout.count("ok   ") == 4, run.stdout


if __name__ == "__main__":
    sys.exit(_main())
