"""The one error type for bad configuration, importable by every layer (kernels, model, data, trainer).

A ConfigError is something the user set that cannot run: its message names the key to change and a
value that works. Entry points turn it into exit code 1 before any GPU work or data is touched.
"""


class ConfigError(ValueError):
    """A configuration value (or combination) that cannot run; the message names the fix."""
