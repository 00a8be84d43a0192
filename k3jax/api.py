"""Notebook-friendly entry point: `load_model` and the `Model` it returns."""
from __future__ import annotations

import logging
import os
from functools import cached_property

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import ModelConfig
from k3jax.expert_layout import merge_gate_up, split_gate_up
from k3jax.layer_stack import stack_layers
from k3jax.params import init_params_by_leaf, init_params_numpy
from k3jax.checkpoint import hub
from k3jax.presets import TINY_SEED, preset_config, preset_names
from k3jax.vision.model import VisionModel, media_pad_id
from pallas_kernels.backend import Backend, detect
from serving.engine_args import claim_device_memory
from sharding import rules
from sharding.mesh import make_mesh

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16, "float32": jnp.float32, "fp32": jnp.float32,
           "float16": jnp.float16, "float64": jnp.float64}


def _dtype(dtype):
    if dtype is None:
        return jnp.bfloat16
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r}: expected one of {sorted(_DTYPES)}")
        return _DTYPES[dtype]
    return jnp.dtype(dtype).type


class Model:
    """A loaded model: config, parameters (a pytree of jax arrays; the repeating layers stacked
    for the scanned decoder, see `layer_params` for one layer), tokenizer, the vision side
    (`vision`, None for text-only models), and `backend`: how its steps run their kernels
    (pallas_kernels/backend.py; detected when not given, with the MXFP4 decoder its scales allow)."""

    def __init__(self, config: ModelConfig, params, tokenizer=None, name: str = "", mesh=None,
                 vision: VisionModel | None = None, backend: Backend | None = None):
        self.config = config
        self.backend = detect() if backend is None else backend
        self.mesh = mesh
        self.params = params
        self.tokenizer = tokenizer
        self.name = name
        self.vision = vision

    def checkpoint_params(self) -> dict:
        """The parameters in the checkpoint layout (params["layers"] a list of per-layer dicts);
        stacked layers come out as slices, i.e. copies."""
        from k3jax.layer_stack import unstack_layers
        return split_gate_up(unstack_layers(self.params, self.config))

    def layer_params(self, i: int) -> dict:
        """Layer i's parameters under their checkpoint names."""
        return self.checkpoint_params()["layers"][i]

    @property
    def dtype(self):
        return self.params["embed"].dtype

    @cached_property
    def module(self):
        """The model as a Flax NNX module tree over the same arrays (k3jax/nnx_model.py): print it,
        walk its layers (`module.layers`), read a parameter's logical axes (`.logical_axes`)."""
        from k3jax.nnx_model import K3Model
        return K3Model(self.config, self.params)

    def summary(self) -> str:
        """A table: one row per layer (attention and MLP module types, scanned or not, parameter
        elements), then the totals."""
        from k3jax.nnx_model import summary
        rows = summary(self.module)
        lines = [f"{'layer':>5}  {'attention':<9} {'mlp':<8} {'scanned':<7} {'params':>12}"]
        lines += [f"{r['layer']:>5}  {r['attention']:<9} {r['mlp']:<8} {str(r['scanned']):<7} {r['params']:>12,}"
                  for r in rows]
        from k3jax.params import tree_parameter_count
        total = tree_parameter_count(self.params)
        lines.append(f"{self.name or 'custom'}: {self.config.num_layers} layers, {total:,} parameters "
                     f"({total - sum(r['params'] for r in rows):,} outside the layers), "
                     f"{jnp.dtype(self.dtype).name}")
        return "\n".join(lines)

    @cached_property
    def _logits_fn(self):
        from k3jax.nnx_model import graph_for
        graph = graph_for(self.config, self.params)
        return jax.jit(lambda params, tokens: graph.merge(params)(tokens, backend=self.backend))

    def check_tokens(self, tokens, ndim: int = 2) -> np.ndarray:
        """Validate token ids: integer dtype, non-empty, within the vocabulary. Raises ValueError."""
        arr = np.asarray(tokens)
        if arr.dtype == object or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
            raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
        if arr.ndim != ndim:
            raise ValueError(f"token ids must have {ndim} dimensions, got shape {arr.shape}")
        if arr.size == 0:
            raise ValueError("token ids are empty")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.config.vocab_size:
            raise ValueError(f"token id {lo if lo < 0 else hi} out of range [0, {self.config.vocab_size})")
        return arr.astype(np.int32)

    def logits(self, tokens) -> np.ndarray:
        """tokens int [B, T] -> float32 numpy logits [B, T, vocab] (no cache; every row starts empty)."""
        toks = self.check_tokens(tokens, ndim=2)
        return np.asarray(self._logits_fn(self.params, tokens=toks), dtype=np.float32)

    def __repr__(self):
        return f"Model({self.name or 'custom'}, layers={self.config.num_layers}, dtype={jnp.dtype(self.dtype).name})"


