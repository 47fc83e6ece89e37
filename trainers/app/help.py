"""``python -m trainers.train --help``: what the app does, its groups, exit codes, allowlist.

Hydra prints ``hydra.help.template``; ``xshard_train.yaml`` sets it to ``${xshard.help:}``, the
resolver `help_text` registered here. The text is built when asked for, from the sources of
each fact: the config groups Hydra can load (without Hydra's own and the internal
``xshard_schemas``), the exit statuses (`trainers.exits.EXIT_STATUSES`), and the default
``_target_`` allowlist.
"""

from __future__ import annotations

from omegaconf import OmegaConf

#: Groups that are not options a user chooses.
HIDDEN_GROUPS = ("hydra", "xshard_schemas")

_INTRO = """\
xshard trainer: trains a task (model + data) with a cross-shard optax optimizer on a JAX
device mesh, with checkpoints (Orbax) and TensorBoard logs. Every value below can be set on
the command line; -m runs a sweep (one job per combination, or an Optuna study).

Usage:
  python -m trainers.train task=mlp optimizer=adam optimizer.learning_rate=3e-4 reduction=sum
  python -m trainers.train -m task=mlp optimizer.learning_rate=1e-3,1e-2     # a sweep
  python -m trainers.train task=mlp hydra.run.dir=runs/a     # rerun in runs/a to resume
  python -m trainers.train task=mlp --cfg job                # print the composed config
"""


def _groups() -> str:
    from hydra.core.global_hydra import GlobalHydra

    if not GlobalHydra.instance().is_initialized():
        return "  (not available)\n"
    loader = GlobalHydra.instance().config_loader()
    lines = []
    for group in sorted(loader.list_groups("")):
        if group in HIDDEN_GROUPS:
            continue
        options = sorted(loader.get_group_options(group))
        lines.append(f"  {group}: {', '.join(options)}")
    return "\n".join(lines) + "\n"


def _exit_codes() -> str:
    import textwrap

    from trainers.exits import EXIT_STATUSES

    rows = []
    for code, meaning in EXIT_STATUSES:
        lines = textwrap.wrap(meaning, width=86)
        rows.append(f"  {code:<4}{lines[0]}")
        rows.extend(f"      {line}" for line in lines[1:])
    return "\n".join(rows) + "\n"


def help_text() -> str:
    """The app's help (Hydra's ``$FLAGS_HELP`` is appended by the template)."""
    from trainers.app.elastic_group import EXTRA
    from xshard.config.targets import DEFAULT_ALLOWED_TARGETS

    allowed = ", ".join(DEFAULT_ALLOWED_TARGETS)
    return (
        f"{_INTRO}\n"
        "Config groups (choose one option each, e.g. optimizer=adam):\n"
        f"{_groups()}\n"
        "Exit status of a single run (in a multirun a failed job is recorded in its\n"
        "result.json and the sweep goes on; see docs/sweeps.md):\n"
        f"{_exit_codes()}\n"
        f"_target_ allowlist: classes and functions under {allowed};\n"
        "add your own modules with allowed_targets=[mypkg.] (in your primary config or on the\n"
        "command line only).\n\n"
        f"Optional extra: {EXTRA};\n"
        "reduction=diloco_elastic and python -m trainers.elastic (docs/reductions.md).\n\n"
        "Docs: README.md, docs/config.md, docs/sweeps.md, docs/reliability.md.\n\n"
        "Hydra flags:\n$FLAGS_HELP"
    )


def register_help_resolver() -> None:
    """Registers ``${xshard.help:}`` (idempotent)."""
    if not OmegaConf.has_resolver("xshard.help"):
        OmegaConf.register_new_resolver("xshard.help", help_text)
