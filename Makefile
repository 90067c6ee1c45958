# The short commands that README, CI and people use. Everything bootstraps .venv from the lock.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat requirements-dev.lock pyproject.toml | cksum | cut -d' ' -f1)
MODELS := .cache/models/qwen/tokenizer.json .cache/models/llama3.2/tokenizer.json

.PHONY: demo test test-fast lint lock clean

# The main job: Envoy + kvguard (memory ledger) + a local OpenAI-style upstream, one burst.
demo: $(STAMP) $(MODELS)
	$(BIN)/kvguard demo

# Every test: unit, protocol, and integration with the real Envoy.
test: $(STAMP) $(MODELS)
	$(BIN)/pytest

test-fast: $(STAMP) $(MODELS)
	$(BIN)/pytest -m "not integration and not live"

lint: $(STAMP)
	$(BIN)/ruff check kvguard tests tools
	$(BIN)/ruff format --check kvguard tests tools
	$(BIN)/mypy
	$(BIN)/lint-imports

$(STAMP): requirements-dev.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --require-hashes -r requirements-dev.lock
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed-* && touch $@

$(MODELS): | $(STAMP)
	$(BIN)/python tools/fetch_tokenizers.py .cache/models

# Re-pin every dependency (uv comes with the dev lock): runtime only, and runtime + dev.
LOCK := $(BIN)/uv pip compile pyproject.toml --python-version 3.11 --generate-hashes --no-header --quiet
lock: $(STAMP)
	$(LOCK) -o requirements.lock
	$(LOCK) --extra dev -o requirements-dev.lock

clean:
	rm -rf $(VENV) .cache build *.egg-info