TINY_WEIGHTS = os.path.join(os.path.dirname(__file__), "assets", "tiny-trained.safetensors")


def _load_tokenizer(path: str | None, preset: str = "tiny-random"):
    from k3jax.tokenizer import KimiTokenizer
    if path is None:
        return KimiTokenizer.tiny_english() if preset == "tiny" else KimiTokenizer.tiny()
    for name in ("tiktoken.model", "tokenizer.model"):
        f = os.path.join(path, name)
        if os.path.exists(f):
            cfg = os.path.join(path, "tokenizer_config.json")
            return KimiTokenizer.from_file(f, tokenizer_config=cfg if os.path.exists(cfg) else None)
    log.warning("%s has no tiktoken.model: the model is loaded without a tokenizer", path)
    return None


def _tiny_params(config: ModelConfig, seed: int | None, dtype):
    """The trained tiny weights shipped in the package; random ones (with a warning saying why)
    when the file is absent or `seed` asks for them."""
    if seed is None and os.path.exists(TINY_WEIGHTS):
        from k3jax.checkpoint.flat_file import load_flat
        return load_flat(TINY_WEIGHTS, config, dtype)
    if seed is None:
        log.warning("%s is missing (build it with python -m tools.train_tiny): 'tiny' has RANDOM weights and "
                    "prints noise; load 'tiny-random' to ask for random weights", TINY_WEIGHTS)
    return init_params_numpy(config, TINY_SEED if seed is None else seed, dtype)


def _place(params, mesh, config, backend: Backend, merged_experts: bool = False):
    """Put every parameter on the mesh by the partition rules (sharding/rules.py), then stack the
    repeating layers for the scanned decoder (k3jax/layer_stack.py); merged_experts, on one GPU running
    the fused MoE kernels: merge the routed experts' gate and up weights (k3jax/expert_layout.py)."""
    if mesh is not None:
        params = rules.shard_params(params, mesh, config)
    params = stack_layers(params, config, donate=True)
    if merged_experts and mesh is None and backend.kernels and backend.platform != "tpu":
        # opt-in until the merged kernels are measured end to end on the GPU
        params = merge_gate_up(params)
    return params


def _backend_for(params, kernels: str = "auto", mla_prefill: str = "auto", mla_decode: str = "auto") -> Backend:
    """The backend of these choices on this device (pallas_kernels/backend.py), with the MXFP4 decoder
    these weights allow: the fast decoder is exact only for a window of E8M0 scales (real checkpoints
    sit well inside it); weights with a scale outside it get the exact ptx4 decoder."""
    from pallas_kernels.moe import mxfp4 as mx
    backend = detect(kernels, mla_prefill=mla_prefill, mla_decode=mla_decode)
    # (every container kind: the checkpoint layout keeps its layers in a list)
    found = [val for path, val in jax.tree_util.tree_leaves_with_path(params)
             if str(getattr(path[-1], "key", "")).endswith("_scale") and getattr(val, "dtype", None) == jnp.uint8]
    if not found:
        return backend
    lo = min(int(jnp.min(s)) for s in found)
    hi = max(int(jnp.max(s)) for s in found)
    decoder = mx.decoder_for_scales(lo, hi, backend.mxfp4_decoder)
    if decoder != backend.mxfp4_decoder:
        log.warning("MXFP4 scale exponents span [%d, %d], outside the %s decoder's exact window %s: "
                    "using %s", lo, hi, backend.mxfp4_decoder, mx.PTX8_EXACT_SCALES, decoder)
    return backend.replace(mxfp4_decoder=decoder)


def _mesh(mesh):
    """A jax Mesh, a spec string like "data=2,expert=4", or None."""
    if mesh is None or not isinstance(mesh, str):
        return mesh
    return make_mesh(mesh)


