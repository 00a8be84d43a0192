"""The device mesh: always three named axes, `data`, `expert`, `tensor` (size 1 when unused).

Axis roles (see docs/sharding.md):
  data    independent sequences (attention data parallelism; pages and KDA slots are split here)
  expert  routed experts (E axis); for attention and caches it is a second data-parallel axis
  tensor  attention heads, dense/shared MLP and expert intermediate widths, vocabulary

Device order: `tensor` is the innermost (fastest-varying) axis so that head-parallel
collectives stay inside a host / NVLink island, then `expert`, then `data`.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

AXES = ("data", "expert", "tensor")


def spec_items(spec: str | Mapping[str, int]) -> dict[str, int]:
    """{"data": 2, "expert": 4} from "data=2,expert=4" (format checks only) or a dict (copied)."""
    if not isinstance(spec, str):
        return {k: int(v) for k, v in dict(spec).items()}
    items: dict[str, int] = {}
    for part in spec.replace(" ", "").split(","):
        if not part:
            continue
        if "=" not in part:
            raise ValueError(f"mesh spec {spec!r}: expected 'axis=size' items like 'data=2,expert=4', got {part!r}")
        name, val = part.split("=", 1)
        if name in items:
            raise ValueError(f"mesh spec {spec!r}: axis {name!r} given twice")
        try:
            items[name] = int(val)
        except ValueError:
            raise ValueError(f"mesh spec {spec!r}: size of {name!r} is not an integer: {val!r}") from None
    return items


def parse_mesh_spec(spec: str | Mapping[str, int] | None, num_devices: int,
                    local_devices: int | None = None) -> dict[str, int]:
    """Axis sizes {data, expert, tensor} from "data=2,expert=4", a dict, or None (default).

    One axis may be -1: it takes whatever the device count leaves. The product of the sizes
    must equal num_devices (ValueError otherwise). The default (spec None or "") puts
    tensor = gcd(num_devices, devices per host, 8) (heads inside a host) and the rest on
    expert (experts across hosts); data = 1.
    """
    if not spec:
        per_host = local_devices or num_devices
        t = math.gcd(math.gcd(num_devices, per_host), 8)
        return {"data": 1, "expert": num_devices // t, "tensor": t}
    items = spec_items(spec)
    unknown = sorted(set(items) - set(AXES))
    if unknown:
        raise ValueError(f"mesh spec {spec!r}: unknown axes {unknown}; allowed: {', '.join(AXES)}")
    sizes = {a: int(items.get(a, 1)) for a in AXES}
    free = [a for a in AXES if sizes[a] == -1]
    if len(free) > 1:
        raise ValueError(f"mesh spec {spec!r}: at most one axis may be -1")
    for a in AXES:
        if sizes[a] == 0 or sizes[a] < -1:
            raise ValueError(f"mesh spec {spec!r}: axis {a!r} has size {sizes[a]}; sizes must be >= 1")
    if free:
        rest = math.prod(s for a, s in sizes.items() if a != free[0])
        if num_devices % rest:
            raise ValueError(f"mesh spec {spec!r}: {num_devices} devices are not divisible by {rest}")
        sizes[free[0]] = num_devices // rest
    total = math.prod(sizes.values())
    if total != num_devices:
        shown = " x ".join(f"{a}={sizes[a]}" for a in AXES)
        raise ValueError(f"mesh spec {spec!r}: {shown} = {total} devices, but {num_devices} are available "
                         f"(the product of the axis sizes must equal the device count)")
    return sizes


def _device_grid(shape: tuple[int, ...], devices: Sequence) -> np.ndarray:
    """Topology-aware order when JAX knows the platform's topology, else the given order."""
    try:
        from jax.experimental import mesh_utils
        if len(devices) == len(jax.devices()) and list(devices) == list(jax.devices()):
            return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except Exception:  # noqa: BLE001 - unknown topology (CPU, partial device sets): plain order
        pass
    return np.asarray(devices, dtype=object).reshape(shape)


def make_mesh(spec: str | Mapping[str, int] | None = None, devices: Sequence | None = None) -> Mesh:
    """A Mesh with axes ("data", "expert", "tensor") over `devices` (default: all, every process).

    spec: "data=2,expert=4" / {"expert": 8} / None (default layout, see parse_mesh_spec).
    Raises ValueError when the sizes do not multiply to the device count.
    """
    devs = list(jax.devices() if devices is None else devices)
    if not devs:
        raise ValueError("make_mesh: no devices")
    local = sum(1 for d in devs if d.process_index == devs[0].process_index)
    sizes = parse_mesh_spec(spec, len(devs), local)
    shape = tuple(sizes[a] for a in AXES)
    return Mesh(_device_grid(shape, devs), AXES)


def axis_sizes(mesh: Mesh | Mapping[str, int] | None) -> dict[str, int]:
    """{axis: size} for a Mesh, an AbstractMesh or a plain dict (missing axes are 1)."""
    if mesh is None:
        return {a: 1 for a in AXES}
    shape = dict(mesh.shape) if hasattr(mesh, "shape") and not isinstance(mesh, Mapping) else dict(mesh)
    return {a: int(shape.get(a, 1)) for a in AXES}


def describe(mesh: Mesh | Mapping[str, int]) -> str:
    s = axis_sizes(mesh)
    return ",".join(f"{a}={s[a]}" for a in AXES)
