VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install up test lint bench clean compose-image compose-test

# CPU torch first, so the project's torch requirement is already met and no CUDA build is pulled.
# The rdma extra (the RDMA path's transfer engine) when its libraries are there or can be
# installed (deploy/rdma-libs.sh); without it the RDMA tests skip and say why.
$(STAMP): pyproject.toml deploy/rdma-libs.sh shared/model/kernels/*.cpp
	python3.11 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	if deploy/rdma-libs.sh && $(PY) -m pip install -q -e '.[dev,rdma]'; then :; else \
		echo "warning: installing without the rdma extra" >&2; $(PY) -m pip install -q -e '.[dev]'; fi
	# The C++ kernels, into the venv (without them attention runs the reference backend).
	$(PY) -m shared.model.kernels build || echo "warning: the engine runs its tensor-code paths" >&2
	touch $(STAMP)

install: $(STAMP)

up: $(STAMP)
	$(VENV)/bin/pdd up

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: $(STAMP) lint
	$(PY) -m pytest

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
