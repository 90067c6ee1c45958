"""Real-process helpers shared by the integration tests and `kvguard demo`."""
