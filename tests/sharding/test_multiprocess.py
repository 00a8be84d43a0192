"""2 processes x 4 CPU devices (jax.distributed over 127.0.0.1, gloo) give the greedy tokens of 1 device."""
import json
import os
import socket
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.cache import make_pools
from k3jax.params import init_params_numpy
from k3jax.presets import TINY_SEED, preset_config
from tests.support.mp_common import GEN, MAX_NEW, POOL, PROMPTS, run_all
from sharding.step import greedy, sharded_step

pytestmark = pytest.mark.integration



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single_device():
    c = preset_config("tiny-random")
    params = init_params_numpy(c, TINY_SEED, jnp.float32)
    pools = make_pools(c, POOL["num_pages"], POOL["page_size"], POOL["num_slots"], jnp.float32)
    logits = []
    toks = greedy(sharded_step(c, None, pools), params, pools, PROMPTS, MAX_NEW, on_logits=logits.append, **GEN)
    return toks, logits[0]


@pytest.mark.timeout(240)
# tensor pairs inside a process, the expert all-to-all across both processes
@pytest.mark.slow     # CI's time budget: process groups start by default in test_multihost_serving / _faults
@pytest.mark.parametrize("mesh", ["tensor=2,expert=4"])
def test_two_processes_match_one_device(tmp_path, mesh):
    out = tmp_path / "out.json"
    coord = f"127.0.0.1:{_free_port()}"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["MP_LOCAL_DEVICES"] = "4"
    env["MP_XLA_EXTRA"] = "--xla_backend_optimization_level=0"   # halves CPU compile time here
    cmds = [[sys.executable, "-m", "tests.support.mp_greedy", coord, "2", str(i), mesh, str(out)] for i in range(2)]
    # the single-device reference is computed while the two processes compile
    _, (ref_toks, ref_logits0) = run_all(cmds, env, before_wait=_single_device)
    got = json.loads(out.read_text())
    assert got["processes"] == 2 and got["devices"] == 8 and got["expert_axis_processes"] == [0, 1]
    assert got["tokens"] == ref_toks
    np.testing.assert_allclose(np.asarray(got["logits0"]), np.asarray(ref_logits0), rtol=0, atol=5e-3)
