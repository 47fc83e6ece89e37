"""Which parameters Muon orthogonalises, named in config (``optimizer.muon_mask``).

`optax.contrib.muon` updates the parameters its ``muon_weight_dimension_numbers`` gives a
`optax.contrib.MuonDimensionNumbers` and sends every other one (None) to its Adam fallback. Its
own default orthogonalises every 2-D parameter, embeddings and the output layer included, which
Muon is not meant for (Jordan et al. 2024; Moonlight, arXiv 2502.16982: AdamW for the embedding
and the head). `hidden_matrices` is the named rule that keeps them on Adam.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
from optax.contrib import MuonDimensionNumbers
from optax.transforms import MaskedNode

from xshard.stats.tree import path_names

MuonRule = Callable[[Any], Any]

#: Path components that name an input embedding or an output (logits) layer.
_IN_OUT = re.compile(
    r"embed|^head$|_head$|^head_|logits|readout|classifier|^output_layer$", re.IGNORECASE
)
#: A numbered layer: a list index ("3") or a Flax auto-name ("Dense_3").
_NUMBERED = re.compile(r"^(?:(.*)_)?(\d+)$")


def _is_masked(x: Any) -> bool:
    return isinstance(x, MaskedNode)


def _numbered(names: list[str]) -> tuple[tuple[str, ...], int] | None:
    """(the stack's key: path before the first numbered component + its stem, the number)."""
    for i, name in enumerate(names):
        match = _NUMBERED.match(name)
        if match:
            return (*names[:i], match.group(1) or ""), int(match.group(2))
    return None


def _last_layer_of_plain_stack(paths: list[list[str]]) -> set[tuple[str, ...]]:
    """The stack keys and index of the output layer of a model with no named one: the
    highest-numbered layer of each stack of numbered layers (``layers/2``, ``Dense_2``)."""
    if any(_IN_OUT.search(n) for names in paths for n in names):
        return set()
    last: dict[tuple[str, ...], int] = {}
    for names in paths:
        found = _numbered(names)
        if found is not None:
            last[found[0]] = max(last.get(found[0], -1), found[1])
    return {(*key, str(i)) for key, i in last.items()}


def hidden_matrices(params: Any) -> Any:
    """Muon for the hidden weight matrices; Adam for everything else.

    A parameter goes to Muon (``MuonDimensionNumbers()``: rows reduce, columns are outputs) if
    it is 2-D and its path names no embedding or output layer (``embed``, ``head``,
    ``lm_head``, ``logits``, ``readout``, ``classifier``); biases, norm scales and other 0-/1-D
    parameters go to Adam (None). In a model with no named embedding or head (a plain stack
    of layers: ``layers/<i>/w``, Flax's ``Dense_<i>``), the highest-numbered layer is its
    output layer and goes to Adam. A tied embedding is the output layer too: Adam.

    Args:
      params: a parameter pytree (arrays or shape-dtype structs); `optax.MaskedNode` leaves
        (the partition optax.contrib.muon passes) stay where they are and count as present.

    Returns:
      A pytree shaped like `params` of ``MuonDimensionNumbers()`` or None.
    """
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_masked)[0]
    paths = [path_names(path) for path, _ in flat]
    output = _last_layer_of_plain_stack(paths)

    def rule(names: list[str], x: Any) -> MuonDimensionNumbers | None:
        if _is_masked(x) or getattr(x, "ndim", 0) != 2:
            return None
        if any(_IN_OUT.search(n) for n in names):
            return None
        found = _numbered(names)
        if found is not None and (*found[0], str(found[1])) in output:
            return None
        return MuonDimensionNumbers()

    out = [rule(names, x) for names, (_, x) in zip(paths, flat, strict=True)]
    treedef = jax.tree.structure(params, is_leaf=_is_masked)
    return jax.tree.unflatten(treedef, out)


#: Muon rules by config name. ``null`` in config: optax's default, every 2-D parameter.
MUON_MASKS: dict[str, MuonRule] = {"hidden_matrices": hidden_matrices}
