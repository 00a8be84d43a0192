"""A process-wide choice among named options: set in code, else an environment variable, else a default."""
from __future__ import annotations

import os


class Setting:
    def __init__(self, what: str, env: str, choices: tuple, default: str = "auto"):
        self.what, self.env, self.choices, self.default = what, env, choices, default
        self._override: str | None = None

    def set(self, value: str | None):
        """Force a value for this process (None returns to the env/default)."""
        if value is not None and value not in self.choices:
            raise ValueError(f"{self.what} {value!r}: expected one of {self.choices}")
        self._override = value

    def get(self) -> str:
        value = self._override or os.environ.get(self.env, self.default)
        if value not in self.choices:
            raise ValueError(f"{self.env}={value!r}: expected one of {self.choices}")
        return value
