# `make demo` and `make test` set up .venv first when needed (scripts/setup_env.py).
PYTHON := .venv/bin/python
ENV_STAMP := .venv/.opsd-env

.PHONY: env demo smoke test test-fast bench learn

$(ENV_STAMP): pyproject.toml scripts/setup_env.py
	python3 scripts/setup_env.py
	touch $@

env: $(ENV_STAMP)

# SmolLM2 that can see learns facts its teacher only sees as pictures (configs/demo.yaml): a fresh run
# each time (runs/demo is deleted); the models it builds stay in artifacts/, so a second run starts at once.
demo: $(ENV_STAMP)
	rm -rf runs/demo
	$(PYTHON) -m opsd.train --config configs/demo.yaml

# The machinery in about a minute: a tiny random VLM (configs/smoke.yaml) that learns nothing.
smoke: $(ENV_STAMP)
	rm -rf runs/smoke
	$(PYTHON) -m opsd.train --config configs/smoke.yaml

# Everything: tests/unit and tests/integration (real vLLM engines, training runs, torchrun). CI runs this.
# Budget: 8 minutes on 2 idle cores; each target ends with its 20 slowest tests (docs/development.md).
# Two workers (pytest-xdist), each taking whole files, the longest first (tests/conftest.py).
PYTEST := $(PYTHON) -m pytest -q --durations=20 -n 2 --dist loadfile --no-loadscope-reorder
test: $(ENV_STAMP)
	$(PYTEST)

# The unit tier: no engine run, no training run, no torchrun; budget 60 s on 2 idle cores.
test-fast: $(ENV_STAMP)
	$(PYTEST) tests/unit

bench: $(ENV_STAMP)
	$(PYTHON) bench/loss_memory.py
	$(PYTHON) bench/rollout_throughput.py
	$(PYTHON) bench/weight_sync.py

# Does the student learn, and what does it forget? SmolLM2 on fictional facts (text_facts), on facts its
# teacher only sees as pictures (visual: SmolLM2 with a vision tower built here), and a skill from real data
# (skill: reading the UCI handwritten digits, judged on images never trained on, beside GRPO): OPSD beside
# its controls and SFT; JSON in runs/learn/report.json, a PNG per task in runs/learn/<task>/.
learn: $(ENV_STAMP)
	$(PYTHON) bench/learning.py
