#!/usr/bin/env bash
# One command on a GPU machine (<= 8 minutes on one H200): a FLUX.1-dev-sized transformer
# at 1024x1024 in bf16, world size 1, each available attention kernel.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
timeout 480 "$PY" bench/gpu/sp_scaling.py
