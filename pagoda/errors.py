"""Errors users see, importable without torch (the bench and analyze tools start fast)."""


class ConfigError(ValueError):
    """A configuration or model that cannot be served; the message says why and what is supported."""
