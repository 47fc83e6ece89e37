"""Collectives and memory, read from a compiled executable.

`collectives` parses ``compiled.as_text()`` (the optimized, partitioned HLO: the per-device
program after XLA's passes, so what actually runs, including any all-reduce combining).
Each collective's result shape lists its operands (a combined all-reduce has a tuple of them),
and every operand is classified:

* ``gradient`` — its dimensions are those of a parameter's per-device shard (in any order:
  GSPMD may reduce a transposed gradient), or it is one flat buffer holding every parameter
  of its dtype (`xshard.mesh.collectives.psum_tree` packs the gradient so on CPU), counted as the
  parameters it carries;
* ``scalar`` — at most `SCALAR_MAX_ELEMENTS` elements that match no parameter: the loss,
  per-shard norm statistics, non-finite counts;
* ``other`` — anything else (activations, for instance, under model parallelism).

`memory` reads ``compiled.memory_analysis()`` (bytes per device) and `state_bytes` computes
the bytes per device of a pytree of arrays from their shardings.
"""

from __future__ import annotations

import collections
import math
import re
from typing import Any

import jax
import numpy as np

#: Operands this small that match no parameter shape are counted as scalar statistics.
SCALAR_MAX_ELEMENTS = 16

COLLECTIVE_OPS = (
    "all-reduce",
    "all-reduce-start",
    "reduce-scatter",
    "all-gather",
    "all-gather-start",
    "all-to-all",
    "collective-permute",
    "collective-permute-start",
    "collective-broadcast",
)

_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+"
    r"(?P<op>" + "|".join(re.escape(op) for op in COLLECTIVE_OPS) + r")\("
)
_ARRAY_SHAPE = re.compile(r"\b(?P<dtype>pred|[subf]\d+|bf16|f8\w*|c64|c128)\[(?P<dims>[\d,]*)\]")
_TO_APPLY = re.compile(r"to_apply=%?([\w.\-]+)")
_REDUCERS = ("add", "maximum", "minimum", "multiply", "and", "or")
_DTYPE_BYTES = {"pred": 1, "bf16": 2, "c64": 8, "c128": 16}


_STABLEHLO_DOT = re.compile(
    r"stablehlo\.dot_general .*: \(tensor<(?:[^>]*x)?(\w+)>, tensor<(?:[^>]*x)?(\w+)>\)"
)
_ALGORITHM = re.compile(r"lhs_precision_type = (\w+), rhs_precision_type = (\w+)")
_HLO_DEFINITION = re.compile(r"%?([\w.\-]+) = (\w+)\[")
_HLO_DOT = re.compile(r" dot\(%?([\w.\-]+), %?([\w.\-]+)\)")


def dot_operand_dtypes(text: str) -> set[str]:
    """The operand dtypes of the dots of a StableHLO (``dot_general``) or HLO (``dot(``) text.

    Operands, not results: a dot may accumulate bfloat16 operands into a float32 result and
    still compute in bfloat16; where a dot names its algorithm, its operands' precision types
    (``jax.nn.dot_product_attention`` in bfloat16: BF16_BF16_F32, whose gradient dots round a
    float32 cotangent to bfloat16).
    """
    operands = set()
    for line in text.splitlines():
        if found := _ALGORITHM.search(line) or _STABLEHLO_DOT.search(line):
            operands |= set(found.groups())
    dtypes = dict(_HLO_DEFINITION.findall(text))
    operands |= {dtypes[name] for pair in _HLO_DOT.findall(text) for name in pair}
    return operands


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of an HLO element type (``f32``, ``bf16``, ``s8``, ``f8e4m3fn``...)."""
    if dtype in _DTYPE_BYTES:
        return _DTYPE_BYTES[dtype]
    bits = re.match(r"[a-z]+(\d+)", dtype)  # f8e4m3fn: 8 bits, not "843"
    return max(1, int(bits.group(1)) // 8) if bits else 4


def operand_shapes(shape_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """The (element type, dims) of every array in an instruction's result shape text."""
    text = re.sub(r"/\*.*?\*/", "", shape_text)  # drop /*index=5*/ comments
    return [
        (m["dtype"], tuple(int(d) for d in m["dims"].split(",") if d))
        for m in _ARRAY_SHAPE.finditer(text)
    ]


