"""Typed readers of the composed config and the schemas of the groups users compose.

`read_node` turns a composed node into its dataclass and reports anything wrong as one
`ConfigError` that names the key, the value and what is allowed; `xshard.config.schemas` holds
the structured-config schemas of the library's groups (optimizer, schedule, reduction, mesh)
and registers them with Hydra; `xshard.config.sections` reads sections of a composed config;
`xshard.config.program_inputs` says which values are inputs of the compiled programs.
The trainer's own option nodes live in `trainers.config`. Nothing here imports JAX.
"""

from xshard.config.nodes import one_line, read_node, shown

__all__ = ["one_line", "read_node", "shown"]
