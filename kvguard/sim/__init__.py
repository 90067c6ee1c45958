"""A KV-faithful vLLM simulator: see it work without a GPU, and size the policy on a trace.

engine.py (vLLM v1's scheduling and KV-block accounting, pure code) with blocks.py (the block
pool and its prefix cache); server.py (an OpenAI-compatible HTTP front in real time, with
vLLM's /metrics) with prompts.py and metrics.py; replay.py (a trace in simulated time, with
kvguard's admission rules from gate.py), policies.py (the admission policies by name), sweep.py
(them side by side at each rate scale), trace.py, report.py, plot.py and simulate.py
(`kvguard simulate`); load.py (the load generator of the demo and the fidelity benchmark);
demo.py (`kvguard demo`) with envoy.py (a real Envoy running the shipped envoy.yaml: the
demo's gateway).
"""
