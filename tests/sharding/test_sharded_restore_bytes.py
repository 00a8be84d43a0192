"""Sharded restore reads only local shards, measured by the bytes each process reads.

A synthetic K3-format checkpoint with wide MXFP4 experts (~74 MiB, experts ~85% of it) goes
through the converter (`python -m k3jax.convert` -> orbax). Two processes x 4 CPU devices
(jax.distributed over 127.0.0.1) restore it on mesh expert=8, whose expert axis spans both
processes. Bytes read are the `rchar` delta of /proc/self/io around the restore (tensorstore
reads with read/pread, so this counts every byte it asked the kernel for, page cache or not).
Each process must read about the bytes of its own shards (all replicated leaves plus half the
experts) and well under the checkpoint size; restoring the same checkpoint replicated reads
all of it, so the measurement can tell the two apart. Then the public path,
`k3jax.load_model(converted_dir, mesh="expert=8")`, on the same two processes: the parameters are
restored onto the rule shardings and kept there (placing them a second time read every array back to
the host, which a process cannot do with another process's shards).
"""
import json
import os
import socket
import sys

import pytest

from tests.support.mp_common import run_all

pytestmark = pytest.mark.integration

MESH = "expert=8"
MiB = 2**20


def _io() -> dict:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f.read().splitlines())}


def worker(coord: str, pid: int, ckpt: str, out: str):
    """One process: restore with the rule shardings, then replicated; report bytes read and needed."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    from sharding import distributed
    distributed.initialize(coord, 2, pid)
    import jax
    import numpy as np
    import orbax.checkpoint  # noqa: F401 - imported before measuring: module reads are not restore reads
    import tensorstore  # noqa: F401
    from k3jax.checkpoint import orbax_io
    from k3jax.config import ModelConfig
    from k3jax.params import is_leaf, param_spec
    from sharding.mesh import make_mesh
    from sharding.rules import param_shardings, replicated

    cfg = ModelConfig.from_json_file(os.path.join(ckpt, "config.json"))
    mesh = make_mesh(MESH)
    dtype = jax.numpy.bfloat16
    shardings = param_shardings(cfg, mesh)
    spec_leaves = jax.tree_util.tree_leaves(param_spec(cfg), is_leaf=is_leaf)

    def local_bytes(shs):
        """Bytes of the distinct slices this process's devices hold (what it must read)."""
        total = 0
        for leaf, sh in zip(spec_leaves, jax.tree_util.tree_leaves(shs)):
            item = np.dtype(leaf.dtype(dtype)).itemsize
            slices = {tuple((s.start, s.stop) for s in idx) for idx in sh.addressable_devices_indices_map(leaf.shape).values()}
            for sl in slices:
                total += item * int(np.prod([(b if b is not None else n) - (a or 0)
                                             for (a, b), n in zip(sl, leaf.shape)]))
        return total

    def restore(shs):
        before = _io()
        params = orbax_io.restore_params(ckpt, cfg, dtype, mesh=mesh, shardings=shs)
        jax.block_until_ready(params)
        return _io()["rchar"] - before["rchar"], params

    read_sharded, params = restore(shardings)
    experts = params["layers"][1]["mlp"]["experts"]["w1_packed"]
    local_experts = sorted({e for idx in experts.sharding.addressable_devices_indices_map(experts.shape).values()
                            for e in range(*idx[0].indices(experts.shape[0]))})
    rep = jax.tree_util.tree_map(lambda _: replicated(mesh), shardings)
    read_replicated, _ = restore(rep)
    from k3jax.api import load_model
    model = load_model(ckpt, mesh=MESH, dtype="bfloat16")
    loaded = [x for path, x in jax.tree_util.tree_leaves_with_path(model.params)
              if "w1_packed" in jax.tree_util.keystr(path)][0]               # stacked: [layers, E, ...]
    axis = loaded.ndim - 3
    loaded_experts = sorted({e for idx in loaded.sharding.addressable_devices_indices_map(loaded.shape).values()
                             for e in range(*idx[axis].indices(loaded.shape[axis]))})
    with open(f"{out}.{pid}", "w") as f:
        json.dump({"read_sharded": read_sharded, "needed_sharded": local_bytes(shardings),
                   "read_replicated": read_replicated, "needed_replicated": local_bytes(rep),
                   "local_experts": local_experts, "loaded_experts": loaded_experts}, f)
    jax.distributed.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from tools import synthetic_k3
    from k3jax.convert import main
    root = tmp_path_factory.mktemp("restore")
    raw = synthetic_k3.k3_config_dict(num_experts=16, moe_intermediate_size=2048, routed_expert_hidden_size=256)
    synthetic_k3.write_checkpoint(root / "hf", raw, shard_bytes=64 * MiB, keep_params=False, tokenizer=False)
    assert main(["--src", str(root / "hf"), "--dst", str(root / "out"), "--no-progress"]) == 0
    return root / "out"


@pytest.mark.slow     # CI's time budget (a converted checkpoint and two processes)
@pytest.mark.timeout(240)
def test_each_process_reads_only_its_shards(converted, tmp_path):
    import ml_dtypes
    import numpy as np
    from k3jax.checkpoint import orbax_io
    index = orbax_io.read_index(converted)
    nbytes = {k: int(np.prod(v["shape"])) * np.dtype(getattr(ml_dtypes, v["dtype"], v["dtype"])).itemsize
              for k, v in index["leaves"].items()}
    full = sum(nbytes.values())
    experts = sum(n for k, n in nbytes.items() if ".experts." in k)
    assert experts > 0.8 * full                   # the checkpoint is mostly routed experts
    out = str(tmp_path / "bytes.json")
    coord = f"127.0.0.1:{_free_port()}"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    run_all([[sys.executable, "-m", "tests.sharding.test_sharded_restore_bytes", coord, str(i), str(converted), out] for i in range(2)], env)
    got = [json.loads(open(f"{out}.{i}").read()) for i in range(2)]
    # expert=8 spans both processes: each holds 8 of the 16 experts, different ones
    assert [g["local_experts"] for g in got] == [list(range(0, 8)), list(range(8, 16))]
    assert [g["loaded_experts"] for g in got] == [list(range(0, 8)), list(range(8, 16))]   # load_model alike
    for i, g in enumerate(got):
        print(f"process {i}: read {g['read_sharded'] / MiB:.1f} MiB sharded (needs {g['needed_sharded'] / MiB:.1f}), "
              f"{g['read_replicated'] / MiB:.1f} MiB replicated; checkpoint {full / MiB:.1f} MiB")
        assert g["needed_replicated"] == full and g["needed_sharded"] < 0.6 * full
        # reads what its shards need (plus orbax/OCDBT metadata), never the other process's experts
        assert g["needed_sharded"] <= g["read_sharded"] <= 1.03 * g["needed_sharded"] + 1 * MiB
        assert g["read_sharded"] < 0.6 * full
        # the same measurement sees a full read when every leaf is replicated
        assert full <= g["read_replicated"] <= 1.03 * full + 1 * MiB


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
