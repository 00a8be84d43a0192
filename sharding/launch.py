"""`python -m sharding.launch MODULE [ARGS...]`: start the multi-host runtime, then run MODULE.

Every process of a job runs the same line (deploy/launch_*.sh do that). The runtime is set
up from K3JAX_COORDINATOR / K3JAX_NUM_PROCESSES / K3JAX_PROCESS_ID, else JAX's cluster
auto-detection (TPU pods, SLURM); then MODULE runs as `python -m MODULE ARGS...` would.
K3JAX_LOCAL_DEVICE_IDS="0" (comma list) restricts a process to some local accelerators.
"""
from __future__ import annotations

import os
import runpy
import sys


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if argv else 2)
    from sharding import distributed
    ids = os.environ.get("K3JAX_LOCAL_DEVICE_IDS")
    distributed.initialize(local_device_ids=[int(i) for i in ids.split(",")] if ids else None)
    module, rest = argv[0], argv[1:]
    sys.argv = [module] + rest
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
