"""The simulator's model, pure code (no sockets, no gRPC, no clock of its own).

engine.py (vLLM v1's scheduling and KV-block accounting) with blocks.py (the block pool and its
prefix cache); metrics.py (the engine's state under vLLM's metric names) and prompts.py (what
the engine reads from an OpenAI request); replay.py (a trace in simulated time, with kvguard's
admission sequence run by gate.py), policies.py (the admission policies by name), sweep.py
(them side by side at each rate scale), trace.py (the traces, CSV or JSON lines) and report.py
(the figures of a run).
"""
