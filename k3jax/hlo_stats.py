"""What a compiled XLA program materializes: its buffers above a size, read from `compiled.as_text()`.

A step should move a cache pool or a layer's weights only where it means to (a kernel reading them,
a scatter writing rows in place). `data_moves` lists the instructions that produce a new buffer of at
least `min_bytes` by copying, slicing or converting another one: a pool-sized entry is a copy of the
pool, a layer-sized one inside a while body a per-iteration copy of scanned weights.
"""
from __future__ import annotations

import dataclasses
import re

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "f4e2m1fn": 1, "f8e8m0fnu": 1}
_COMP = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT )?%?([\w.\-]+) = (\w+)\[([\d,]*)\]\S* ([\w\-]+)\(")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_BODY = re.compile(r"body=%?([\w.\-]+)")
_OPNAME = re.compile(r'op_name="([^"]*)"')
# ops that make a new buffer out of an existing one (as an instruction or as a fusion's root)
MOVES = ("copy", "dynamic-slice", "slice", "convert", "bitcast-convert", "transpose", "concatenate", "pad")


@dataclasses.dataclass(frozen=True)
class Buffer:
    computation: str
    name: str
    op: str             # opcode; a fusion as "fusion:<root opcode>"
    nbytes: int
    shape: str
    op_name: str        # the JAX op (metadata), "" if none
    in_loop: bool       # inside a while body


def _parse(text: str):
    comps, roots, fused, bodies = {}, {}, set(), set()
    comp = None
    for line in text.splitlines():
        m = _COMP.match(line)
        if m and " = " not in line.split("{")[0]:
            comp = m.group(2)
            comps[comp] = []
            continue
        body = _BODY.search(line)
        if body and " while(" in line:
            bodies.add(body.group(1))
        m = _INSTR.match(line)
        if not m or comp is None:
            continue
        root, name, dtype, dims, op = m.groups()
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        call = _CALLS.search(line)
        if op == "fusion" and call:
            fused.add(call.group(1))
        meta = _OPNAME.search(line)
        ins = dict(name=name, op=op, nbytes=n * _BYTES.get(dtype, 4), shape=f"{dtype}[{dims}]",
                   calls=call.group(1) if call else None, op_name=meta.group(1) if meta else "",
                   operand=line[m.end():].split(")")[0])
        comps[comp].append(ins)
        if root:
            roots[comp] = ins
    return comps, roots, fused, bodies


def _root_op(comp: str, comps, roots) -> str:
    """A fused computation's root opcode, looking through bitcasts / reshapes to what they wrap."""
    ins = roots.get(comp)
    by_name = {i["name"]: i for i in comps.get(comp, [])}
    while ins is not None and ins["op"] in ("bitcast", "reshape"):
        ins = by_name.get(ins["operand"].split()[-1].lstrip("%")) if ins["operand"] else None
    return ins["op"] if ins is not None else "?"


def buffers(text: str, min_bytes: int = 1 << 20) -> list[Buffer]:
    """Every array-shaped instruction result of at least min_bytes outside fused computations."""
    comps, roots, fused, bodies = _parse(text)
    out = []
    for comp, instrs in comps.items():
        if comp in fused:
            continue
        for ins in instrs:
            if ins["nbytes"] < min_bytes or ins["op"] in ("parameter", "get-tuple-element", "bitcast", "constant"):
                continue
            op = ins["op"]
            if op == "fusion" and ins["calls"]:
                op = "fusion:" + _root_op(ins["calls"], comps, roots)
            out.append(Buffer(comp, ins["name"], op, ins["nbytes"], ins["shape"], ins["op_name"], comp in bodies))
    return out


def data_moves(text: str, min_bytes: int) -> list[Buffer]:
    """The buffers of at least min_bytes made by copying, slicing or converting (MOVES), largest first."""
    moves = [b for b in buffers(text, min_bytes) if b.op.split(":")[-1] in MOVES]
    return sorted(moves, key=lambda b: -b.nbytes)
