"""The test tiers: a parametrized case kept out of the default run (CI's 15-minute budget on 2 cores) runs in
the slow tier (`python -m pytest -m slow`)."""
import pytest


def slow_case(*values, id=None):
    """One parametrize case in the slow tier: the variants that only widen what a default case checks."""
    return pytest.param(*values, marks=pytest.mark.slow, id=id)
