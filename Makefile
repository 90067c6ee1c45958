# The short commands that README, CI and people use. Everything bootstraps .venv from the lock.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat requirements-dev.lock pyproject.toml | cksum | cut -d' ' -f1)
MODELS := .cache/models/qwen/tokenizer.json .cache/models/llama3.2/tokenizer.json
PROTO := kvguard/v1/admin_pb2.py

.PHONY: demo test test-fast lint lock clean

# The main job: Envoy + kvguard (memory ledger) + a local OpenAI-style upstream, one burst.
demo: $(STAMP) $(PROTO) $(MODELS)
	$(BIN)/kvguard demo

# Every test: unit, protocol, and integration with the real Envoy.
test: $(STAMP) $(PROTO) $(MODELS)
	$(BIN)/pytest

test-fast: $(STAMP) $(PROTO) $(MODELS)
	$(BIN)/pytest -m "not integration and not live"

lint: $(STAMP) $(PROTO)
	$(BIN)/ruff check kvguard tests tools
	$(BIN)/ruff format --check kvguard tests tools
	$(BIN)/mypy
	$(BIN)/lint-imports

$(STAMP): requirements-dev.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --require-hashes -r requirements-dev.lock
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed-* && touch $@

# kvguard's own API, generated from proto/ with grpcio-tools (the files are not committed).
$(PROTO): proto/kvguard/v1/admin.proto | $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. $<
	$(BIN)/buf lint

$(MODELS): | $(STAMP)
	$(BIN)/python tools/fetch_tokenizers.py .cache/models

# Re-pin every dependency (uv comes with the dev lock): runtime only, and runtime + dev.
LOCK := $(BIN)/uv pip compile pyproject.toml --python-version 3.11 --generate-hashes --no-header --quiet
lock: $(STAMP)
	$(LOCK) -o requirements.lock
	$(LOCK) --extra dev -o requirements-dev.lock

clean:
	rm -rf $(VENV) .cache build *.egg-info
