"""`python tests/serve_with_hooks.py [--fault PROCESS:STAGE:ACTION[:SKIP]] SERVE_ARGS...`: the real
`k3jax.serve` entry point with the test hooks of tests/serving_hooks.py installed (the scripted-output
matcher always, a multi-host fault when --fault is given). Test-only: the product has no such flags."""
import sys

from serving_hooks import fault_hook, scripted_matcher     # (run as a file: tests/ is first on sys.path)

from k3jax import serve


def main(argv) -> int:
    fault = None
    if "--fault" in argv:
        i = argv.index("--fault")
        fault = fault_hook(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    return serve.main(argv, fault_hook=fault, request_matcher=scripted_matcher)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
