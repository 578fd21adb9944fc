"""The version of nanguard (also in pyproject.toml; tests/python/test_namespace.py checks they agree)."""

__version__ = "0.1.0"
