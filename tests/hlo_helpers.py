"""Reading a compiled or lowered program's text: the dtypes its matrix multiplications have."""

from __future__ import annotations

import re

_STABLEHLO_DOT = re.compile(
    r"stablehlo\.dot_general .*: \(tensor<(?:[^>]*x)?(\w+)>, tensor<(?:[^>]*x)?(\w+)>\)"
)
_ALGORITHM = re.compile(r"lhs_precision_type = (\w+), rhs_precision_type = (\w+)")
_HLO_DEFINITION = re.compile(r"%?([\w.\-]+) = (\w+)\[")
_HLO_DOT = re.compile(r" dot\(%?([\w.\-]+), %?([\w.\-]+)\)")


def dot_dtypes(text: str) -> set[str]:
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
