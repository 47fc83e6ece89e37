"""The run's TensorBoard HParams entry and its curated custom-scalars dashboard.

**Which hparams, in which order.** First every key of ``hydra.overrides.task`` (what the
command line swept or overrode), in the order given; then the other group choices
(``optimizer``, ``reduction``, ...; Hydra's own ``hydra/*`` and the internal ``xshard_schemas/*``
left out); then a few values people compare across sweeps (`KEY_VALUES`). Keys under
``hydra.`` and ``paths.``, and those Hydra leaves out of directory names
(``hydra.job.config.override_dirname.exclude_keys``: ``trainer.resume_from``,
``trainer.progress``), are not hyperparameters and are left out.

**How TensorBoard shows them.** TensorBoard's HParams plugin lists hparams marked ``differs``
first, then by name; tensorboardX cannot set that field, so `experiment_summary` writes it.
The overrides are marked (they differ from the defaults), so the swept keys are the first
columns, and the plugin's default of a few visible columns shows them.

**Values.** TensorBoard accepts str, bool and float: numbers stay numbers, a null is the
string ``"null"`` (as typed on the command line, ``clip=null``), lists and mappings are their
JSON text. A column mixing numbers and "null" is shown as strings by TensorBoard.

**Metrics and status.** `METRICS` (final and best loss, last step) are written as scalars at
the end, and for a run that evaluates `eval_metric_tags` (``hparams/final_eval/<metric>`` of
the final evaluation, ``hparams/best_eval/<metric>`` of the one with the lowest ``eval/loss``);
the session's end info says success or failure (the dashboard's Status filter).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from trainers.config.cli_args import RunOverrides
from trainers.hooks.tbx import (
    DataType,
    Experiment,
    HParamInfo,
    HParamsPluginData,
    MetricInfo,
    MetricName,
    SessionEndInfo,
    SessionStartInfo,
    Status,
    Summary,
    SummaryMetadata,
)

#: Values shown after the overrides and group choices (when not already among them).
KEY_VALUES = (
    "seed",
    "optimizer.learning_rate",
    "reduction.mode",
    "trainer.steps",
    "trainer.batch_size",
    "clip",
)
#: The HParams metrics, written as scalars when the run ends.
FINAL_LOSS_TAG = "hparams/final_loss"
BEST_LOSS_TAG = "hparams/best_loss"
LAST_STEP_TAG = "hparams/last_step"
METRICS = (FINAL_LOSS_TAG, BEST_LOSS_TAG, LAST_STEP_TAG)
#: The string a null value is shown as.
NULL = "null"

_PLUGIN = "hparams"
_EXPERIMENT_TAG = "_hparams_/experiment"
_SESSION_START_TAG = "_hparams_/session_start_info"
_SESSION_END_TAG = "_hparams_/session_end_info"
# HParamInfo.differs (field 7, a bool) of TensorBoard's api.proto, which tensorboardX's copy
# lacks: appended as its wire encoding (tag 7 << 3 | varint, then 1). Protobuf keeps unknown
# fields when it parses and serialises, so TensorBoard reads it like any other field.
_DIFFERS_TRUE = bytes([7 << 3, 1])

HParamValue = bool | str | float


def hparams(
    config: Mapping[str, Any], run: RunOverrides | None
) -> tuple[dict[str, HParamValue], frozenset[str]]:
    """The run's hparams (ordered as the module docstring says) and which ones it overrode.

    Args:
      config: the run's resolved config as plain values (`trainers.config.plain.run_config`).
      run: what the Hydra job was asked for (`trainers.config.cli_args.run_overrides`); None
        outside a Hydra job: only `KEY_VALUES`.

    Returns:
      (ordered {name: value}, the names of the overridden keys).
    """
    values: dict[str, HParamValue] = {}
    overridden: set[str] = set()
    if run is not None:
        choices = run.choices
        for key, text in run.overrides:
            if key in run.excluded or key.startswith(("hydra.", "hydra/", "paths.")):
                continue
            value = choices[key] if key in choices else _select(config, key, text)
            values[key] = shown(value)
            overridden.add(key)
        order = list(config.keys())
        position = {k: (order.index(k) if k in order else len(order)) for k in choices}
        for key in sorted(choices, key=lambda k: position[k]):
            values.setdefault(key, shown(choices[key]))
    for key in KEY_VALUES:
        if key not in values and _select(config, key, _MISSING) != _MISSING:
            values[key] = shown(_select(config, key, None))
    return values, frozenset(overridden)


#: OmegaConf's text of a missing value.
_MISSING = "???"


def _select(config: Mapping[str, Any], key: str, default: Any) -> Any:
    """The value at dotted `key` of plain `config` (a list's item by its index), as
    `OmegaConf.select` reads it: `default` if it is absent or missing (``???``)."""
    node: Any = config
    for part in key.split("."):
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return default
    return default if node == _MISSING else node


def shown(value: Any) -> HParamValue:
    """A config value as TensorBoard's HParams can hold it (module docstring: Values)."""
    if value is None:
        return NULL
    if isinstance(value, bool | str):
        return value
    if isinstance(value, int | float):
        return float(value)
    try:
        return json.dumps(value, separators=(",", ":"))
    except TypeError:
        return str(value)


def _summary(tag: str, data: HParamsPluginData) -> Summary:
    meta = SummaryMetadata(
        plugin_data=SummaryMetadata.PluginData(
            plugin_name=_PLUGIN, content=data.SerializeToString()
        )
    )
    return Summary(value=[Summary.Value(tag=tag, metadata=meta)])


def eval_metric_tag(kind: str, name: str) -> str:
    """The HParams metric of evaluation metric `name` (``eval/loss``): `kind` "final" or
    "best" gives ``hparams/final_eval/loss`` or ``hparams/best_eval/loss``."""
    return f"hparams/{kind}_{name}"


def eval_metric_tags(names: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The HParams metrics of the evaluation metrics `names`: final ones, then best ones."""
    return tuple(eval_metric_tag(kind, n) for kind in ("final", "best") for n in names)


def experiment_summary(
    values: dict[str, HParamValue], differs: frozenset[str], metrics: tuple[str, ...] = METRICS
) -> Summary:
    """The experiment (columns: hparams in order, `differs` set on `differs`, `metrics`)."""
    infos = []
    for name, value in values.items():
        kind = (
            "DATA_TYPE_BOOL"
            if isinstance(value, bool)
            else ("DATA_TYPE_STRING" if isinstance(value, str) else "DATA_TYPE_FLOAT64")
        )
        info = HParamInfo(name=name, type=DataType.Value(kind))
        if name in differs:
            info = HParamInfo.FromString(info.SerializeToString() + _DIFFERS_TRUE)
        infos.append(info)
    metric_infos = [MetricInfo(name=MetricName(tag=t)) for t in metrics]
    return _summary(
        _EXPERIMENT_TAG,
        HParamsPluginData(experiment=Experiment(hparam_infos=infos, metric_infos=metric_infos)),
    )


def session_start_summary(values: dict[str, HParamValue]) -> Summary:
    """This run's hparam values."""
    info = SessionStartInfo(start_time_secs=time.time())
    for name, value in values.items():
        if isinstance(value, bool):
            info.hparams[name].bool_value = value
        elif isinstance(value, str):
            info.hparams[name].string_value = value
        else:
            info.hparams[name].number_value = float(value)
    return _summary(_SESSION_START_TAG, HParamsPluginData(session_start_info=info))


def session_end_summary(success: bool) -> Summary:
    """The run's end: success, or failure (a failed or diverged run)."""
    status = Status.Value("STATUS_SUCCESS" if success else "STATUS_FAILURE")
    info = SessionEndInfo(status=status, end_time_secs=time.time())
    return _summary(_SESSION_END_TAG, HParamsPluginData(session_end_info=info))


def custom_scalars_layout() -> dict[str, dict[str, list]]:
    """TensorBoard's Custom Scalars dashboard: what to look at first, one chart per concern.

    Tags are regular expressions; a chart whose tags a run does not log stays empty.
    """
    return {
        "xshard": {
            "loss": ["Multiline", ["^train/loss$"]],
            "learning rate": ["Multiline", ["^optim/learning_rate$"]],
            # one chart per eval metric: a loss near 3 and an accuracy near 0.3 share no scale
            "eval loss": ["Multiline", ["^eval/loss$"]],
            "eval accuracy": ["Multiline", ["^eval/accuracy$"]],
            "eval, other metrics": ["Multiline", ["^eval/(?!loss$|accuracy$)"]],
            "gradient norms (reduced, per shard)": [
                "Multiline",
                ["^grad/global_norm$", "^grad/shard_norm_(mean|max|min)$"],
            ],
            "gradient noise scale": [
                "Multiline",
                ["^grad/noise_scale$", "^grad/noise_scale_ema$"],
            ],
            "throughput": [
                "Multiline",
                ["^perf/(examples|tokens)_per_sec$"],
            ],
            "FLOP/s and MFU": ["Multiline", ["^perf/flops_per_sec$", "^perf/mfu$"]],
            "skipped steps": ["Multiline", ["^train/skipped_steps$"]],
            "update / param ratio": ["Multiline", ["^optim/update_param_ratio$"]],
            "traffic per step, by axis": ["Multiline", ["^comm/[^/]+/bytes_per_step$"]],
            "periodic sync: pseudo-gradient, outer update, replica drift": [
                "Multiline",
                ["^sync/.*/(pseudo_grad_norm|outer_update_norm|replica_drift)$"],
            ],
            "compression error": ["Multiline", ["^(comm|sync)/.*/compression_error_norm$"]],
            "skipped syncs": ["Multiline", ["^sync/.*/skipped$"]],
        }
    }
