"""One process of the multi-host test: `python -m tests.support.mp_greedy COORD NPROC PID MESH OUT_JSON`.

Runs the tiny model's greedy loop on a mesh that spans every process's CPU devices, with
process 0 broadcasting each step's batch. Process 0 writes {"tokens": ..., "logits0": ...}.
"""
import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=" + os.environ.get("MP_LOCAL_DEVICES", "4")
                           + " " + os.environ.get("MP_XLA_EXTRA", ""))
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")


def main():
    coord, nproc, pid, mesh_spec, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    from sharding import distributed
    distributed.initialize(coord, nproc, pid)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from k3jax.cache import make_pools
    from k3jax.params import init_params_numpy
    from k3jax.presets import TINY_SEED, preset_config
    from sharding.mesh import make_mesh
    from sharding.rules import shard_params, shard_pools
    from sharding.step import greedy, sharded_step
    from tests.support.mp_common import GEN, MAX_NEW, POOL, PROMPTS

    assert jax.process_count() == nproc and len(jax.devices()) == nproc * jax.local_device_count()
    c = preset_config("tiny-random")
    mesh = make_mesh(mesh_spec)
    params = shard_params(init_params_numpy(c, TINY_SEED, jnp.float32), mesh, c)
    pools = shard_pools(make_pools(c, POOL["num_pages"], POOL["page_size"], POOL["num_slots"], jnp.float32), mesh)
    step = sharded_step(c, mesh, pools)
    logits = []
    toks = greedy(step, params, pools, PROMPTS, MAX_NEW, put=lambda b: distributed.step_input(b, mesh),
                  on_logits=logits.append, **GEN)
    if pid == 0:
        with open(out, "w") as f:
            json.dump({"tokens": toks, "logits0": np.asarray(logits[0]).tolist(),
                       "devices": len(jax.devices()), "processes": jax.process_count(),
                       "expert_axis_processes": sorted({d.process_index for d in mesh.devices[0, :, 0]})}, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
