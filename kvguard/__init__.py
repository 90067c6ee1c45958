"""kvguard: KV-cache admission control for vLLM behind Envoy."""

__version__ = "0.1.0"
