"""Markdown tables of a results dict (``benchmarks/results.md``, pasted into the README)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from benchmarks import goals


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _ms(s: dict[str, float]) -> str:
    """'4.12 (3.90–4.40)': median and interquartile range, ms."""
    return f"{s['median_ms']:.3g} ({s['q1_ms']:.3g}–{s['q3_ms']:.3g})"


def _ratio(r: dict[str, float]) -> str:
    """'1.03x (paired 1.02x, IQR 0.99–1.05)'."""
    return (
        f"{r['ratio_of_medians']:.2f}x (paired {r['paired_median']:.2f}, "
        f"IQR {r['paired_q1']:.2f}–{r['paired_q3']:.2f})"
    )


def _kib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 1024:.1f}"


def _tasks(section: dict[str, Any]) -> list[str]:
    return [k for k, v in section.items() if isinstance(v, (dict, list)) and k not in ("model",)]


def _header(meta: dict[str, Any]) -> str:
    return (
        f"Measured on {meta['device_count']} x {meta['device_kind']} ({meta['platform']}), "
        f"{meta['cpus_usable']} usable CPU cores, jax {meta['jax_version']}, optax "
        f"{meta['optax_version']}, {meta['date_utc']}, mode `{meta['mode']}`, load average "
        f"{meta['load_average_start']} -> {meta['load_average_end']} (1/5/15 min), "
        f"commit {meta['git_commit']}{' (dirty tree)' if meta.get('git_dirty') else ''}. "
        "Times are ms per step: median (interquartile range) over interleaved blocks; ratios "
        "are ratios of medians, with the median and IQR of per-round (paired) ratios."
    )


def _overhead(sec: dict[str, Any]) -> str:
    rows = []
    for task in _tasks(sec):
        t = sec[task]
        fastest = t["fastest_handwritten"]
        for name, s in t["variants"].items():
            if name == fastest:
                cell = "1.00x (fastest hand-written)"
            else:
                cell = _ratio(t["ratio_to_each_handwritten"][fastest][name])
            rows.append([task, f"`{name}`", _ms(s), cell, t["program"][name]["kernels"]])
    table = _table(
        [
            "task",
            "variant",
            "ms/step",
            "x fastest hand-written",
            "kernels",
        ],
        rows,
    )
    return (
        f"{_paths(sec)}\n\n{table}\n\n"
        f"Kernels per step by origin (from the compiled HLO):\n\n{_breakdown(sec)}"
    )


def _paths(sec: dict[str, Any]) -> str:
    """Both ``trainer.grad_impl`` paths at the CLI's cadence against the fastest hand-written
    step, one row per task; the CLI's default in bold."""
    tasks = [t for t in _tasks(sec) if "paths" in sec[t]]
    if not tasks:
        return ""
    impls = list(sec[tasks[0]]["paths"])
    rows = []
    for task in tasks:
        t = sec[task]
        hand = t["variants"][t["fastest_handwritten"]]
        default = t["default"]["grad_impl"]  # with auto: the path the start-up race kept
        cells = [
            f"**{_ratio(r)}**" if impl == default else _ratio(r) for impl, r in t["paths"].items()
        ]
        rows.append([task, f"`{t['fastest_handwritten']}` {_ms(hand)}", *cells])
    header = ["task", "fastest hand-written, ms/step", *(f"`grad_impl={i}`" for i in impls)]
    note = (
        "Both gradient paths at the CLI's cadence (statistics every 10th step), x the fastest "
        "hand-written step; the CLI's default in bold (with `trainer.grad_impl=auto`, the path "
        "the trainer's own start-up race kept on that workload in this run):"
    )
    return f"{note}\n\n{_table(header, rows)}"


