"""The configuration file: its schema and strict loading (schema.py), the hot reload of its
admission policy (reload.py), and its URLs as kvguard shows them, credentials masked
(redact.py)."""
