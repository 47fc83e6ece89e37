"""ZeRO / FSDP against replicated:
``python -m benchmarks.zero [--smoke] [--bytes-only] [--models a,b] [--impls a,b] [--out PATH]``.

For each model (tiny_gpt as configured, and an 8-layer, 256-wide GPT where the state, not the
temporaries, dominates, with adam, with muon, and with muon orthogonalising every matrix on
every device at stage 0, ``optimizer.shard_orthogonalization=false``, measured at stage 0 only)
and each ``sharding.zero_stage`` 0-3, in one process on every device present (8 simulated CPU
devices), on both gradient paths (``--impls`` one of them):

* bytes per device: ``compiled.memory_analysis()`` of the step (arguments, outputs,
  temporaries) and the live arrays of params and optimizer state (from their shardings);
* collectives from the compiled HLO: counts by kind, and the bytes each device sends per step
  under a ring algorithm (all-reduce 2(N-1)/N of its operand, reduce-scatter and all-gather
  (N-1)/N of the full array, all-to-all (N-1)/N of its operand) over the arrays above `SMALL`
  elements, against the ring limit of data parallelism, 2(N-1)/N x the gradient's bytes;
* step time, the stages interleaved block by block (`benchmarks.timing.interleave`), with the
  ratio to the replicated step of the same path; ``--bytes-only`` compiles and counts without
  timing (the step's time columns then say "not timed"): bytes and collectives come from the
  compiled programs and do not depend on the machine's load, step times do.

Writes JSON to ``--out`` (default ``benchmarks/zero_results.json``) and a Markdown table next to
it, and prints the table. ``--smoke`` shrinks everything (CI); its numbers mean nothing.
``--models a,b`` measures only those, replacing their sections of an existing ``--out`` (each
section records the run that measured it).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

from benchmarks.env import configure_devices, environment
from benchmarks.workloads import GPT_8X256

DEFAULT_OUT = Path(__file__).resolve().parent / "zero_results.json"
#: Collective operands (whole arrays) up to this many elements are scalar statistics (the
#: loss, norms, counts), not data; the plain step measured here has no larger statistics.
SMALL = 16
MODELS: dict[str, tuple[str, ...]] = {
    "tiny_gpt": (),
    "gpt_8x256": GPT_8X256,
    # Muon orthogonalises each hidden matrix whole: under ZeRO its momentum is gathered once.
    "gpt_8x256_muon": (*GPT_8X256, "optimizer=muon"),
    # ... and at stage 0 on every device, not 1/N of the matrices on each and an all-gather.
    "gpt_8x256_muon_unsharded_ns": (
        *GPT_8X256,
        "optimizer=muon",
        "optimizer.shard_orthogonalization=false",
    ),
}
SMOKE: tuple[str, ...] = ("task.n_layers=1", "task.d_model=32", "task.d_ff=64", "task.seq_len=16")
STAGES = (0, 1, 2, 3)
#: The stages a model is measured at where not all: an option that acts at those only.
MODEL_STAGES: dict[str, tuple[int, ...]] = {"gpt_8x256_muon_unsharded_ns": (0,)}
#: What the step-time columns say of a variant measured by ``--bytes-only``.
NOT_TIMED = "not timed"
IMPLS = ("manual", "gspmd")
_OP = re.compile(
    r"=\s*(?P<shape>.+?)\s+(?P<op>all-reduce|reduce-scatter|all-gather|all-to-all)(?:-start)?\("
)
_ARRAY = re.compile(r"\b(?P<dtype>pred|[subf]\d+|bf16)\[(?P<dims>[\d,]*)\]")


def ring_bytes(hlo: str, n: int) -> dict[str, Any]:
    """Per-device bytes sent per step by the data collectives of `hlo` (ring algorithms).

    Args:
      hlo: the compiled, partitioned HLO (``compiled.as_text()``).
      n: the number of devices in each collective's group (the data shards).

    Returns:
      ``{"counts": {op: number}, "sent_bytes": total, "by_op": {op: bytes}}`` over operands
      of more than `SMALL` elements.
    """
    counts: dict[str, int] = {}
    by_op: dict[str, float] = {}
    for line in hlo.splitlines():
        m = _OP.search(line)
        if m is None:
            continue
        op = m["op"]
        shapes = [
            (a["dtype"], [int(d) for d in a["dims"].split(",") if d])
            for a in _ARRAY.finditer(re.sub(r"/\*.*?\*/", "", m["shape"]))
        ]
        if line.split("=", 1)[1].lstrip().startswith("(") and "-start" in line:
            shapes = shapes[len(shapes) // 2 :]  # async start: (operands..., results...)
        whole = n if op == "reduce-scatter" else 1  # its result is the 1/n slice
        big = [(t, d) for t, d in shapes if math.prod(d) * whole > SMALL]
        if not big:
            continue
        counts[op] = counts.get(op, 0) + 1
        size = sum(math.prod(d) * (2 if t in ("bf16", "f16") else 4) for t, d in big)
        if op == "all-reduce":
            sent = 2 * (n - 1) / n * size
        elif op == "reduce-scatter":  # the result is the 1/n slice
            sent = (n - 1) * size
        else:  # all-gather (the result is the whole array), all-to-all (keeps 1/n of it)
            sent = (n - 1) / n * size
        by_op[op] = by_op.get(op, 0.0) + sent
    return {"counts": counts, "sent_bytes": int(sum(by_op.values())), "by_op": by_op}


class _Loop:
    """One trainer and its state, stepped by the interleaved timer."""

    def __init__(self, name: str, trainer: Any, state: Any, batch: Any):
        self.name, self.trainer, self.state, self.batch = name, trainer, state, batch

    def run(self, steps: int) -> None:
        import jax

        metrics = None
        for _ in range(steps):
            self.state, metrics = self.trainer.step(self.state, self.batch, with_stats=False)
        jax.block_until_ready((self.state, metrics.device_value("train/loss")))


def _variant(trainer: Any, state: Any, n: int) -> dict[str, Any]:
    """Memory and collectives of one compiled plain step (`trainer` stepped once)."""
    from benchmarks.hlo import memory, state_bytes

    params = state_bytes(state.params)
    (compiled,) = trainer.executables().values()  # the plain step's
    comm = ring_bytes(compiled.as_text(), n)
    return {
        "compiled": memory(compiled),
        "params_bytes_per_device": params["per_device_bytes"],
        "params_bytes_logical": params["logical_bytes"],
        "opt_state_bytes_per_device": state_bytes(state.opt_state)["per_device_bytes"],
        "collectives": comm["counts"],
        "sent_bytes_per_device": comm["sent_bytes"],
        "ring_limit_bytes": int(2 * (n - 1) / n * params["logical_bytes"]),
        "compile_s": round(trainer.compile_seconds or 0.0, 2),
    }


def measure(
    model: str,
    overrides: tuple[str, ...],
    smoke: bool,
    timed: bool = True,
    impls: tuple[str, ...] = IMPLS,
) -> dict[str, Any]:
    """The stages (`MODEL_STAGES`, else all) and `impls` of one model: memory, collectives,
    step times (plain steps: no statistics, the program of most steps with the CLI's
    defaults); `timed` False: each step compiled and run once, not timed (no ``step`` nor
    ``vs_replicated`` in the variants)."""
    import jax
    from hydra import compose, initialize_config_module

    from benchmarks.timing import Plan, interleave, ratio
    from trainers.app.builders import build_task
    from trainers.core.trainer import Trainer
    from xshard.mesh.build import build_mesh
    from xshard.optim.factory import build_optimizer

    with initialize_config_module("xshard.conf", version_base="1.3"):
        cfg = compose(
            "xshard_train",
            overrides=[
                "task=tiny_gpt",
                "optimizer=adam",
                "schedule=constant",
                "mesh=auto",
                "trainer.batch_size=16",
                *overrides,
                *(SMOKE if smoke else ()),
            ],
        )
    mesh = build_mesh(cfg.mesh)
    n = mesh.size
    task = build_task(cfg)
    out: dict[str, Any] = {"devices": n, "overrides": list(overrides), "variants": {}}
    loops = []
    stages = MODEL_STAGES.get(model, STAGES)
    for impl in impls:
        for stage in stages:
            trainer = Trainer(
                task,
                build_optimizer(cfg, mesh=mesh),
                mesh,
                data_axes=tuple(mesh.axis_names),
                global_batch_size=cfg.trainer.batch_size,
                grad_impl=impl,
                zero_stage=stage,
            )
            batch = trainer.global_batch(next(iter(task.batches(cfg.trainer.batch_size, seed=0))))
            state = trainer.init(trainer.init_params(jax.device_get(batch)))
            state, _ = trainer.step(state, batch, with_stats=False)  # compiles
            jax.block_until_ready(state)
            name = f"{impl}/zero{stage}"
            out["variants"][name] = _variant(trainer, state, n)
            if timed:
                loops.append(_Loop(name, trainer, state, batch))
    if not timed:
        return out
    timings = interleave(loops, Plan(1, 2, 1) if smoke else Plan(1, 8, 3))
    for impl in impls:
        base = timings[f"{impl}/zero0"]
        for stage in stages:
            t = timings[f"{impl}/zero{stage}"]
            out["variants"][f"{impl}/zero{stage}"]["step"] = t.summary()
            out["variants"][f"{impl}/zero{stage}"]["vs_replicated"] = ratio(t, base)
    return out


def _kib(b: int | None) -> str:
    return "-" if b is None else f"{b / 1024:,.1f}"


def _run_line(meta: dict[str, Any]) -> str:
    return (
        f"{meta.get('mode')} run on {meta.get('device_count')} {meta.get('platform')} devices "
        f"({meta.get('cpus_usable')} usable CPUs), jax {meta.get('jax_version')}, "
        f"{meta.get('date_utc')}, commit {meta.get('git_commit')}"
    )


def render(results: dict[str, Any]) -> str:
    """The results as Markdown: one table per model."""
    lines = ["# ZeRO / FSDP against replicated (`python -m benchmarks.zero`)", ""]
    lines.append(_run_line(results["meta"]))
    for model, sec in results["models"].items():
        lines += [
            "",
            (
                f"## {model} ({sec['devices']} data shards; "
                f"params {_kib(next(iter(sec['variants'].values()))['params_bytes_logical'])}"
                " KiB)"
            ),
            "",
            *(
                [f"Measured by `--models {model}`: {_run_line(sec['meta'])}", ""]
                if "meta" in sec
                else []
            ),
            (
                "| variant | params KiB/dev | opt state KiB/dev | args KiB | temps KiB | "
                "collectives (> 16 elements) | sent KiB/dev | ring limit KiB | step ms | "
                "vs zero0 | compile s |"
            ),
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, v in sec["variants"].items():
            c = v.get("compiled") or {}
            ops = ", ".join(f"{k} {n}" for k, n in sorted(v["collectives"].items())) or "none"
            step = v.get("step", {"median_ms": NOT_TIMED})
            lines.append(
                f"| {name} | {_kib(v['params_bytes_per_device'])} | "
                f"{_kib(v['opt_state_bytes_per_device'])} | "
                f"{_kib(c.get('argument_size_in_bytes'))} | {_kib(c.get('temp_size_in_bytes'))} | "
                f"{ops} | {_kib(v['sent_bytes_per_device'])} | {_kib(v['ring_limit_bytes'])} | "
                f"{step.get('median_ms', '-')} | "
                f"{v.get('vs_replicated', {}).get('paired_median', NOT_TIMED)} | "
                f"{v.get('compile_s', '-')} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Runs every model; writes JSON and Markdown; returns the exit status."""
    configure_devices()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.zero", description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny models, one block each")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON path")
    parser.add_argument(
        "--bytes-only",
        action="store_true",
        help="compile each step and count its bytes and collectives, without timing it",
    )
    parser.add_argument(
        "--models",
        type=lambda text: text.split(","),
        help=f"comma-separated subset of {', '.join(MODELS)}, merged into an existing --out",
    )
    parser.add_argument(
        "--impls",
        type=lambda text: tuple(text.split(",")),
        default=IMPLS,
        help=f"comma-separated subset of {', '.join(IMPLS)} (default: both)",
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.models or ()) - set(MODELS))
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from {list(MODELS)}")
    if not args.impls or set(args.impls) - set(IMPLS):
        parser.error(f"--impls={','.join(args.impls)}: choose from {','.join(IMPLS)}")
    # --smoke shrinks every model to the same one (SMOKE): measuring it once is enough.
    chosen = list(MODELS.items())[:1] if args.smoke else MODELS.items()
    if args.models:
        chosen = [(m, MODELS[m]) for m in args.models]
    models = {
        m: measure(m, o, args.smoke, timed=not args.bytes_only, impls=args.impls) for m, o in chosen
    }
    mode = "smoke" if args.smoke else "full"
    meta = {**environment(), "mode": f"{mode} bytes-only" if args.bytes_only else mode}
    results = {"meta": meta, "models": models}
    if args.models and args.out.exists():  # a subset: its sections replace those measured before
        results = json.loads(args.out.read_text())
        results["models"] |= {m: {**sec, "meta": meta} for m, sec in models.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    markdown = render(results)
    args.out.with_suffix(".md").write_text(markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
