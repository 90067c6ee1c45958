"""A KV-faithful vLLM simulator: see it work without a GPU, and size the policy on a trace.

model/ is the model, pure code (engine, block pool, replay, the admission gate, traces and
reports). Its fronts, here: server.py (an OpenAI-compatible HTTP front in real time, with vLLM's
/metrics) and standalone.py (`kvguard sim-server`); simulate.py (`kvguard simulate`) with
plot.py; load.py (the load generator of the demo and the fidelity benchmark); demo.py
(`kvguard demo`) with envoy.py (a real Envoy running the shipped envoy.yaml: the demo's
gateway).
"""
