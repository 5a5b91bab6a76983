#!/usr/bin/env bash
# Bench-only venv .venv-bench: eagle3nb, SpecForge 0.2.0 and speculators 0.9.0 importable in ONE process, for
# bench/render.py (SpecForge) and bench/train.py (speculators' Eagle3 draft).
#
#     bash bench/setup_bench_venv.sh
#
# torch CPU build first (as the Makefile does), then eagle3nb with its pinned deps, then specforge==0.2.0 WITHOUT its
# deps: its preprocessing import path (specforge.data.preprocessing -> specforge.distributed -> specforge.utils,
# specforge.data.{parse,template,loss_mask}) needs only torch, transformers, datasets, tqdm and pydantic, all of which
# eagle3nb already pins. Its GPU/training deps (sglang, yunchang, flash-attn, wandb, tensorboard, openai-harmony...)
# are not installed and nothing is stubbed; the last step checks that the import works.
# speculators==0.9.0 is installed WITHOUT its deps too: the import of its Eagle3 draft model
# (speculators.models.eagle3 -> speculators.train.data) needs, beyond what eagle3nb pins (torch, transformers, pydantic,
# safetensors...), only hs-connectors==0.9.0 (pure Python; its own deps are torch and safetensors), also --no-deps.
# Nothing is stubbed. Its other deps (aiohttp, loguru, typer, torchvision/torchaudio, mooncake...) are not installed.
# Note: speculators 0.9.0 declares transformers<=5.19 / datasets<=5.1; this venv keeps eagle3nb's pins (newer).
# The venv ignores itself (.venv-bench/.gitignore = '*'), like venvs made by Python 3.13+.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="$ROOT/.venv-bench"
PY3="${PY3:-python3}"
test -x "$VENV/bin/python" || "$PY3" -m venv "$VENV"
printf '# created by bench/setup_bench_venv.sh\n*\n' > "$VENV/.gitignore"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q -c "$ROOT/constraints.txt" -e "$ROOT"
"$VENV/bin/pip" install -q --no-deps specforge==0.2.0
"$VENV/bin/pip" install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 "$VENV/bin/python" -c '
import importlib.metadata as md, eagle3nb, specforge.data.preprocessing as p
from specforge.data.template import TEMPLATE_REGISTRY
print("ok: eagle3nb", eagle3nb.__version__, "| specforge", md.version("specforge"), "| transformers", md.version("transformers"),
      "| templates:", len(TEMPLATE_REGISTRY.get_all_template_names()))
from speculators.models.eagle3 import Eagle3DraftModel
print("ok: speculators", md.version("speculators"), "| hs-connectors", md.version("hs-connectors"))'
