"""Reading a compiled or lowered program's text: the dtypes its matrix multiplications have."""

from __future__ import annotations

import re


def dot_dtypes(text: str) -> set[str]:
    """The result dtypes of the dots of a StableHLO (``dot_general``) or HLO (``dot(``) text."""
    stablehlo = re.findall(r"stablehlo\.dot_general.*-> tensor<[^>]*x(\w+)>", text)
    hlo = re.findall(r"= (\w+)\[[^\]]*\][^ ]* dot\(", text)
    return set(stablehlo) | set(hlo)