def _reducer(hlo: str, computation: str) -> str | None:
    """The reduction op ('add', 'maximum', ...) of the computation named `computation`."""
    m = re.search(
        r"^%?" + re.escape(computation) + r"\s.*?\{(?P<body>.*?)^\}", hlo, re.MULTILINE | re.DOTALL
    )
    if m is None:
        return None
    for op in _REDUCERS:
        if re.search(r"\s" + op + r"\(", m["body"]):
            return op
    return None


def _shard_dims(params: Any) -> set[tuple[int, ...]]:
    """Sorted per-device shard dims of every parameter leaf (rank >= 1)."""
    dims = set()
    for x in jax.tree.leaves(params):
        shape = tuple(x.sharding.shard_shape(x.shape)) if hasattr(x, "sharding") else x.shape
        if len(shape) and math.prod(shape) > 1:
            dims.add(tuple(sorted(shape)))
    return dims


def _per_device_param_dims(params: Any, pmapped: bool) -> set[tuple[int, ...]]:
    if not pmapped:
        return _shard_dims(params)
    # pmap arrays carry the device axis first; the per-device shard drops it.
    return {tuple(sorted(np.shape(x)[1:])) for x in jax.tree.leaves(params) if np.ndim(x) > 1}


_HLO_DTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64"}


def _packed_sizes(params: Any, pmapped: bool) -> dict[str, tuple[int, int]]:
    """HLO dtype -> (elements, leaves) of the per-device parameter shards of that dtype: the
    size of a flat buffer that packs all of them (`xshard.mesh.collectives.psum_tree`)."""
    sizes: dict[str, tuple[int, int]] = {}
    for x in jax.tree.leaves(params):
        if pmapped:
            shape = np.shape(x)[1:]
        elif hasattr(x, "sharding"):
            shape = tuple(x.sharding.shard_shape(x.shape))
        else:
            shape = np.shape(x)
        dtype = _HLO_DTYPES.get(np.dtype(x.dtype).name, np.dtype(x.dtype).name)
        n, k = sizes.get(dtype, (0, 0))
        sizes[dtype] = (n + math.prod(shape), k + 1)
    return {d: nk for d, nk in sizes.items() if nk[1] > 1}


