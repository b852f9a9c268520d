# The two commands of the README. Each sets itself up on a fresh clone.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The real SGLang server on CPU, for the tests against it (docs/testing.md): a venv of
# its own, so its pinned transformers and friends never touch the project's.
VENV_SGLANG   ?= .venv-sglang
SGLANG_STAMP  := $(VENV_SGLANG)/.installed
SGLANG_REQS   := tools/sglang_cpu/requirements.txt tools/sglang_cpu/constraints.txt
# AppWorld pins packages the project's venv holds at other versions (pydantic 1, pytest 8):
# it runs in a venv of its own behind a worker process (envs/appworld.py).
VENV_APPWORLD  ?= .venv-appworld
APPWORLD_STAMP := $(VENV_APPWORLD)/.installed
# Wheels built on this machine kind for dependencies that otherwise compile for minutes
# (fast-downward-textworld, ALFWorld's planner); without them pip builds from source.
FIND_LINKS := $(if $(wildcard ../shared/wheels),--find-links ../shared/wheels)

.PHONY: train test test-fast bench doctor lint clean chromium
# The venvs of `make test` install side by side (mostly downloads and unpacking).
MAKEFLAGS += --jobs=3

# torch first, pinned to the CPU build on disk, so nothing later pulls a CUDA wheel.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

# The ALFWorld extra, for the tests (and users who train on it): not for `make train`,
# since without the wheels two of its dependencies compile for minutes. The tests of
# `--quantize` need the quantize extra (nvidia-modelopt) too, those of the trackers and of
# LoRA's PEFT export theirs (wandb, mlflow, peft), the page's test a browser driver.
TEST_EXTRAS_STAMP := $(VENV)/.installed-test-extras
$(TEST_EXTRAS_STAMP): $(STAMP)
	$(PY) -m pip install -q $(FIND_LINKS) -e ".[alfworld,quantize,trackers,browser-test,peft]"
	touch $(TEST_EXTRAS_STAMP)

# A real browser for the test of `megatron-agent show` (Playwright cannot download its own
# here): Debian's Chromium, installed as root (or with sudo) when the machine has none.
CHROMIUM := $(shell command -v chromium || command -v chromium-browser)
chromium:
ifeq ($(CHROMIUM),)
	$(if $(filter 0,$(shell id -u)),,sudo) apt-get update -qq
	$(if $(filter 0,$(shell id -u)),,sudo) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium
endif

# torch first (the CPU build), then sglang without its CUDA dependencies, then its light
# dependencies pinned, with torch held at the CPU build (sglang's declared CUDA-only
# dependencies stay missing on purpose: --no-warn-conflicts).
$(SGLANG_STAMP): $(SGLANG_REQS)
	$(PYTHON) -m venv $(VENV_SGLANG)
	$(VENV_SGLANG)/bin/python -m pip install -q --upgrade pip
	$(VENV_SGLANG)/bin/python -m pip install -q "torch==2.13.0"
	$(VENV_SGLANG)/bin/python -m pip install -q --no-deps "sglang==0.5.23"
	$(VENV_SGLANG)/bin/python -m pip install -q --no-warn-conflicts -r tools/sglang_cpu/requirements.txt \
		-c tools/sglang_cpu/constraints.txt
	touch $(SGLANG_STAMP)

# AppWorld and its apps, unpacked offline (`appworld install`); its data bundle is a
# download, and the tests build their own tasks (envs/data/appworld/).
$(APPWORLD_STAMP):
	$(PYTHON) -m venv $(VENV_APPWORLD)
	$(VENV_APPWORLD)/bin/python -m pip install -q --upgrade pip
	$(VENV_APPWORLD)/bin/python -m pip install -q "appworld==0.1.3.post1"
	APPWORLD_CACHE=$(abspath $(VENV_APPWORLD))/appworld-cache $(VENV_APPWORLD)/bin/appworld install
	touch $(APPWORLD_STAMP)

train: $(STAMP)
	$(VENV)/bin/megatron-agent train $(ARGS)

test: $(TEST_EXTRAS_STAMP) $(SGLANG_STAMP) $(APPWORLD_STAMP) chromium
	MEGATRON_AGENT_SGLANG_PYTHON=$${MEGATRON_AGENT_SGLANG_PYTHON:-$(abspath $(VENV_SGLANG))/bin/python} \
	MEGATRON_AGENT_APPWORLD_PYTHON=$${MEGATRON_AGENT_APPWORLD_PYTHON:-$(abspath $(VENV_APPWORLD))/bin/python} \
		$(PY) -m pytest -n 2 --dist loadgroup --durations=25 $(ARGS)

test-fast: $(TEST_EXTRAS_STAMP)
	$(PY) -m pytest -n 2 --dist loadgroup -m "not slow and not multirank" $(ARGS)

bench: $(STAMP)
	$(PY) bench/tiny_forward_backward.py

doctor: $(STAMP)
	$(VENV)/bin/megatron-agent doctor

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) $(VENV_SGLANG) $(VENV_APPWORLD) .pytest_cache
