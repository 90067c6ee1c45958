"""vLLM 0.32's api_server routes (vllm/entrypoints/**/api_router.py, the default flags and the
opt-in ones), with what kvguard makes of each: the guarded kind, READ_ONLY or NOT_SERVED. The
unit, protocol and Envoy tests check each one; tests/live reads the real server's own table."""

from __future__ import annotations

from kvguard.extproc.routes import NOT_SERVED, READ_ONLY

# Generating: guarded, or refused.
VLLM_GENERATING = {
    ("POST", "/v1/chat/completions"): "chat",
    ("POST", "/v1/completions"): "completion",
    ("POST", "/v1/responses"): "responses",
    ("POST", "/v1/messages"): "messages",
    ("POST", "/v1/chat/completions/batch"): NOT_SERVED,
    ("POST", "/invocations"): NOT_SERVED,  # SageMaker's: chat, completions and more by body
    ("POST", "/inference/v1/generate"): NOT_SERVED,  # tokens in, tokens out
    ("POST", "/cohere/v2/chat"): NOT_SERVED,
    ("POST", "/generative_scoring"): NOT_SERVED,
    ("POST", "/v1/systemone"): NOT_SERVED,
    ("POST", "/v1/audio/transcriptions"): NOT_SERVED,
    ("POST", "/v1/audio/translations"): NOT_SERVED,
    ("POST", "/v1/embeddings"): NOT_SERVED,
    ("POST", "/v2/embed"): NOT_SERVED,
    ("POST", "/pooling"): NOT_SERVED,
    ("POST", "/classify"): NOT_SERVED,
    ("POST", "/score"): NOT_SERVED,
    ("POST", "/v1/score"): NOT_SERVED,
    ("POST", "/rerank"): NOT_SERVED,
    ("POST", "/v1/rerank"): NOT_SERVED,
    ("POST", "/v2/rerank"): NOT_SERVED,
}
# Not generating: read-only ones pass; stored responses (any tenant's), rendering, the
# operators' controls (LoRA, profiling, scaling, sleep, cache resets) and the docs do not.
VLLM_OTHER = {
    ("GET", "/v1/models"): READ_ONLY,
    ("GET", "/health"): READ_ONLY,
    ("GET", "/ping"): READ_ONLY,
    ("GET", "/version"): READ_ONLY,
    ("GET", "/metrics"): READ_ONLY,
    ("POST", "/tokenize"): READ_ONLY,
    ("POST", "/detokenize"): READ_ONLY,
    ("POST", "/v1/messages/count_tokens"): READ_ONLY,
    ("POST", "/ping"): NOT_SERVED,
    ("GET", "/load"): NOT_SERVED,
    ("GET", "/kv_event_sources"): NOT_SERVED,
    ("GET", "/tokenizer_info"): NOT_SERVED,
    ("GET", "/v1/responses/resp_1"): NOT_SERVED,
    ("POST", "/v1/responses/resp_1/cancel"): NOT_SERVED,
    ("POST", "/v1/chat/completions/render"): NOT_SERVED,
    ("POST", "/v1/completions/render"): NOT_SERVED,
    ("POST", "/v1/messages/render"): NOT_SERVED,
    ("POST", "/v1/responses/render"): NOT_SERVED,
    ("POST", "/v1/chat/completions/derender"): NOT_SERVED,
    ("POST", "/v1/completions/derender"): NOT_SERVED,
    ("POST", "/abort_requests"): NOT_SERVED,
    ("POST", "/v1/load_lora_adapter"): NOT_SERVED,
    ("POST", "/v1/unload_lora_adapter"): NOT_SERVED,
    ("POST", "/start_profile"): NOT_SERVED,
    ("POST", "/stop_profile"): NOT_SERVED,
    ("POST", "/scale_elastic_ep"): NOT_SERVED,
    ("POST", "/is_scaling_elastic_ep"): NOT_SERVED,
    ("POST", "/reset_prefix_cache"): NOT_SERVED,
    ("POST", "/sleep"): NOT_SERVED,
    ("POST", "/wake_up"): NOT_SERVED,
    ("POST", "/collective_rpc"): NOT_SERVED,
    ("GET", "/server_info"): NOT_SERVED,
    ("GET", "/openapi.json"): NOT_SERVED,
    ("GET", "/docs"): NOT_SERVED,
}


VLLM_ROUTES: dict[tuple[str, str], str] = {**VLLM_GENERATING, **VLLM_OTHER}