def _breakdown(sec: dict[str, Any]) -> str:
    origins: list[str] = []
    for task in _tasks(sec):
        for p in sec[task]["program"].values():
            origins += [o for o in p["by_origin"] if o not in origins]
    rows = [
        [
            task,
            f"`{name}`",
            p["kernels"],
            *(p["by_origin"].get(o, 0) for o in origins),
            p["by_op"].get("dot", 0),
        ]
        for task in _tasks(sec)
        for name, p in sec[task]["program"].items()
    ]
    return _table(["task", "variant", "kernels", *origins, "of which unfused dots"], rows)


def _stats(sec: dict[str, Any]) -> str:
    rows = []
    for task in _tasks(sec):
        e, d = sec[task]["every_step"], sec[task]["diagnostics"]
        every = d["configured_every_steps"]
        rows.append(
            [
                task,
                _ratio(e["full_vs_none"]),
                _ratio(e["stats_every_10_vs_none"]),
                _ratio(e["guard_vs_none"]),
                _ratio(d["layer_stats_step_vs_step"]),
                _ratio(d["histogram_step_vs_step"]),
                f"{100 * d['amortized_overhead']:.2f}% (every {every})",
            ]
        )
    return _table(
        [
            "task",
            "full stats every step vs none",
            "stats every 10th step (CLI default) vs none",
            "guard only vs none",
            "step + layer stats vs step",
            "step + histograms vs step",
            "diagnostics, amortized",
        ],
        rows,
    )


def _collectives(sec: dict[str, Any]) -> str:
    rows = []
    for task in _tasks(sec):
        for name, c in sec[task].items():
            t = c["totals"]
            kinds = ", ".join(f"{k} x{v}" for k, v in t["by_kind"].items()) or "none"
            rows.append(
                [
                    task,
                    f"`{name}`",
                    kinds,
                    (
                        f"{t['ops_with_gradients']} op(s), {t['gradient_operands']}/"
                        f"{c['num_param_leaves']} params"
                    ),
                    (
                        f"{t['scalar_operands_fused_into_gradient_ops']} fused, "
                        f"{t['scalar_only_ops']} separate op(s)"
                    ),
                    "yes" if c["gradient_reduction_fused"] else "no",
                ]
            )
    return _table(
        [
            "task",
            "variant",
            "collectives per step",
            "gradient collectives",
            "scalar operands",
            "one per dtype",
        ],
        rows,
    )


def _memory(sec: dict[str, Any]) -> str:
    rows = []
    for task in _tasks(sec):
        for name, m in sec[task].items():
            c = m["compiled"] or {}
            rows.append(
                [
                    task,
                    f"`{name}`",
                    _kib(m["params_bytes_per_device"]),
                    _kib(m["opt_state_bytes_per_device"]),
                    _kib(c.get("argument_size_in_bytes")),
                    _kib(c.get("output_size_in_bytes")),
                    _kib(c.get("alias_size_in_bytes")),
                    _kib(c.get("temp_size_in_bytes")),
                ]
            )
    return _table(
        [
            "task",
            "variant",
            "params",
            "opt state",
            "arguments",
            "outputs",
            "aliased (donated)",
            "temporaries",
        ],
        rows,
    )


def _compile(sec: dict[str, Any]) -> str:
    rows = []
    for task in _tasks(sec):
        for name, v in sec[task]["variants"].items():
            f = v["first_call"]
            rows.append(
                [
                    task,
                    f"`{name}`",
                    f"{f['wall_s']:.2f}",
                    f"{f['compile_s']:.2f}",
                    f"{f['trace_s'] + f['lower_s']:.2f}",
                    f"{v['later_compiles']} in {v['later_steps']}",
                ]
            )
    lines = [
        _table(
            [
                "task",
                "variant",
                "first step s",
                "XLA compile s",
                "trace + lower s",
                "compiles in later steps",
            ],
            rows,
        )
    ]
    for task in _tasks(sec):
        s = sec[task]["shape_change"]
        lines.append(
            f"\n`{task}`: `Trainer.step` with a {s['batch_rows']}-row batch -> "
            f"{s['raised'] or 'no error'} ({s['compiles']} compilations)."
        )
    return "\n".join(lines)


