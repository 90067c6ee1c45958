"""Running kvguard: metrics, traces and decision logs, health, capacity discovery, worker
processes, and the small pieces they share (gRPC's I/O threads, throttled warnings)."""
