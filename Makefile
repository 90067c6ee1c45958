# The short commands that README, CI and people use. Everything bootstraps .venv from the lock.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat requirements.lock pyproject.toml | cksum | cut -d' ' -f1)
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
	$(BIN)/mypy
	$(BIN)/lint-imports

$(STAMP): requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --require-hashes -r requirements.lock
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed-* && touch $@

$(MODELS): | $(STAMP)
	$(BIN)/python tools/fetch_tokenizers.py .cache/models

# Re-pin every dependency (needs uv, which the lock itself installs).
lock: $(STAMP)
	$(BIN)/uv pip compile pyproject.toml --extra dev --python-version 3.11 --generate-hashes \
		--no-header --quiet -o requirements.lock

clean:
	rm -rf $(VENV) .cache build *.egg-info