def load_model(path_or_preset: str, *, dtype=None, mesh=None, seed: int | None = None, kernels: str = "auto",
               mla_prefill: str = "auto", mla_decode: str = "auto", merged_experts: bool = False,
               revision: str | None = None, download_dir: str | None = None) -> Model:
    """Load a preset name ("tiny"), a converted k3jax checkpoint, a Hugging Face checkpoint directory, or a
    Hugging Face model id ("ORG/NAME": the hub's local cache first, at `revision`, under `download_dir`).

    mesh: a jax Mesh or a spec like "data=2,expert=4": parameters are placed by the partition rules
    and the serving engine shards its pools and runs MoE expert-parallel on it.

    kernels / mla_prefill / mla_decode: the model's backend (pallas_kernels/backend.py; EngineArgs
    documents the values); merged_experts: the routed experts' gate and up weights merged (one GPU
    running the kernels).

    "tiny" is the trained embedded model (k3jax/assets/tiny-trained.safetensors); "tiny-random" the
    seeded random model the tests use. Other presets have no weights: `seed=` gives them random
    weights (benchmarks); for "tiny", `seed=` asks for random weights of its shape.
    """
    claim_device_memory()          # before JAX starts its backend (the engine sizes its cache from it)
    dt = _dtype(dtype)
    choices = dict(kernels=kernels, mla_prefill=mla_prefill, mla_decode=mla_decode)
    detect(kernels, mla_prefill=mla_prefill, mla_decode=mla_decode)      # a bad choice fails before loading
    mesh = _mesh(mesh)
    src = os.fspath(path_or_preset)
    name = os.path.basename(os.path.normpath(src))
    if src not in preset_names() and hub.looks_like_repo_id(src):
        name, src = src, hub.resolve(src, revision=revision, download_dir=download_dir)
    if os.path.isdir(src):
        from k3jax.checkpoint.load import load_checkpoint_dir
        from k3jax.checkpoint.vision_ckpt import load_vision
        shardings_of = None if mesh is None else lambda c: rules.param_shardings(c, mesh)
        config, params = load_checkpoint_dir(src, dt, mesh=mesh, shardings_of=shardings_of)
        backend = _backend_for(params, **choices)
        tokenizer = _load_tokenizer(src)
        return Model(config, _place(params, mesh, config, backend, merged_experts), tokenizer, name=name,
                     mesh=mesh, vision=load_vision(src, config, tokenizer, dt), backend=backend)
    if src not in preset_names():
        raise ValueError(f"{src!r} is neither a directory, a preset ({', '.join(preset_names())}) nor a "
                         "Hugging Face model id (ORG/NAME)")
    config = preset_config(src)
    embedded = src in ("tiny", "tiny-random")
    if not embedded and seed is None:
        raise ValueError(f"preset {src!r} ships no weights: pass seed= for random weights, or a checkpoint path")
    if src == "tiny":
        params = _tiny_params(config, seed, dt)
    elif src == "tiny-random":
        # The seeded test model: the same weights on every platform, made on the host in milliseconds.
        params = init_params_numpy(config, TINY_SEED if seed is None else seed, dt)
    else:
        # made in the scan layout on the rules' shardings: placed once, never restacked
        shardings = None if mesh is None else rules.param_shardings(config, mesh, stacked=True)
        params = init_params_by_leaf(config, jax.random.key(seed), dtype=dt, stacked=True, shardings=shardings)
    backend = _backend_for(params, **choices)
    tokenizer = _load_tokenizer(None, src) if embedded else None
    vision = _preset_vision(config, tokenizer, src, TINY_SEED if seed is None else seed, dt)
    return Model(config, _place(params, mesh, config, backend, merged_experts), tokenizer, name=src, mesh=mesh, vision=vision, backend=backend)


def _preset_vision(config: ModelConfig, tokenizer, name: str, seed: int, dtype) -> VisionModel | None:
    """Random (numpy-seeded) tower weights for presets that declare a full vision_config."""
    if not config.vision or name != "tiny-random":
        return None
    from k3jax.presets import TINY_IMAGE_PROCESSOR
    from k3jax.vision.config import VisionConfig
    from k3jax.vision.preprocess import ImageProcessorConfig
    from k3jax.vision.tower import init_vision_params_numpy, tower_of
    vcfg = VisionConfig.from_dict(config.vision, text_hidden_size=config.hidden_size)
    # (the text weights come from `seed`; the tower's own stream keeps them unchanged)
    params = init_vision_params_numpy(vcfg, seed + 1, config.hidden_size, dtype)
    return VisionModel(vcfg, tower_of(params, vcfg), ImageProcessorConfig.from_dict(TINY_IMAGE_PROCESSOR),
                       media_pad_id(config, tokenizer))
