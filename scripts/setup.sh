#!/usr/bin/env bash
# Install the package and its test dependencies into the active Python environment.
# torch==2.13.0 first: on the project's CPU machines it is on local disk (a plain `torch` pulls a CUDA build).
set -euo pipefail
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0" || python -m pip install -q torch
python -m pip install -q -e ".[test]"
