"""optimizer=muon's rule of which parameters Muon orthogonalises (``optimizer.muon_mask``,
xshard/optim/muon_masks.py) on the built-in tasks' real params, and in the real optax.contrib.muon
state the composed option builds: hidden matrices to Muon, the rest to its Adam fallback."""

from __future__ import annotations

import textwrap

import jax
import numpy as np
import optax
import pytest
from hydra import compose, initialize_config_module

import xshard
from trainers.tasks.mlp import MLPTask
from trainers.tasks.tiny_gpt import TinyGPTTask
from xshard import ConfigError
from xshard.optim.muon_masks import hidden_matrices
from xshard.optim.slots import find_states
from xshard.stats.tree import path_str

GPT_BATCH = {"inputs": np.zeros((2, 16), np.int32), "targets": np.zeros((2, 16), np.int32)}
MLP_BATCH = {"x": np.zeros((2, 16), np.float32), "y": np.zeros((2, 4), np.float32)}
HIDDEN_GPT = {
    f"blocks/{i}/{name}"
    for i in range(2)
    for name in ("attn/wq", "attn/wk", "attn/wv", "attn/wo", "mlp/w1", "mlp/w2")
}


def gpt_params(tie: bool):
    task = TinyGPTTask(d_model=32, d_ff=64, seq_len=16, tie_embeddings=tie)
    return task.init(jax.random.key(0), GPT_BATCH)


def mlp_params():
    return MLPTask().init(jax.random.key(0), MLP_BATCH)


def to_muon(rule_out, params) -> set[str]:
    """The paths the rule's output gives a MuonDimensionNumbers."""
    paths = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    dims = jax.tree.leaves(
        rule_out, is_leaf=lambda x: x is None or isinstance(x, optax.contrib.MuonDimensionNumbers)
    )
    assert len(dims) == len(paths)
    return {p for p, d in zip(paths, dims, strict=True) if d is not None}


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_tiny_gpt_hidden_matrices_to_muon_embeddings_head_norms_biases_to_adam(tie):
    params = gpt_params(tie)
    assert to_muon(hidden_matrices(params), params) == HIDDEN_GPT
    # What stays on Adam: embeddings, the head (when untied), every norm and bias.
    rest = {path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]} - HIDDEN_GPT
    assert {"embed/tokens", "embed/positions", "ln_f/scale", "blocks/0/mlp/b1"} <= rest
    assert ("head/w" in rest) is not tie


def test_mlp_output_layer_and_biases_to_adam():
    """A plain stack of layers names no head: its highest-numbered layer is the output."""
    params = mlp_params()
    assert to_muon(hidden_matrices(params), params) == {"layers/0/w", "layers/1/w"}


def built_muon_state(params, *overrides):
    with initialize_config_module("xshard.conf", version_base="1.3"):
        cfg = compose("xshard_train", overrides=["optimizer=muon", "schedule=constant", *overrides])
    return xshard.build_optimizer(cfg).init(params)


def unmasked(tree) -> set[str]:
    """The paths of a partitioned state's slot that hold an array (not `optax.MaskedNode`)."""
    is_masked = lambda x: isinstance(x, optax.MaskedNode)
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_masked)[0]
    return {path_str(p) for p, x in leaves if not is_masked(x)}


def muon_slot_paths(state) -> set[str]:
    """The params optax.contrib.muon's Muon half keeps a momentum for (the others are masked)."""
    (muon,) = find_states(state, optax.contrib.MuonState)
    return unmasked(muon.mu)


@pytest.mark.parametrize(
    "params, want",
    [(gpt_params(False), HIDDEN_GPT), (mlp_params(), {"layers/0/w", "layers/1/w"})],
    ids=["tiny_gpt", "mlp"],
)
def test_the_composed_option_partitions_the_real_optimizer_state(params, want):
    state = built_muon_state(params)
    assert muon_slot_paths(state) == want
    (adam,) = find_states(state, optax.ScaleByAdamState)  # the fallback: every other param
    every = {path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
    assert unmasked(adam.mu) == every - want


def test_null_is_optax_default_every_matrix_embeddings_included():
    params = gpt_params(False)
    paths = muon_slot_paths(built_muon_state(params, "optimizer.muon_mask=null"))
    assert paths == HIDDEN_GPT | {"embed/tokens", "embed/positions", "head/w"}


@pytest.fixture
def user_rule(tmp_path, monkeypatch):
    (tmp_path / "my_rules.py").write_text(
        textwrap.dedent("""
        import jax
        from optax.contrib import MuonDimensionNumbers

        def only_w1(params):
            return jax.tree_util.tree_map_with_path(
                lambda p, x: MuonDimensionNumbers() if "w1" in str(p) else None, params)
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))


def test_a_rule_of_ones_own_by_dotted_path_needs_the_allowlist(user_rule):
    params = mlp_params() | {"extra": {"w1": np.ones((4, 4), np.float32)}}
    state = built_muon_state(
        params, "optimizer.muon_mask=my_rules.only_w1", "+allowed_targets=[my_rules.]"
    )
    assert muon_slot_paths(state) == {"extra/w1"}
    with pytest.raises(ConfigError, match=r"optimizer\.muon_mask='my_rules\.only_w1' is not an"):
        built_muon_state(params, "optimizer.muon_mask=my_rules.only_w1")


def test_an_unknown_rule_name_lists_the_allowed_ones():
    with pytest.raises(ConfigError) as e:
        built_muon_state(mlp_params(), "optimizer.muon_mask=all")
    assert str(e.value).startswith("optimizer.muon_mask='all' is not a known mask. Allowed: ")
    assert "['hidden_matrices']" in str(e.value) and "MuonDimensionNumbers" in str(e.value)
