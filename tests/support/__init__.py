"""Helpers of the tests, not tests: the server fixture's process, engine workloads, the numpy and
transformers references, the multi-process scripts and the test hooks. Scripts here run as modules
(`python -m tests.support.NAME` from the repository root: ROOT is the working directory to give them)."""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
