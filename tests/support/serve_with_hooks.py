"""`python -m tests.support.serve_with_hooks [--fault PROCESS:STAGE:ACTION[:SKIP]] SERVE_ARGS...`: the real
`k3jax.serve` entry point with the test hooks of tests/support/serving_hooks.py installed (the scripted-output
matcher always, a multi-host fault when --fault is given). Test-only: the product has no such flags."""
import sys

from k3jax import serve
from tests.support.serving_hooks import fault_hook, scripted_matcher


def main(argv) -> int:
    fault = None
    if "--fault" in argv:
        i = argv.index("--fault")
        fault = fault_hook(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    return serve.main(argv, fault_hook=fault, request_matcher=scripted_matcher)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
