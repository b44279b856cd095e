#!/usr/bin/env bash
set -euo pipefail
# PYTHONSAFEPATH: `python -m` would put the repository root first on sys.path, where `kernels/` (installed as
# `k3_kernels`) would shadow the Hugging Face `kernels` library that transformers >= 5.25 installs and imports.
PYTHONSAFEPATH=1 python -m pytest -q -x tests "$@"
