"""Which jobs of a multirun can train as one population (`hydra/launcher=population`).

Two jobs share a population when their composed configs (Hydra's own ``hydra`` node aside)
agree on every key except inputs of the compiled programs
(`xshard.config.program_inputs.is_input_key`: the float hyperparameters of ``optimizer``,
``schedule``, ``clip`` and the outer optimizers): then they lower to the same programs, which
`trainers.core.population` runs vmapped over the trials. Anything else is structure: a group
choice (``optimizer=adam,sgd`` changes ``optimizer._target_``), an integer, a null, ``seed``
(one data order and one initialisation for the population). Configs whose programs cannot run
in a population (a periodic axis with fragments, a ``sync_delay``, warm-up steps, a codec or
elastic groups: `xshard.config.axes.POPULATION_UNSUPPORTED`; several processes) each run
alone. Every split is said in
one line naming the key. JAX-free.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from omegaconf import DictConfig, OmegaConf

from xshard.config.axes import POPULATION_UNSUPPORTED
from xshard.config.program_inputs import is_input_key

#: A periodic axis's period (group 1: the axis's node).
_PERIODIC = re.compile(r"(reduction\.axes\.[^.]+)\.every_steps")


class JobGroup(NamedTuple):
    """Jobs (their positions in the launcher's list) that train together, and why a job that
    could not join is alone or elsewhere (log lines)."""

    jobs: list[int]
    notes: list[str]


def flat_config(cfg: DictConfig) -> dict[str, Any]:
    """`cfg` without its ``hydra`` node as ``{dotted key: value}``, interpolations unresolved
    (``${hydra:runtime.output_dir}`` is one string for every job)."""
    tree = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(tree, dict)
    tree.pop("hydra", None)
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, Mapping) and node:
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        else:
            flat[prefix] = node

    walk(tree, "")
    return flat


def cannot_join(flat: Mapping[str, Any]) -> str | None:
    """Why a job with config `flat` trains alone (one line naming the key), or None."""
    for key, every in flat.items():
        periodic = _PERIODIC.fullmatch(key)
        if periodic is None or every in (None, 1):
            continue
        for name, off in POPULATION_UNSUPPORTED:  # the base case syncs in the population
            field = f"{periodic[1]}.{name}"
            node = any(k.startswith(f"{field}.") for k in flat)  # a node (elastic) is set
            value = flat.get(field, "{...}" if node else off)
            if value != off:
                return (
                    f"{field}={value}: a periodic axis syncs in a population only with "
                    f"{name}={'null' if off is None else str(off).lower()}"
                )
    if flat.get("distributed.enabled"):
        return "distributed.enabled=true: a population runs in one process"
    return None


def structural_difference(a: Mapping[str, Any], b: Mapping[str, Any]) -> str | None:
    """The first key whose values in `a` and `b` differ and that is not an input of the
    programs, as one line (``optimizer._target_: optax.adam vs optax.sgd``); None if they
    differ only in inputs."""
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key), b.get(key)
        if va != vb and not (key in a and key in b and is_input_key(key, va, vb)):
            return f"{key}: {va!r} vs {vb!r}"
    return None


def group_jobs(configs: Sequence[DictConfig]) -> list[JobGroup]:
    """The jobs of `configs` in populations, in order of their first job: each job joins the
    first group whose first job differs from it only in inputs of the programs."""
    groups: list[JobGroup] = []
    firsts: list[dict[str, Any] | None] = []  # a group's first config; None: alone
    for job, cfg in enumerate(configs):
        flat = flat_config(cfg)
        alone = cannot_join(flat)
        if alone is not None:
            groups.append(JobGroup([job], [f"job {job} trains alone: {alone}"]))
            firsts.append(None)
            continue
        whys = []
        for group, first in zip(groups, firsts, strict=True):
            why = None if first is None else structural_difference(first, flat)
            if first is not None and why is None:
                group.jobs.append(job)
                break
            if why is not None:
                whys.append(f"not with job {group.jobs[0]} ({why})")
        else:
            note = [f"job {job} starts a population: {'; '.join(whys)}"] if whys else []
            groups.append(JobGroup([job], note))
            firsts.append(flat)
    return groups
