"""The Gluon kernels (MLA decode, MXFP4 experts) compile for Hopper (sm_90) with the installed triton, no GPU needed.

Gluon does not run under `TRITON_INTERPRET`, so the CPU tests never reach these kernels, and Gluon is experimental:
its names move between triton releases (triton 3.9 removed `async_copy_global_to_shared` and `thread_barrier`, which
the kernels called until `k3_kernels.gluon_compat`). CI installs the newest triton, so compiling here is what tells
us a release broke them. This runs `benchmarks/compile_check.py --gluon`: every launch configuration of the Gluon
kernels at K3's shapes (about a minute on two CPU cores).

It runs in a fresh process without `TRITON_INTERPRET`: once the interpreter has run a kernel in this one, it has
patched the language builtins that Gluon's code generation also calls.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "compile_check.py"


def test_gluon_kernels_compile_for_hopper():
    pytest.importorskip("triton")
    pytest.importorskip("triton.experimental.gluon")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-P", str(SCRIPT), "--gluon"], env=env, capture_output=True, text=True,
                         timeout=1200, check=False)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " 0 failed, 0 not reached" in run.stdout, run.stdout[-3000:]
