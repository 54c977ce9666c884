# Every target installs what it needs into .venv first (torch's CPU wheel before the rest,
# because a bare `pip install transformers` would pull a multi-GB CUDA build).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
MTA    := $(VENV)/bin/mta
STAMP  := $(VENV)/.installed
SHARED ?= $(abspath ../shared)
export MTA_DATA_DIR ?= $(if $(wildcard $(SHARED)/data/instruct),$(SHARED)/data/instruct,$(CURDIR)/data)

.PHONY: install test test-fast demo demo-quick annotate-example bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

## tests: the whole suite (CI runs exactly this)
test: $(STAMP)
	$(PY) -m pytest -q

## the fast subset, without the end-to-end runs
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

## the main job on the embedded default
annotate-example: $(STAMP)
	$(MTA) annotate examples/tiny.jsonl --teacher gpt2-tiny --student gpt2-tiny -o runs/example-annotate

clean:
	rm -rf runs/ .pytest_cache
