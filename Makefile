# zaya developer entry points. `make train` and `make test` create .venv on first use.
#
#   make setup                      create .venv and install zaya (editable) with the dev extra
#   make setup TORCH_SPEC="..."     choose the torch to install when .venv has none (GPU builds)
#   make train [CONFIG=...]         train the tiny model on the built-in corpus (CPU)
#   make test [PYTEST_ARGS=...]     run the fast test suite
#   make finetune                   the worked example of docs/finetuning.md on runs/tiny (trains it first if missing)
#   make bench                      run the benchmarks (moe_block, data_loader, muon, checkpoint, router_ablation)

PYTHON      ?= python3
VENV        ?= .venv
TORCH_SPEC  ?= torch==2.13.0
CONFIG      ?= configs/tiny.toml
PYTEST_ARGS ?=

PY    := $(VENV)/bin/python
STAMP := $(VENV)/.zaya-installed

.PHONY: setup train test bench clean finetune

setup: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch is installed only when .venv cannot import one: a torch put there by hand (CUDA, ROCm) is never replaced,
# and zaya's own requirement (torch>=2.6) is a range, so the editable install leaves it alone too.
$(STAMP): pyproject.toml | $(PY)
	@if ! $(PY) -c "import torch" >/dev/null 2>&1; then \
		echo "installing $(TORCH_SPEC) into $(VENV)"; \
		$(PY) -m pip install -q $(TORCH_SPEC); \
	fi
	$(PY) -m pip install -q -e ".[dev]"
	@touch $@

train: setup
	$(VENV)/bin/zaya train --config $(CONFIG)

test: setup
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# The worked example (docs/finetuning.md): export runs/tiny, continue pre-training, fine-tune on chat data, measure,
# serve. `make train` first when runs/tiny holds no checkpoint.
finetune: setup
	@test -d runs/tiny/checkpoints || $(MAKE) train
	$(PY) examples/finetune.py

bench: setup
	$(PY) benchmarks/moe_block.py
	$(PY) benchmarks/data_loader.py
	$(PY) benchmarks/muon.py
	$(PY) benchmarks/checkpoint.py
	$(PY) benchmarks/router_ablation.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
