"""The configuration file: its schema (schema.py), reading and validating it (loading.py), the
hot reload of its admission policy (reload.py), and its URLs as kvguard shows them, credentials
masked (redact.py).

The package names what its callers use: `load` (a file) or `parse` (text) gives a `Config`, or
raises a `ConfigError` that names every problem.
"""

from kvguard.config.loading import ConfigError, load, parse
from kvguard.config.schema import Config

__all__ = ["Config", "ConfigError", "load", "parse"]
