"""argparse help that shows every flag's default (unless its help text already says it)."""
from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):
        text = action.help or ""
        return text if "default:" in text or "%(default)" in text else super()._get_help_string(action)


def int_at_least(low: int, high: int | None = None):
    """An argparse type: an integer in [low, high], so a bad flag is refused before a model loads."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            span = f"between {low} and {high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be {span}, got {value}")
        return value
    return parse


def add_model_source_args(ap: argparse.ArgumentParser) -> None:
    """--revision / --download-dir: where a Hugging Face model id (--model ORG/NAME) comes from."""
    ap.add_argument("--revision", default=None,
                    help="branch, tag or commit of a Hugging Face model id (default: main)")
    ap.add_argument("--download-dir", default=None,
                    help="Hugging Face cache directory for model ids (default: the hub's, $HF_HOME/hub); "
                         "HF_HUB_OFFLINE=1 reads only what is there")
