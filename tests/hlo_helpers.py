"""Reading a compiled or lowered program's text: the dtypes its matrix multiplications have
(`benchmarks.hlo.dot_operand_dtypes`, which the device probe reads too)."""

from benchmarks.hlo import dot_operand_dtypes as dot_dtypes

__all__ = ["dot_dtypes"]
