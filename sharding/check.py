"""`python -m sharding.check --mesh data=2,expert=4`: a cluster smoke test.

Runs the tiny model's greedy loop on a mesh over every device of every process (process 0
broadcasting each step's batch) and, on process 0, prints the tokens and whether they equal
a single-device run of the same model. Exit status 0 when they do. Launch it on every host
through `python -m sharding.launch sharding.check ...` (see docs/sharding.md).
"""
from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], [42, 42, 42, 42, 42]]


def run(mesh_spec: str | None, max_new: int = 6) -> tuple[list, list]:
    """(tokens on the mesh, tokens on one local device) for the tiny model."""
    from k3jax.cache import make_pools
    from k3jax.params import init_params_numpy
    from k3jax.presets import TINY_SEED, preset_config
    from sharding import distributed
    from sharding.mesh import make_mesh
    from sharding.rules import shard_params, shard_pools
    from sharding.step import greedy, sharded_step

    c = preset_config("tiny-random")
    mesh = make_mesh(mesh_spec)
    split = mesh.shape["data"] * mesh.shape["expert"]
    n_pages = n_slots = max(8, split)
    gen = dict(page_size=16, bucket_tokens=16, pages_per_seq=2)
    host = init_params_numpy(c, TINY_SEED, jnp.float32)
    pools = shard_pools(make_pools(c, n_pages, 16, n_slots, jnp.float32), mesh)
    toks = greedy(sharded_step(c, mesh, pools), shard_params(host, mesh, c), pools, PROMPTS, max_new,
                  put=lambda b: distributed.step_input(b, mesh), **gen)
    local = jax.local_devices()[0]
    with jax.default_device(local):
        p1 = jax.device_put(host, local)
        pools1 = jax.device_put(make_pools(c, n_pages, 16, n_slots, jnp.float32), local)
        ref = greedy(sharded_step(c, None, pools1), p1, pools1, PROMPTS, max_new, **gen)
    return toks, ref


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sharding.check", description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", default=None, help="e.g. data=2,expert=4 (default: sharding.mesh's default)")
    ap.add_argument("--max-new", type=int, default=6)
    args = ap.parse_args(argv)
    toks, ref = run(args.mesh, args.max_new)
    if jax.process_index() == 0:
        print(f"processes {jax.process_count()}, devices {len(jax.devices())} ({jax.devices()[0].platform})")
        print(f"mesh tokens   {toks}\nsingle device {ref}\n{'OK' if toks == ref else 'MISMATCH'}")
    return 0 if toks == ref else 1


if __name__ == "__main__":
    sys.exit(main())
