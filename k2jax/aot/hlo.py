"""Reading an optimized HLO module's text (`compiled.as_text()`): its computations and instructions, how
often each computation runs, the collectives with their bytes, the entry parameters' tiled layouts, and the
large floating-point buffers it materializes.

Only what the checks need is parsed: per instruction its name, result shape(s), opcode, operand names and
the computations it calls. Loops: XLA:TPU's optimized HLO carries no known_trip_count on its while loops, so
a trip count is read from the loop's condition computation (`compare(counter, constant(N))`, counter
starting from the init tuple's constant); a condition that compares two loop values (a trip count known
only at run time, e.g. the expert-parallel exchange's rounds) counts as one trip and is reported as dynamic.
A conditional's branches are each counted as taken (an upper bound).
"""

from __future__ import annotations

import dataclasses
import math
import re

# Bytes per element of the HLO primitive types (sub-byte types rounded up as XLA stores them unpacked).
ITEMSIZE = {"pred": 1, "s2": 1, "u2": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4,
            "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16}
FLOAT_TYPES = ("f16", "bf16", "f32", "f64")
# The collectives, by the kind they are reported as (async starts count as their op; dones are skipped).
COLLECTIVES = {"all-gather": "all-gather", "all-gather-start": "all-gather", "all-reduce": "all-reduce",
               "all-reduce-start": "all-reduce", "reduce-scatter": "reduce-scatter", "all-to-all": "all-to-all",
               "ragged-all-to-all": "all-to-all", "collective-permute": "collective-permute",
               "collective-permute-start": "collective-permute", "collective-broadcast": "collective-broadcast"}

_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\](?:\{([^}]*)\})?")
_CALLS = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=(%[\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def itemsize(dtype: str) -> int:
    if dtype.startswith("f8"):
        return 1
    return ITEMSIZE.get(dtype, 4)


@dataclasses.dataclass(frozen=True)
class Array:
    """One array shape: element type, dims, and its layout (minor-to-major dims, tiles) where written."""

    dtype: str
    dims: tuple[int, ...]
    minor_to_major: tuple[int, ...] | None = None
    tiles: tuple[tuple[int, ...], ...] = ()

    @property
    def elements(self) -> int:
        return math.prod(self.dims)

    @property
    def nbytes(self) -> int:
        return self.elements * itemsize(self.dtype)

    @property
    def padded_bytes(self) -> int:
        """Bytes once the first tile pads the minor dims (T(8,128): the second-minor dim to a multiple of 8,
        the minor one to 128); as nbytes without a layout or tiles."""
        if not self.tiles or not self.dims or self.minor_to_major is None:
            return self.nbytes
        dims = list(self.dims)
        tile = self.tiles[0]
        for k, t in enumerate(reversed(tile)):  # the tile's last entry covers the minor-most dim
            if k < len(self.minor_to_major):
                d = self.minor_to_major[k]
                dims[d] = -(-dims[d] // t) * t
        return math.prod(dims) * itemsize(self.dtype)

    def __str__(self):
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


def parse_array(text: str) -> Array:
    """An Array from e.g. "bf16[60,7168,32]{1,2,0:T(8,128)(2,1)}"."""
    m = _ARRAY.match(text.strip())
    if m is None:
        raise ValueError(f"not an HLO array shape: {text!r}")
    return _array(m)


def _array(m) -> Array:
    dtype, dims, layout = m.group(1), m.group(2), m.group(3)
    dims = tuple(int(d) for d in dims.split(",") if d)
    mtm, tiles = None, ()
    if layout is not None:
        order, _, rest = layout.partition(":")
        mtm = tuple(int(d) for d in order.split(",") if d.strip())
        m_t = re.search(r"T((?:\([0-9,]*\))+)", rest)  # T(8,128)(2,1): a tile, then tiles within it
        tiles = tuple(tuple(int(x) for x in t.split(",") if x) for t in re.findall(r"\(([0-9,]*)\)", m_t.group(1))) \
            if m_t else ()
    return Array(dtype, dims, mtm, tiles)


def parse_shapes(text: str) -> list[Array]:
    """Every array in a shape's text (a tuple's elements, in order)."""
    return [_array(m) for m in _ARRAY.finditer(text)]


@dataclasses.dataclass
class Instruction:
    name: str
    op: str
    shapes: list[Array]  # the result: one array, or a tuple's elements
    is_tuple: bool
    operands: list[str]
    calls: dict[str, list[str]]  # kind (calls, to_apply, body, condition, branches, ...) -> computation names
    text: str  # the whole line

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.shapes)


@dataclasses.dataclass
class Computation:
    name: str
    instructions: dict[str, Instruction]
    root: str | None
    entry: bool = False


@dataclasses.dataclass
class Module:
    computations: dict[str, Computation]
    entry: str
    header: str  # the HloModule line

    def params(self) -> list[Array]:
        """The entry computation's parameters as laid out (entry_computation_layout), in order."""
        m = re.search(r"entry_computation_layout=\{\((.*?)\)->", self.header)
        return parse_shapes(m.group(1)) if m else []


def _matching(s: str, i: int) -> int:
    """Index of the bracket closing the one at s[i]."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for j in range(i, len(s)):
        c = s[j]
        if c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return j
    raise ValueError(f"unbalanced brackets in HLO line: {s[:200]!r}")


def _instruction(line: str) -> Instruction | None:
    s = line.strip()
    if s.startswith("ROOT "):
        s = s[5:]
    if not s.startswith("%") or " = " not in s:
        return None
    name, rest = s.split(" = ", 1)
    if rest.startswith("("):
        end = _matching(rest, 0)
        shape_text, rest = rest[:end + 1], rest[end + 1:].lstrip()
        is_tuple = True
    else:
        shape_text, _, rest = rest.partition(" ")
        is_tuple = False
    op, paren, rest = rest.partition("(")
    if not paren:
        return None
    end = _matching("(" + rest, 0)
    args, attrs = rest[:end - 1], rest[end:]
    operands = re.findall(r"%[\w.\-]+", args)
    calls: dict[str, list[str]] = {}
    for kind, comp in _CALLS.findall(attrs):
        calls.setdefault(kind, []).append(comp.lstrip("%"))
    for group in _BRANCHES.findall(attrs):
        calls.setdefault("branches", []).extend(c.strip().lstrip("%") for c in group.split(",") if c.strip())
    return Instruction(name.lstrip("%"), op.strip(), parse_shapes(shape_text), is_tuple,
                       [o.lstrip("%") for o in operands], calls, line)


def parse(text: str) -> Module:
    """The computations of an HLO module's text."""
    comps: dict[str, Computation] = {}
    header, entry, current = "", None, None
    for line in text.splitlines():
        if line.startswith("HloModule"):
            header = line
        elif current is None and line.endswith("{") and (line.startswith("%") or line.startswith("ENTRY")):
            is_entry = line.startswith("ENTRY")
            name = line.split()[1 if is_entry else 0].lstrip("%")
            current = Computation(name, {}, None, is_entry)
            if is_entry:
                entry = name
        elif current is not None and line.startswith("}"):
            comps[current.name] = current
            current = None
        elif current is not None:
            inst = _instruction(line)
            if inst is not None:
                current.instructions[inst.name] = inst
                if line.strip().startswith("ROOT "):
                    current.root = inst.name
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return Module(comps, entry, header)


@dataclasses.dataclass(frozen=True)
class Loop:
    """A while loop: its computation, trip count (None: known only at run time) and body."""

    name: str
    computation: str
    trips: int | None
    body: str


def trip_count(module: Module, comp: Computation, inst: Instruction) -> int | None:
    """The trip count of while loop `inst` (in `comp`), from a known_trip_count if XLA wrote one, else from
    its condition `counter < N` (or <=, >, >=, !=) with the counter's start read from the init tuple; None
    when the condition compares two loop values."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', inst.text)
    if m:
        return int(m.group(1))
    cond = module.computations.get(inst.calls.get("condition", [""])[0])
    if cond is None or cond.root is None:
        return None
    root = cond.instructions[cond.root]
    if root.op != "compare" or len(root.operands) != 2:
        return None
    direction = re.search(r"direction=(\w+)", root.text)
    sides = [cond.instructions.get(o) for o in root.operands]
    if any(s is None for s in sides):
        return None
    consts = [_constant(s) for s in sides]
    index = [_tuple_index(s) for s in sides]
    if consts[1] is not None and index[0] is not None:
        limit, i, op = consts[1], index[0], direction.group(1) if direction else "LT"
    elif consts[0] is not None and index[1] is not None:
        flip = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}
        limit, i, op = consts[0], index[1], flip.get(direction.group(1) if direction else "GT", "NE")
    else:
        return None
    start = _init_value(comp, inst, i)
    if start is None:
        start = 0
    if op == "LT" or op == "NE":
        return max(0, limit - start)
    if op == "LE":
        return max(0, limit - start + 1)
    if op == "GT":
        return max(0, start - limit)
    if op == "GE":
        return max(0, start - limit + 1)
    return None


def _constant(inst: Instruction) -> int | None:
    if inst.op != "constant":
        return None
    m = re.search(r"constant\((-?\d+)\)", inst.text)
    return int(m.group(1)) if m else None


def _tuple_index(inst: Instruction) -> int | None:
    if inst.op != "get-tuple-element":
        return None
    m = re.search(r"index=(\d+)", inst.text)
    return int(m.group(1)) if m else None


def _init_value(comp: Computation, loop: Instruction, index: int) -> int | None:
    """The constant the loop's tuple element `index` starts from, if its init is a tuple of constants there."""
    init = comp.instructions.get(loop.operands[0]) if loop.operands else None
    if init is None or init.op != "tuple" or index >= len(init.operands):
        return None
    elem = comp.instructions.get(init.operands[index])
    return None if elem is None else _constant(elem)


def executions(module: Module) -> tuple[dict[str, int], list[Loop]]:
    """How many times each computation runs per run of the module (loop bodies: x their trip counts; a loop
    of unknown trip count: x 1), and the while loops found. Reducers (to_apply) are not counted."""
    runs: dict[str, int] = {}
    loops: list[Loop] = []

    def visit(name: str, times: int):
        comp = module.computations.get(name)
        if comp is None:
            return
        runs[name] = runs.get(name, 0) + times
        for inst in comp.instructions.values():
            if inst.op == "while":
                trips = trip_count(module, comp, inst)
                body = inst.calls.get("body", [""])[0]
                loops.append(Loop(inst.name, name, trips, body))
                visit(body, times * (1 if trips is None else trips))
                continue
            for kind, targets in inst.calls.items():
                if kind in ("to_apply", "condition"):
                    continue
                for t in targets:
                    visit(t, times)

    visit(module.entry, 1)
    return runs, loops


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction: kind, bytes of its result per chip per run (for a reduce-scatter, of its
    input), how often it runs per module run, where, and its replica groups as written."""

    kind: str
    name: str
    computation: str
    nbytes: int
    runs: int
    shapes: str
    groups: str

    @property
    def total_bytes(self) -> int:
        return self.nbytes * self.runs


def collectives(module: Module) -> list[Collective]:
    """Every collective the module runs, with how often (see `executions`)."""
    runs, _ = executions(module)
    out = []
    for cname, times in runs.items():
        comp = module.computations[cname]
        for inst in comp.instructions.values():
            kind = COLLECTIVES.get(inst.op)
            if kind is None:
                continue
            shapes = inst.shapes
            if inst.op in ("all-gather-start", "collective-permute-start") and inst.is_tuple:
                # (operands..., results..., [contexts]): the results, which have the operands' count
                n = len(inst.operands)
                shapes = shapes[n:2 * n]
            nbytes = sum(a.nbytes for a in shapes)
            if kind == "reduce-scatter":
                nbytes = sum(comp.instructions[o].nbytes for o in inst.operands if o in comp.instructions) or nbytes
            groups = re.search(r"replica_groups=(.*?)(?:, [a-z_]+=|$)", inst.text)
            out.append(Collective(kind, inst.name, cname, nbytes, times, ", ".join(map(str, shapes)),
                                  groups.group(1) if groups else ""))
    return out


def collective_summary(module: Module) -> dict[str, dict[str, int]]:
    """{kind: {"ops": instructions, "runs": executions per module run, "bytes": total bytes per chip}}."""
    out: dict[str, dict[str, int]] = {}
    for c in collectives(module):
        s = out.setdefault(c.kind, {"ops": 0, "runs": 0, "bytes": 0})
        s["ops"] += 1
        s["runs"] += c.runs
        s["bytes"] += c.total_bytes
    return dict(sorted(out.items()))


def fused_computations(module: Module) -> set[str]:
    """Computations that are the bodies of fusions (and what they call): their values live in registers or
    on-chip memory, not as buffers of their own."""
    fused: set[str] = set()

    def mark(name):
        if name in fused or name not in module.computations:
            return
        fused.add(name)
        for inst in module.computations[name].instructions.values():
            for targets in inst.calls.values():
                for t in targets:
                    mark(t)

    for comp in module.computations.values():
        for inst in comp.instructions.values():
            if inst.op == "fusion":
                for t in inst.calls.get("calls", []):
                    mark(t)
    return fused


# Ops whose result is no new buffer (a view, an alias, or bookkeeping).
_NO_BUFFER = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id",
              "replica-id", "while", "conditional", "call", "opt-barrier", "copy-done", "all-gather-done",
              "all-reduce-done", "collective-permute-done", "async-done", "async-update", "send-done",
              "recv-done"}


def large_float_buffers(module: Module, min_elements: int, exclude=()) -> list[tuple[str, str, Array]]:
    """(computation, instruction, array) of every floating-point buffer of more than `min_elements`
    elements that the module materializes outside fusions, excluding arrays whose (dtype, dims) are in
    `exclude` (e.g. the entry parameters': a cache updated in place)."""
    fused = fused_computations(module)
    skip = {(a.dtype, a.dims) for a in exclude}
    out = []
    for cname, comp in module.computations.items():
        if cname in fused:
            continue
        for inst in comp.instructions.values():
            if inst.op in _NO_BUFFER:
                continue
            for a in inst.shapes:
                if a.dtype in FLOAT_TYPES and a.elements > min_elements and (a.dtype, a.dims) not in skip:
                    out.append((cname, inst.name, a))
    return out


# Ops through which a value stays "the same data": moved, viewed, converted, sliced, or combined elementwise
# with other such values or constants (a dequantization: convert(values) * broadcast(scales)).
_CARRY = {"bitcast", "copy", "convert", "reshape", "transpose", "broadcast", "slice", "concatenate", "pad",
          "reverse", "bitcast-convert", "multiply", "add", "subtract", "divide", "negate", "and", "or", "xor",
          "not", "shift-right-logical", "shift-left", "shift-right-arithmetic", "select", "clamp", "maximum",
          "minimum", "copy-start", "copy-done", "optimization-barrier", "opt-barrier",
          # moved between chips, it is still the weight's data
          "all-gather", "all-gather-start", "all-gather-done", "all-reduce", "all-reduce-start", "all-reduce-done",
          "all-to-all", "collective-permute", "collective-permute-start", "collective-permute-done",
          "reduce-scatter"}
# Ops whose data is some of their operands, the rest being indices or masks.
_DATA_OPERANDS = {"dynamic-slice": (0,), "gather": (0,), "dynamic-update-slice": (0, 1), "scatter": (0, 2),
                  "select": (1, 2)}
_CONST = {"constant", "iota"}


class Provenance:
    """Which values of a module are one of a set of entry parameters themselves, moved or transformed
    elementwise (sliced, converted, dequantized, gathered by index): "weight data", as opposed to values
    computed from them with other data (a matmul's result, an embedding row's all-reduce is not: it mixes
    in nothing but is a lookup, so exclude such params from the set).

    Follows fusions into their fused computations, loop-carried values to the loop's init, tuples and
    async wrappers. `of(computation, instruction)` -> the entry parameter numbers the value is data of
    (empty: not weight data)."""

    def __init__(self, module: Module, params: set[int]):
        self.module, self.params = module, set(params)
        self._memo: dict[tuple[str, str, int | None], frozenset] = {}
        self._callers: dict[str, list[tuple[str, Instruction]]] = {}
        for cname, comp in module.computations.items():
            for inst in comp.instructions.values():
                for targets in inst.calls.values():
                    for t in targets:
                        self._callers.setdefault(t, []).append((cname, inst))

    def of(self, comp: str, name: str, index: int | None = None) -> frozenset:
        key = (comp, name, index)
        if key in self._memo:
            return self._memo[key]
        self._memo[key] = frozenset()  # cycles (loop carries) resolve to what their other paths give
        out = self._compute(comp, name, index)
        self._memo[key] = out
        return out

    def _compute(self, comp: str, name: str, index: int | None) -> frozenset:
        c = self.module.computations[comp]
        inst = c.instructions.get(name)
        if inst is None:
            return frozenset()
        op = inst.op
        if op == "parameter":
            num = int(re.search(r"parameter\((\d+)\)", inst.text).group(1))
            if comp == self.module.entry:
                return frozenset({num}) if num in self.params else frozenset()
            return self._from_callers(comp, num, index)
        if op == "get-tuple-element":
            i = _tuple_index(inst)
            return self.of(comp, inst.operands[0], i)
        if op == "tuple":
            if index is None:
                return frozenset()
            return self.of(comp, inst.operands[index]) if index < len(inst.operands) else frozenset()
        if op == "while":
            body = self.module.computations.get(inst.calls.get("body", [""])[0])
            init = self.of(comp, inst.operands[0], index) if inst.operands else frozenset()
            if body is None or body.root is None:
                return init
            return init | self.of(body.name, body.root, index)
        if op in ("fusion", "call", "async-start", "async-done"):
            target = inst.calls.get("calls", inst.calls.get("to_apply", [None]))[0]
            if op == "async-done":
                return self.of(comp, inst.operands[0], index) if inst.operands else frozenset()
            sub = self.module.computations.get(target) if target else None
            if sub is None or sub.root is None:
                return frozenset()
            return self.of(sub.name, sub.root, index)
        if op in _CONST:
            return frozenset()
        if op in _CARRY or op in _DATA_OPERANDS:
            found: set[int] = set()
            data = [inst.operands[i] for i in _DATA_OPERANDS.get(op, range(len(inst.operands)))
                    if i < len(inst.operands)]
            for o in data:
                src = self.of(comp, o, index if op in ("copy-start", "opt-barrier", "optimization-barrier") else None)
                if src:
                    found |= src
                elif not self._constant(comp, o):
                    return frozenset()  # mixed with other data: a computed value
            return frozenset(found)
        return frozenset()

    def _constant(self, comp: str, name: str) -> bool:
        inst = self.module.computations[comp].instructions.get(name)
        if inst is None:
            return False
        if inst.op in _CONST:
            return True
        if inst.op in ("broadcast", "convert", "bitcast", "reshape", "copy") and inst.operands:
            return self._constant(comp, inst.operands[0])
        if inst.op == "fusion":
            sub = self.module.computations.get(inst.calls.get("calls", [""])[0])
            return sub is not None and all(i.op in _CONST | {"broadcast", "convert", "bitcast", "reshape",
                                                             "parameter"} for i in sub.instructions.values()) and \
                all(self._constant(comp, o) for o in inst.operands)
        return False

    def _from_callers(self, comp: str, num: int, index: int | None) -> frozenset:
        """A non-entry computation's parameter `num`: what its callers pass (a loop body's and condition's
        param 0: the loop's init and its carried values; a fusion's / call's param i: operand i)."""
        found: set[int] = set()
        for caller, inst in self._callers.get(comp, []):
            if inst.op == "while":
                if inst.operands:
                    found |= self.of(caller, inst.operands[0], index)
                body = self.module.computations.get(inst.calls.get("body", [""])[0])
                if body is not None and body.root is not None and index is not None:
                    found |= self.of(body.name, body.root, index)
            elif inst.op == "conditional":  # branch k's (only) parameter is operand k + 1
                branches = (inst.calls.get("branches") or
                            inst.calls.get("true_computation", []) + inst.calls.get("false_computation", []))
                k = branches.index(comp) if comp in branches else None
                if k is not None and k + 1 < len(inst.operands):
                    found |= self.of(caller, inst.operands[k + 1], index)
            elif num < len(inst.operands):
                found |= self.of(caller, inst.operands[num], index)
        return frozenset(found)


def entry_parameter_numbers(module: Module) -> dict[str, int]:
    """Entry computation instruction name -> parameter number."""
    comp = module.computations[module.entry]
    return {i.name: int(re.search(r"parameter\((\d+)\)", i.text).group(1))
            for i in comp.instructions.values() if i.op == "parameter"}


# Ops that move no bytes of their own: views, bookkeeping, and the calls whose bodies are counted instead.
_NO_TRAFFIC = _NO_BUFFER | {"iota", "slice-done"}  # slice-done: its slice-start counts the slice
# Async starts whose result tuple holds their operand beside what they write (XLA's own cost analysis counts
# the operand and the tuple's index table, and the -done the destination: the same read and write).
_ASYNC_COPIES = {"copy-start", "collective-permute-start", "all-gather-start"}
# In a fusion, an operand read only through these reads just their results (the slice, the rows gathered).
_SLICING = ("dynamic-slice", "slice", "gather")


@dataclasses.dataclass(frozen=True)
class Traffic:
    """What a module moves through memory and computes per run, per chip, loop bodies times their trip
    counts (see `traffic`): bytes read and written by the ops, the dot flops, and the largest movers
    (computation/instruction, op, bytes per run, runs)."""

    bytes: int
    flops: int
    top: tuple = ()


def _fusion_operand_bytes(module: Module, inst: Instruction, comp: Computation) -> tuple[int, int]:
    """(bytes read, bytes written) by one fusion: an operand only sliced or gathered inside counts what is
    read of it; an operand updated in place (the fused root a dynamic-update-slice of it) counts nothing, and
    the output then counts only the update written."""
    body = module.computations.get((inst.calls.get("calls") or [""])[0])
    sizes = [sum(a.nbytes for a in comp.instructions[o].shapes) if o in comp.instructions else 0
             for o in inst.operands]
    written = inst.nbytes
    if body is None:
        return sum(sizes), written
    params, users = _params_and_users(body)
    roots = [body.instructions[body.root]] if body.root in body.instructions else []
    if roots and roots[0].op == "tuple":
        roots = [body.instructions[o] for o in roots[0].operands if o in body.instructions]
    in_place = {}
    for r in roots:
        if r.op == "dynamic-update-slice" and r.operands and r.operands[0] in params:
            upd = body.instructions.get(r.operands[1])
            in_place[params[r.operands[0]]] = (r.nbytes, upd.nbytes if upd else r.nbytes)
    read = 0
    for name, k in params.items():
        if k >= len(sizes):
            continue
        if k in in_place:
            whole, upd = in_place[k]
            written -= whole - upd
            continue
        sliced = _sliced_elements(name, users, module=module)
        per = sizes[k] / max(sum(a.elements for a in comp.instructions[inst.operands[k]].shapes), 1) \
            if inst.operands[k] in comp.instructions else 0
        read += sizes[k] if sliced is None else min(sizes[k], int(sliced * per))
    return read, max(written, 0)


def _params_and_users(body: Computation) -> tuple[dict[str, int], dict[str, list[Instruction]]]:
    """A computation's parameters ({name: index}) and each value's users."""
    params = {}
    for i in body.instructions.values():
        if i.op == "parameter":
            m = re.search(r"parameter\((\d+)\)", i.text)
            if m:
                params[i.name] = int(m.group(1))
    users: dict[str, list[Instruction]] = {}
    for i in body.instructions.values():
        for o in i.operands:
            users.setdefault(o, []).append(i)
    return params, users


# Ops a value passes through element for element (a layout change, a conversion, a nested loop fusion of it
# alone) on its way to a slice: only the elements sliced are read.
_PASS = ("bitcast", "copy", "convert", "reshape", "transpose", "fusion")


def _sliced_elements(name: str, users: dict, depth: int = 0, module: Module | None = None) -> int | None:
    """Elements of value `name` that a fused computation reads, when every use of it ends, through
    element-for-element ops, in a slice, dynamic slice or gather of it; None when some use reads it whole.
    A nested fusion that takes it with other operands (a dynamic slice by a layer index: the scanned
    weights' slice fused into a dot) is followed into its computation (given the module)."""
    us = users.get(name, [])
    if not us or depth > 4:
        return None
    total = 0
    for u in us:
        if u.op in _SLICING and u.operands[0] == name:
            total += sum(a.elements for a in u.shapes)
        elif u.op in _PASS and len(u.operands) == 1:
            n = _sliced_elements(u.name, users, depth + 1, module)
            if n is None:
                return None
            total += n
        elif u.op == "fusion" and module is not None and u.operands.count(name) == 1:
            body = module.computations.get((u.calls.get("calls") or [""])[0])
            if body is None:
                return None
            params, inner = _params_and_users(body)
            k = u.operands.index(name)
            param = next((p for p, i in params.items() if i == k), None)
            n = None if param is None else _sliced_elements(param, inner, depth + 1, module)
            if n is None:
                return None
            total += n
        else:
            return None
    return total


def _dot_flops(inst: Instruction, comp: Computation) -> int:
    """2 x output elements x contracted elements of a dot, a ragged-dot or a convolution (XLA:TPU writes its
    dots as convolutions: dim_labels=bf_oi->bf, the kernel's "i" dims contracted). A convolution's spatial
    dims count as batch dims: XLA:TPU writes batched matmuls as windowed convolutions (size=64 stride=63
    lhs_dilate=64: the window meets one non-zero), and the model has no true spatial convolution; 0 for
    other ops."""
    if inst.op == "convolution" and len(inst.operands) > 1:
        m = re.search(r"dim_labels=[^_]*_([^-]*)->", inst.text)
        kernel = comp.instructions.get(inst.operands[1])
        if m is None or kernel is None or not kernel.shapes:
            return 0
        contracted = math.prod(d for d, lab in zip(kernel.shapes[0].dims, m.group(1)) if lab == "i")
        return 2 * sum(a.elements for a in inst.shapes) * contracted
    if inst.op not in ("dot", "ragged-dot") or not inst.operands:
        return 0
    lhs = comp.instructions.get(inst.operands[0])
    m = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", inst.text)
    if lhs is None or not lhs.shapes or m is None:
        return 0
    dims = lhs.shapes[0].dims
    contracted = math.prod(dims[int(d)] for d in m.group(1).split(",") if d)
    return 2 * sum(a.elements for a in inst.shapes) * contracted


def _custom_flops(inst: Instruction) -> int:
    """A Pallas kernel's own flops estimate, where its custom call carries one (cost_estimate)."""
    m = re.search(r'\\?"flops\\?"\s*:\s*\\?"?(\d+)', inst.text)
    return int(m.group(1)) if m else 0


def _custom_bytes(inst: Instruction) -> int | None:
    """A Pallas kernel's own estimate of the bytes it reads and writes, where its custom call carries one
    (cost_estimate), else None. Its operands can be far larger than what it reads: its block specs' index
    maps visit only some blocks (a layer's tiles of a stack of every layer, a row's pages of the pool)."""
    m = re.search(r'\\?"bytes_accessed\\?"\s*:\s*\\?"?(\d+)', inst.text)
    return int(m.group(1)) if m else None


def _offload_bytes(inst: Instruction, comp: Computation) -> int:
    """Bytes an async call moves each way, counted at its call-update (shape ((operands...), result)); its
    call-done, bookkeeping, moves nothing. XLA:TPU runs gathers and scatters on the SparseCore this way
    (`gather_offload_async_start.N.update`, `scatter_offload_...`): a gather reads and writes its result's
    rows, a scatter its updates (in place), not the whole table (the KV pool, the embeddings) its operands
    list. Another async call: its operands read and its result written (read + written returned halved)."""
    if inst.op == "call-done":
        src = comp.instructions.get(inst.operands[0]) if inst.operands else None
        return 0 if src is not None and src.op == "call-update" else inst.nbytes
    if not inst.shapes:
        return 0
    if "gather_offload" in inst.name:
        return inst.shapes[-1].nbytes
    if "scatter_offload" in inst.name and len(inst.shapes) >= 2:
        return inst.shapes[-2].nbytes  # the updates (operands: table, indices, updates)
    return (sum(a.nbytes for a in inst.shapes[:-1]) + inst.shapes[-1].nbytes) // 2


def traffic(module: Module, top: int = 10) -> Traffic:
    """Bytes moved and flops of one run of the module, per chip, each computation's ops counted as often as
    it runs (`executions`: a loop body times its trip count, a conditional's branches each as taken).

    Bytes: each op outside fusions reads its operands and writes its result, as XLA's cost analysis counts
    them per operand, except that an operand a fusion only slices or gathers counts the part read, and a
    buffer updated in place (dynamic-update-slice) counts only the update written, an async copy (copy-start,
    collective-permute-start) its operand read and its destination written, not the operand again that its
    result tuple lists; views and bookkeeping
    (bitcast, tuple, get-tuple-element, parameters, constants) move nothing. Flops: every dot and ragged-dot,
    in fusions too, 2 x output x contracted elements (a ragged-dot as if every row met every group: it
    computes one group per row, so this is exact), and a Pallas kernel's own estimate where it gives one.
    A Pallas kernel's bytes are its own estimate too, where it gives one (see _custom_bytes); a SparseCore
    gather or scatter, the rows it moves (see _offload_bytes)."""
    runs, _ = executions(module)
    fused = fused_computations(module)
    total, flops, movers = 0, 0, []
    for cname, times in runs.items():
        comp = module.computations[cname]
        for inst in comp.instructions.values():
            flops += (_dot_flops(inst, comp) or (_custom_flops(inst) if inst.op == "custom-call" else 0)) * times
            if cname in fused or inst.op in _NO_TRAFFIC:
                continue
            if inst.op == "fusion":
                read, written = _fusion_operand_bytes(module, inst, comp)
            elif inst.op in ("dynamic-slice", "slice", "gather"):
                read, written = inst.nbytes, inst.nbytes
            elif inst.op == "slice-start" and len(inst.shapes) >= 2:  # async: (operand, slice, context)
                read = written = inst.shapes[-2].nbytes
            elif inst.op in ("call-update", "call-done"):
                read = written = _offload_bytes(inst, comp)
            elif inst.op == "custom-call" and _custom_bytes(inst) is not None:
                read, written = _custom_bytes(inst), 0
            elif inst.op in _ASYNC_COPIES:
                # (destination, source, context...) or (source, destination, context...): one element is
                # the operand itself, so the copy reads its operand and writes the destination once
                read = sum(comp.instructions[o].nbytes for o in inst.operands if o in comp.instructions)
                written = max(inst.nbytes - read, 0)
            elif inst.op == "dynamic-update-slice" and len(inst.operands) > 1:
                upd = comp.instructions.get(inst.operands[1])
                read = written = upd.nbytes if upd else inst.nbytes
            else:
                read = sum(comp.instructions[o].nbytes for o in inst.operands if o in comp.instructions)
                written = inst.nbytes
            total += (read + written) * times
            movers.append((f"{cname}/{inst.name}", inst.op, read + written, times))
    movers.sort(key=lambda m: -m[2] * m[3])
    return Traffic(total, flops, tuple(movers[:top]))
