"""The model's call sites run the Pallas kernels (interpret mode on CPU) through the one dispatch
point and agree with the reference ops: KDA chunk (varlen, resumed states), paged MLA, fused
MXFP4 expert MLP."""
import numpy as np
import pytest

from pallas_kernels.backend import detect
from tests.support.kernel_steps import two_step_logits

pytestmark = pytest.mark.interpret


# slow (CI's time budget): a whole step of interpreted kernels, as the TPU path's in test_kda_tpu.py; each kernel's
# own interpret tests run by default (test_kda_kernels, test_mla_kernels, test_moe_kernels), and that a kernels
# backend's step calls them by test_step_closes_over_its_backend below
@pytest.mark.slow
def test_step_with_pallas_kernels_matches_reference():
    out = {}
    for mode in ("reference", "pallas"):
        backend = detect(mode)
        assert (backend.kernels, backend.interpret) == ((True, True) if mode == "pallas" else (False, False))
        out[mode], decode_only = two_step_logits(backend)
        assert decode_only == [False, True]          # the second step runs the fused decode op
    for ref, ker in zip(out["reference"], out["pallas"]):
        assert np.abs(ref - ker).max() / np.abs(ref).max() < 5e-4


def test_bad_kernel_mode_is_rejected():
    with pytest.raises(ValueError, match="kernels 'fast'"):
        detect("fast")
    from serving.engine_args import EngineArgs
    with pytest.raises(ValueError, match="kernels 'turbo'"):
        EngineArgs(kernels="turbo")


def test_step_closes_over_its_backend():
    """The runner's step traces with the backend it was built with: a references backend has no Pallas
    call, a kernels backend does, and the backend's MLA prefill form changes the traced step."""
    import jax
    import jax.numpy as jnp
    from k3jax.cache import SeqChunk, pool_shapes, make_step_batch
    from k3jax.layer_stack import stack_layers
    from k3jax.params import param_shapes
    from k3jax.presets import preset_config
    from k3jax.nnx_model import make_step

    c = preset_config("tiny-random")
    params = jax.eval_shape(lambda p: stack_layers(p, c), param_shapes(c, jnp.float32))
    pools = pool_shapes(c, 8, 16, 4, jnp.float32)
    batch = make_step_batch([SeqChunk([1, 2, 3], 0, [1], -1, 1)], 16, num_tokens=16, num_seqs=2, max_pages=2)
    reference = make_step(c, detect("reference"))
    kernels = make_step(c, detect("pallas"))
    assert "pallas_call" not in str(jax.make_jaxpr(reference)(params, pools, batch))
    assert "pallas_call" in str(jax.make_jaxpr(kernels)(params, pools, batch))
    absorbed = make_step(c, detect("reference", mla_prefill="absorbed"))
    expanded = make_step(c, detect("reference", mla_prefill="expanded"))
    traced_absorbed, traced_expanded = (str(jax.make_jaxpr(f)(params, pools, batch)) for f in (absorbed, expanded))
    assert traced_absorbed != traced_expanded == str(jax.make_jaxpr(expanded)(params, pools, batch))
