"""argparse help that shows every flag's default (unless its help text already says it)."""
from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):
        text = action.help or ""
        return text if "default:" in text or "%(default)" in text else super()._get_help_string(action)
