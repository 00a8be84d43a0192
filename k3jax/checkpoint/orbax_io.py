"""Converted k3jax checkpoints: streaming orbax save and sharded restore.

Layout of a `k3jax_params/` directory:
  items/00000, items/00001, ...  one orbax PyTree checkpoint (OCDBT) per group of leaves;
  index.json                     written last: format, leaf -> (item, shape, dtype).

Orbax's save takes a whole pytree in memory; a terabyte checkpoint cannot be one. So leaves are
written in groups of about `group_bytes` (a leaf larger than that is a group of its own), each
group an ordinary orbax item: memory stays near max(group_bytes, largest leaf), and restore is
a plain orbax restore per item with target shardings, so each process reads only the chunks
its devices need. Chunks are at most `chunk_bytes`, one expert per chunk for [E, ...] leaves,
so an expert- or tensor-parallel shard never decodes its neighbours' data.
"""
from __future__ import annotations

import ctypes
import inspect
import json
import os
from typing import Iterable, Sequence

import jax
import numpy as np

from k3jax.checkpoint.hf_names import path_str
from k3jax.config import ModelConfig
from k3jax.params import is_leaf, param_spec

FORMAT = "k3jax-orbax-v1"
INDEX = "index.json"
PARAMS_DIR = "k3jax_params"
GROUP_BYTES = 256 << 20
CHUNK_BYTES = 32 << 20


def leaf_key(path) -> str:
    """Parameter path -> flat key, e.g. 'layers.3.mlp.experts.w1_packed' (path_str of the tree path)."""
    return path if isinstance(path, str) else path_str(path)


def _item_key(key: str) -> str:
    return key.replace(".", "__")   # orbax joins tree keys with '.': keep each leaf one flat name


def _handler(for_save: bool = False):
    import orbax.checkpoint as ocp
    kw = {}
    params = inspect.signature(ocp.PyTreeCheckpointHandler.__init__).parameters
    if "use_compression" in params:
        kw["use_compression"] = False   # weights barely compress; zstd would only cost CPU time
    if for_save and "type_handler_registry" in params:
        try:   # numpy leaves are never modified after being handed over: skip orbax's defensive copy
            th = ocp.type_handlers
            kw["type_handler_registry"] = th.create_type_handler_registry(
                (np.ndarray, th.NumpyHandler(deepcopy_host_arrays=False)))
        except (AttributeError, TypeError):
            pass
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**kw))


