#!/usr/bin/env python
"""Convert a Hugging Face Kimi checkpoint to a k3jax checkpoint (same as `python -m k3jax.convert`)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from k3jax.convert import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