def _host(sec: dict[str, Any]) -> str:
    rows = [[f"`{n}`", _ms(s)] for n, s in sec["variants"].items()]
    table = _table(["loop (task mlp)", "ms/step"], rows)
    return (
        f"{table}\n\n`fit` with hooks vs bare loop: {_ratio(sec['fit_hooks_vs_bare'])}; "
        f"without hooks: {_ratio(sec['fit_no_hooks_vs_bare'])}; "
        f"{sec['fit_hooks_overhead_us_per_step']} us/step over the bare loop, of which hooks "
        f"{sec['hooks_cost_us_per_step']} us. Placing each host batch on the devices costs "
        f"{sec['batch_placement_us_per_step']} us/step (in every loop fed NumPy batches)."
    )


def _scaling(sec: dict[str, Any]) -> str:
    rows = []
    for task in _tasks(sec):
        if task == "device_counts":
            continue
        for r in sec[task]:
            rows.append(
                [
                    task,
                    r["devices"],
                    r["per_device_batch"],
                    _ms(r["xshard_trainer"]),
                    _ms(r["jit_gspmd"]),
                    _ratio(r["xshard_vs_jit"]),
                ]
            )
    table = _table(
        [
            "task",
            "devices",
            "batch per device",
            "`xshard_trainer` ms",
            "`jit_gspmd` ms",
            "xshard / jit",
        ],
        rows,
    )
    return f"{table}\n\nNote: {sec['note']}."


def _optimizers(sec: dict[str, Any]) -> str:
    rows = []
    for task in _tasks(sec):
        t = sec[task]
        for name, s in t["variants"].items():
            vs = t["vs_adamw"].get(name)
            typed = " ".join(t.get("overrides", {}).get(name, [f"optimizer={name}"]))
            rows.append([task, f"`{typed}`", _ms(s), "1.00x" if vs is None else _ratio(vs)])
    return _table(["task", "overrides (CLI defaults otherwise)", "ms/step", "vs adamw"], rows)


_RENDERERS: dict[str, tuple[str, Callable[[dict[str, Any]], str]]] = {
    "overhead": ("1. Step time: xshard vs hand-written steps", _overhead),
    "stats": ("2. Cost of the statistics", _stats),
    "collectives": ("3. Collectives per step (compiled HLO)", _collectives),
    "memory": ("4. Memory per device (KiB, `compiled.memory_analysis()`)", _memory),
    "compile": ("5. Compilation", _compile),
    "host": ("6. Host overhead of `Trainer.fit`", _host),
    "scaling": ("7. Scaling over simulated devices (same global batch)", _scaling),
    "optimizers": ("8. Muon, schedule-free AdamW, ADOPT: step time against AdamW", _optimizers),
}


def _targets(sections: dict[str, Any]) -> str:
    rows = [
        [
            r["what"],
            r["task"],
            f"<= {r['target']}",
            "n/a" if r["measured"] is None else f"{r['measured']:.2f}x (paired {r['paired']:.2f})",
            {True: "yes", False: "**no**", None: "n/a"}[r["met"]],
        ]
        for r in goals.summary(sections)
    ]
    return _table(["target", "task", "ratio", "measured", "met"], rows)


def render(results: dict[str, Any]) -> str:
    """The Markdown report of `results` (as written by `benchmarks.run`)."""
    parts = ["# xshard benchmarks", "", _header(results["meta"])]
    targets = goals.summary(results["sections"])
    if targets:
        parts += ["", "## Targets (`benchmarks/goals.py`)", "", _targets(results["sections"])]
    for name, section in results["sections"].items():
        title, fn = _RENDERERS[name]
        parts += ["", f"## {title}", ""]
        if "error" in section:
            parts.append(f"FAILED: {section['error']}")
        else:
            parts.append(fn(section))
    return "\n".join(parts) + "\n"