def collectives(compiled: jax.stages.Compiled, params: Any, *, pmapped: bool = False) -> dict:
    """Counts the collectives of `compiled` and classifies their operands.

    Args:
      compiled: a compiled step.
      params: the step's params (arrays with shardings), to recognise gradient operands.
      pmapped: whether the params are pmap-stacked (leading device axis).

    Returns:
      ``ops``: a list of ``{op, reducer, operands, gradient_operands, scalar_operands,
      other_operands, bytes, dtypes}``, one per collective instruction; ``totals``: op counts
      per kind, gradient operand/op counts per dtype, scalar collectives; ``num_param_leaves``.
    """
    hlo = compiled.as_text()
    param_dims = _per_device_param_dims(params, pmapped)
    packed = _packed_sizes(params, pmapped)
    ops = []
    for line in hlo.splitlines():
        m = _INSTRUCTION.match(line)
        if m is None:
            continue
        shapes = operand_shapes(m["shape"])
        if m["op"].endswith("-start") and len(shapes) > 1:
            # async starts return (operands..., results...): keep the results half
            shapes = shapes[len(shapes) // 2 :]
        kinds = collections.Counter()
        nbytes = 0
        dtypes = collections.Counter()
        for dtype, dims in shapes:
            n = math.prod(dims)
            nbytes += n * dtype_bytes(dtype)
            dtypes[dtype] += 1
            if len(dims) and n > 1 and tuple(sorted(dims)) in param_dims:
                kinds["gradient"] += 1
            elif len(dims) == 1 and packed.get(dtype, (0, 0))[0] == n:
                kinds["gradient"] += packed[dtype][1]
            elif n <= SCALAR_MAX_ELEMENTS:
                kinds["scalar"] += 1
            else:
                kinds["other"] += 1
        to_apply = _TO_APPLY.search(line)
        ops.append(
            {
                "op": m["op"].removesuffix("-start"),
                "reducer": _reducer(hlo, to_apply.group(1)) if to_apply else None,
                "operands": len(shapes),
                "gradient_operands": kinds["gradient"],
                "scalar_operands": kinds["scalar"],
                "other_operands": kinds["other"],
                "bytes": nbytes,
                "dtypes": dict(dtypes),
            }
        )
    return {"ops": ops, "totals": _totals(ops), "num_param_leaves": len(jax.tree.leaves(params))}


def _totals(ops: list[dict]) -> dict[str, Any]:
    by_kind = collections.Counter(op["op"] for op in ops)
    grad_ops = [op for op in ops if op["gradient_operands"]]
    grad_dtypes = collections.Counter()
    for op in grad_ops:
        for dtype in op["dtypes"]:
            grad_dtypes[dtype] += 1
    scalar_only = [op for op in ops if op["operands"] == op["scalar_operands"]]
    return {
        "collective_ops": len(ops),
        "by_kind": dict(by_kind),
        "ops_with_gradients": len(grad_ops),
        "gradient_operands": sum(op["gradient_operands"] for op in ops),
        "gradient_ops_per_dtype": dict(grad_dtypes),
        "gradient_bytes": sum(op["bytes"] for op in grad_ops),
        "scalar_operands": sum(op["scalar_operands"] for op in ops),
        "scalar_only_ops": len(scalar_only),
        "scalar_operands_fused_into_gradient_ops": sum(op["scalar_operands"] for op in grad_ops),
    }


#: Entry instructions that are bookkeeping, not work: everything else is a kernel (a thunk of
#: the CPU runtime, a launch on a GPU).
_NOT_KERNELS = ("parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all")
_ENTRY_OP = re.compile(r"=\s*(?:\([^=]*?\)|\S+)\s+(?P<op>[a-z][a-z0-9\-]*)\(")
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")

#: Where a kernel comes from, judged from its innermost source frame that matches a rule.
#: Rules are (category, test on (file, function)), tried in order on each frame.
_STATS_FUNCTIONS = {
    "_optimizer_metrics",
    "_shard_metrics",
    "shard_norm_stats",
    "noise_scale",
    "tree_norm",
    "layer_norms",
    "histogram",
}
_ORIGIN_RULES: tuple[tuple[str, Any], ...] = (
    ("trainer statistics", lambda f, fn: fn.split(".")[0] in _STATS_FUNCTIONS),
    ("gradient summary", lambda f, fn: fn == "summarize"),
    ("non-finite guard", lambda f, fn: fn.startswith("tree_where")),
    ("gradient reduction", lambda f, fn: fn in ("_all_reduce", "reduce_gradients")),
    (
        "learning-rate injection",
        lambda f, fn: "_inject_learning_rate" in fn or f.endswith("optax/schedules/_inject.py"),
    ),
    ("optimizer", lambda f, fn: "/optax/" in f),
    ("model", lambda f, fn: "/trainers/tasks/" in f or fn in ("loss_and_grads", "_loss_and_grad")),
)


def _entry_body(hlo: str) -> str:
    entry = re.search(r"^ENTRY .*?\{(?P<body>.*?)^\}", hlo, re.MULTILINE | re.DOTALL)
    return entry["body"] if entry else hlo


def _table(hlo: str, title: str) -> str:
    m = re.search(r"^" + title + r"\n(?P<rows>(?:\d+ .*\n)+)", hlo, re.MULTILINE)
    return m["rows"] if m else ""


def _source_stacks(hlo: str):
    """Maps a ``stack_frame_id`` to its frames, innermost first, as (file, function) pairs.

    Uses the FileNames / FunctionNames / FileLocations / StackFrames tables JAX puts at the
    top of the HLO text. A frame's printed ``parent_frame_id`` is the parent's id plus one
    (0 would mean none, so 1 means a root frame).
    """
    files = dict(re.findall(r'^(\d+) "(.*)"$', _table(hlo, "FileNames"), re.MULTILINE))
    funcs = dict(re.findall(r'^(\d+) "(.*)"$', _table(hlo, "FunctionNames"), re.MULTILINE))
    locs = {
        n: (files.get(f, "?"), funcs.get(fn, "?"))
        for n, f, fn in re.findall(
            r"^(\d+) \{file_name_id=(\d+) function_name_id=(\d+)",
            _table(hlo, "FileLocations"),
            re.MULTILINE,
        )
    }
    frames = {
        int(n): (loc, int(parent) - 1)
        for n, loc, parent in re.findall(
            r"^(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)\}",
            _table(hlo, "StackFrames"),
            re.MULTILINE,
        )
    }

    def stack(frame: int) -> list[tuple[str, str]]:
        out, seen = [], set()
        while frame in frames and frame not in seen:
            seen.add(frame)
            loc, frame = frames[frame]
            out.append(locs.get(loc, ("?", "?")))
        return out

    return stack


def _origin(stack: list[tuple[str, str]]) -> str:
    for file, function in stack:
        for category, test in _ORIGIN_RULES:
            if test(file, function):
                return category
    return "step plumbing" if stack else "no source"


def program_breakdown(compiled: jax.stages.Compiled) -> dict[str, Any]:
    """The kernels of the compiled step's entry computation, by kind and by origin.

    A kernel is an entry instruction other than parameters, constants and tuple plumbing:
    a fusion, an unfused op (dot, copy, ...), a collective. On XLA:CPU each is a thunk run per
    device, on a GPU a launch, so for small models their count, not their FLOPs, sets the
    step time. Origins come from the source stack JAX records on every instruction (a
    fusion's is its root instruction's); ``copy`` instructions are listed on their own, they
    are what XLA inserts to keep a donated buffer alive while it is still read.

    Returns:
      ``kernels`` (total), ``by_op`` (fusion, copy, dot, all-reduce, ...) and ``by_origin``
      (model, optimizer, gradient reduction, non-finite guard, trainer statistics, ...).
    """
    hlo = compiled.as_text()
    stack = _source_stacks(hlo)
    frames: dict[str, int] = {}  # instruction -> its stack frame, or its inputs' (see below)
    by_op: collections.Counter = collections.Counter()
    by_origin: collections.Counter = collections.Counter()
    for line in _entry_body(hlo).splitlines():
        line = re.sub(r"/\*.*?\*/", "", line)
        m = _ENTRY_OP.search(line)
        name = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=", line)
        if m is None or name is None:
            continue
        frame = _FRAME_ID.search(line)
        if frame is not None:
            frames[name.group(1)] = int(frame.group(1))
        else:  # XLA-made (e.g. a reduction rewritten as reduce-windows): inherit an input's
            operands = re.findall(r"%([\w.\-]+)", line[m.end() :].split("),")[0])
            inherited = next((frames[o] for o in operands if o in frames), None)
            if inherited is not None:
                frames[name.group(1)] = inherited
        if m["op"] in _NOT_KERNELS:
            continue
        by_op[m["op"]] += 1
        if m["op"] == "copy":
            by_origin["copies"] += 1
            continue
        found = frames.get(name.group(1))
        by_origin[_origin(stack(found)) if found is not None else "no source"] += 1
    return {
        "kernels": sum(by_op.values()),
        "by_op": dict(by_op.most_common()),
        "by_origin": dict(by_origin.most_common()),
    }


# --------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------

_MEMORY_FIELDS = (
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
    "temp_size_in_bytes",
    "generated_code_size_in_bytes",
)


def memory(compiled: jax.stages.Compiled) -> dict[str, int] | None:
    """``compiled.memory_analysis()`` as a dict of bytes per device (None if unsupported)."""
    try:
        stats = compiled.memory_analysis()
    except (NotImplementedError, RuntimeError, AttributeError):
        return None
    if stats is None:
        return None
    if isinstance(stats, (list, tuple)):  # one entry per device on some backends
        stats = stats[0]
    return {f: int(getattr(stats, f)) for f in _MEMORY_FIELDS if hasattr(stats, f)}


def state_bytes(tree: Any, *, pmapped: bool = False) -> dict[str, int]:
    """Bytes of `tree`'s arrays: per device (from each array's sharding) and in total.

    A replicated array counts fully on every device; a sharded one counts its shard. For
    pmap-stacked arrays the per-device share is one slice of the leading axis.
    """
    per_device = total = 0
    for x in jax.tree.leaves(tree):
        itemsize = np.dtype(x.dtype).itemsize
        if pmapped:
            shard = np.shape(x)[1:]
            logical = shard
        else:
            shard = x.sharding.shard_shape(x.shape)
            logical = x.shape
        per_device += math.prod(shard) * itemsize
        total += math.prod(logical) * itemsize
    return {"per_device_bytes": int(per_device), "logical_bytes": int(total)}