def _trim():
    """Hand freed heap back to the OS (tensorstore's writer threads leave large free arenas)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _save_args(arr: np.ndarray, chunk_bytes: int):
    import orbax.checkpoint as ocp
    kw = {"chunk_byte_size": chunk_bytes}
    if arr.ndim == 3 and "shard_axes" in inspect.signature(ocp.SaveArgs).parameters:
        kw["shard_axes"] = (0,)     # stacked experts: one expert per chunk
    return ocp.SaveArgs(**kw)


def save_params_streaming(path: str | os.PathLike, leaves: Iterable[tuple[str, np.ndarray]], *,
                          total_bytes: int | None = None, group_bytes: int = GROUP_BYTES,
                          chunk_bytes: int = CHUNK_BYTES, progress: bool = True, meta: dict | None = None,
                          sizes: Sequence[int] | None = None) -> dict:
    """Write (key, numpy array) pairs, one group at a time, into the `k3jax_params` directory `path`.

    `leaves` is consumed lazily (a generator that builds each array on demand keeps memory bounded).
    `sizes` (bytes of each leaf, in order) lets a group be written before a leaf that would overflow
    it is built; without it a group is written once it reaches `group_bytes`.
    `path` must not exist or be empty. index.json is written last: a directory without it is incomplete.
    Returns the index dict.
    """
    from tqdm import tqdm
    path = os.fspath(path)
    os.makedirs(os.path.join(path, "items"), exist_ok=True)
    if os.listdir(os.path.join(path, "items")):
        raise ValueError(f"{path}: items/ is not empty")
    ckptr = _handler(for_save=True)
    index = {"format": FORMAT, "items": [], "leaves": {}, **(meta or {})}
    group: dict[str, np.ndarray] = {}
    group_size = 0

    def flush():
        nonlocal group, group_size
        if not group:
            return
        name = f"{len(index['items']):05d}"
        tree = {_item_key(k): v for k, v in group.items()}
        ckptr.save(os.path.join(path, "items", name), tree,
                   save_args={k: _save_args(v, chunk_bytes) for k, v in tree.items()})
        index["items"].append(name)
        group, group_size = {}, 0
        _trim()

    with tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress,
              desc="converting", smoothing=0.05) as bar:
        for n, (key, arr) in enumerate(leaves, start=1):
            arr = np.asarray(arr)
            if key in index["leaves"]:
                raise ValueError(f"{key}: written twice")
            group[key] = arr
            group_size += arr.nbytes
            index["leaves"][key] = {"item": f"{len(index['items']):05d}", "shape": list(arr.shape),
                                    "dtype": np.dtype(arr.dtype).name}
            bar.update(arr.nbytes)
            del arr
            nxt = sizes[n] if sizes is not None and n < len(sizes) else 0    # flush before building it
            if group_size + nxt > group_bytes if sizes is not None else group_size >= group_bytes:
                flush()
        flush()
    tmp = os.path.join(path, INDEX + ".tmp")
    with open(tmp, "w") as f:
        json.dump(index, f, indent=1)
    os.replace(tmp, os.path.join(path, INDEX))
    return index


def params_dir(path: str | os.PathLike) -> str:
    """The `k3jax_params` directory for a converted checkpoint dir (or that directory itself)."""
    path = os.fspath(path)
    sub = os.path.join(path, PARAMS_DIR)
    return sub if os.path.isdir(sub) else path


def read_index(path: str | os.PathLike) -> dict:
    root = params_dir(path)
    f = os.path.join(root, INDEX)
    if not os.path.exists(f):
        raise ValueError(f"{root}: no {INDEX} (not a converted k3jax checkpoint, or the conversion did not finish)")
    try:
        with open(f) as fh:
            index = json.load(fh)
    except json.JSONDecodeError as e:
        raise ValueError(f"{f}: not valid JSON ({e})") from e
    if index.get("format") != FORMAT:
        raise ValueError(f"{f}: format {index.get('format')!r}, expected {FORMAT!r}")
    return index


def default_shardings(config: ModelConfig, mesh, spec=None):
    """The parameters' shardings when the caller gives none: replicated over a mesh, the first device
    without one (the partition rules' shardings come from the caller: the model library does not import
    sharding/)."""
    from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding
    spec = param_spec(config) if spec is None else spec
    one = SingleDeviceSharding(jax.devices()[0]) if mesh is None else NamedSharding(mesh, PartitionSpec())
    return jax.tree_util.tree_map(lambda _: one, spec, is_leaf=is_leaf)


def _check_against_spec(index: dict, flat_spec, dtype, root: str):
    stored = index["leaves"]
    keys = [leaf_key(p) for p, _ in flat_spec]
    missing = [k for k in keys if k not in stored]
    extra = sorted(set(stored) - set(keys))
    if missing or extra:
        raise ValueError(f"{root} does not match config.json: missing {_names(missing)}; unexpected {_names(extra)}")
    for (p, leaf), k in zip(flat_spec, keys):
        if tuple(stored[k]["shape"]) != tuple(leaf.shape):
            raise ValueError(f"{root}: {k} has shape {tuple(stored[k]['shape'])}, config.json expects {leaf.shape}")
        if (stored[k]["dtype"] == "uint8") != (leaf.kind in ("mx_packed", "mx_scale")):
            raise ValueError(f"{root}: {k} is stored as {stored[k]['dtype']}, config.json expects "
                             f"{np.dtype(leaf.dtype(dtype)).name}")


def _names(xs, n=8):
    if not xs:
        return "none"
    return ", ".join(xs[:n]) + (f" (+{len(xs) - n} more)" if len(xs) > n else "")


def restore_params(path: str | os.PathLike, config: ModelConfig, dtype, mesh=None, shardings=None):
    """Restore a converted checkpoint into the k3jax parameter tree of `config`.

    Float leaves are cast to `dtype` on read (fp32-kind leaves stay fp32, MXFP4 stays uint8).
    Placement: `shardings` (a tree like the params of jax.sharding.Sharding, e.g.
    sharding.rules.param_shardings(config, mesh)) if given; else replicated over `mesh`; else the first
    device. Orbax reads each array straight into its target
    sharding: every process reads only the chunks its addressable shards cover.
    """
    import orbax.checkpoint as ocp
    root = params_dir(path)
    index = read_index(root)
    spec = param_spec(config)
    flat_spec, treedef = jax.tree_util.tree_flatten_with_path(spec, is_leaf=is_leaf)
    _check_against_spec(index, flat_spec, dtype, root)
    if shardings is None:
        shardings = default_shardings(config, mesh, spec)
    flat_sh = treedef.flatten_up_to(shardings)

    by_item: dict[str, dict[str, jax.ShapeDtypeStruct]] = {}
    for (p, leaf), sh in zip(flat_spec, flat_sh):
        k = leaf_key(p)
        by_item.setdefault(index["leaves"][k]["item"], {})[_item_key(k)] = jax.ShapeDtypeStruct(
            leaf.shape, leaf.dtype(dtype), sharding=sh)
    ckptr = _handler()
    restored: dict[str, jax.Array] = {}
    for item in sorted(by_item):
        target = by_item[item]
        args = ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))
        out = ckptr.restore(os.path.join(root, "items", item), args=args)
        restored.update(out)
    return jax.tree_util.tree_unflatten(treedef, [restored[_item_key(leaf_key(p))] for p, _ in flat_spec])
