"""The admission decision, between the protocol and the ledger: no gRPC, no sockets.

decide.py (the decision itself, pure: a counted request in, a claim or a refusal out), admit.py
(from a request body to a lease or a refusal: parse, count, decide, reserve), policy.py (the
immutable snapshot a request reads), sizing.py (output-token limits and KV blocks),
calibration.py (the learnt estimate and how a lease grows), engine.py (the engine's feedback:
the trust of the estimate, vLLM's unaccounted blocks, the decode rate), capacity.py (each pool's
usable blocks), leases.py (renewed while a response runs, released exactly once), record.py
(what one decision found, for telemetry).
"""
