#!/usr/bin/env bash
# xshard on an accelerator, in one go (docs/benchmarks.md, "On a GPU or TPU"):
#
#   bash benchmarks/device_check.sh [--dry-run] [--out PATH]
#
# For a machine with JAX for its accelerator, flax, optax, orbax and tensorboard installed, and
# no network: installs xshard's other dependencies from the wheels beside this script
# (benchmarks/wheels, filled by `make device-wheels` on a machine with network), then runs, each
# stage under its own time limit (the whole under DEVICE_CHECK_BUDGET_S, default 470 s):
#   1. probe       benchmarks.device_probe ON THE ACCELERATOR: the compiled step's dot dtypes
#                  (fp32, bf16), bf16 against fp32 losses, ZeRO-2 with grad_impl=gspmd compiles
#                  a reduce-scatter (with more than one device), a checkpoint round trip;
#   1b. zero_bytes benchmarks.zero --bytes-only --impls gspmd ON THE ACCELERATOR (mesh=auto): the
#                  compiled ZeRO steps of the 8x256 GPT with adam and muon, stages 0-3, their
#                  collectives and bytes sent per device against the ring limit (XLA:CPU
#                  all-reduces the gradient there, 1.5x; a reduce-scatter gives 1.0x;
#                  docs/scaling.md); with one device there is nothing to count;
#   2. throughput  benchmarks.gpt_throughput ON THE ACCELERATOR: tokens/s and MFU of the 8x256
#                  GPT and of a 24x1024 GPT, fp32 and bf16, xshard's step against a
#                  hand-written jax.jit step;
#   3. cli         a CLI run of the 8x256 GPT in bf16 on every device (mesh=auto) with
#                  logger.peak_flops_per_device for the device (its summary: compile time, MFU);
#   4. memory      benchmarks.precision_memory ON THE ACCELERATOR: memory and step time of fp32,
#                  bf16 and bf16 + remat policies (the device's own peak bytes in use);
#   5. population  benchmarks.population ON THE ACCELERATOR (mesh=auto): the 8-trial sweep of
#                  task=mlp, 20 steps: one trial alone, hydra/launcher=population, Hydra's
#                  basic launcher (wall time, compile time, final losses);
#   6. tests       cross-shard semantics, ZeRO exactness, bf16, checkpoints: tests/conftest.py
#                  puts them on 8 simulated CPU DEVICES of this host, so they check the
#                  installed packages, not the accelerator.
# A stage that fails or runs out of time is recorded (its exit status, 124 for the time limit,
# and its log's last lines) and the next one runs; a stage the budget has no room for is
# skipped. One JSON file gets every result (default benchmarks/device_results.json).
#
# --dry-run: no install; the probe and the throughput on a tiny GPT, and a population of 2
# trials of 3 steps, on this machine; the other stages only listed. Checks the script works (tests/test_device_check.py runs it on CPU).
set -uo pipefail  # no -e: a failed stage is recorded, and the next one runs

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
PY="${PYTHON:-python3}"
OUT="$HERE/device_results.json"
DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --out) OUT="$2"; shift ;;
    *) echo "device_check.sh: unknown argument $1 (--dry-run, --out PATH)" >&2; exit 2 ;;
  esac
  shift
done
BUDGET="${DEVICE_CHECK_BUDGET_S:-470}"
[ "$DRY" = 1 ] && BUDGET="${DEVICE_CHECK_BUDGET_S:-900}"  # CPU compiles are slow
cd "$ROOT"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
STAGES="$WORK/stages.tsv"
: > "$STAGES"
# What is missing there: Hydra and its pinned parser, tensorboardX (and its native CRC), grain
# (pyproject.toml).
MISSING=(hydra-core omegaconf "antlr4-python3-runtime==4.9.3" tensorboardX crc32c grain)
TESTS=(tests/xshard/test_cross_shard.py tests/xshard/test_cross_shard_options.py
       tests/trainers/core/test_zero.py tests/trainers/core/test_precision.py
       tests/trainers/checkpoint/test_checkpoints.py)

# run_stage NAME LIMIT_S CMD...: CMD under `timeout` (LIMIT_S, less if the budget has less
# left), its output in $WORK/NAME.log; records NAME, exit status and seconds in $STAGES.
run_stage() {
  local name="$1" limit="$2"
  shift 2
  local left=$((BUDGET - SECONDS - 15))  # 15 s kept for writing the results
  if [ "$left" -lt 20 ]; then
    echo "== device_check: $name skipped (budget spent)" >&2
    printf '%s\tskipped\t0\n' "$name" >> "$STAGES"
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit="$left"
  echo "== device_check: $name (at most ${limit} s)" >&2
  local start=$SECONDS rc=0
  timeout --kill-after=10 "$limit" "$@" > "$WORK/$name.log" 2>&1 || rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" >> "$STAGES"
  [ "$rc" = 0 ] || echo "== device_check: $name exited $rc (124: time limit)" >&2
  return 0
}

# dry NAME CMD...: in a dry run, lists CMD as stage NAME instead of running it.
dry() {
  local name="$1"
  shift
  echo "would run: $*" >&2
  echo "dry run: not run" > "$WORK/$name.log"
  printf '%s\tdry-run\t0\n' "$name" >> "$STAGES"
}

INSTALL=("$PY" -m pip install --quiet --no-index --find-links "$HERE/wheels" "${MISSING[@]}")
if [ "$DRY" = 1 ]; then
  dry install "${INSTALL[@]}"
elif "$PY" -c 'import hydra, omegaconf, tensorboardX, crc32c, grain' 2> /dev/null; then
  echo "already installed" > "$WORK/install.log"
  printf 'install\t0\t0\n' >> "$STAGES"
else
  run_stage install 90 "${INSTALL[@]}"
fi

QUICK=()
[ "$DRY" = 1 ] && QUICK=(--smoke)
run_stage probe 150 "$PY" -m benchmarks.device_probe --out "$WORK/probe.json" ${QUICK[@]+"${QUICK[@]}"}
PEAK="$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["peak_flops_per_device"] or "null")' \
  "$WORK/probe.json" 2> /dev/null || echo null)"

ZERO=("$PY" -m benchmarks.zero --bytes-only --impls gspmd --models gpt_8x256,gpt_8x256_muon
      --out "$WORK/zero.json")
if [ "$DRY" = 1 ]; then
  dry zero_bytes "${ZERO[@]}"
else
  run_stage zero_bytes 120 "${ZERO[@]}"
fi

[ "$DRY" = 1 ] && QUICK=(--quick)
run_stage throughput 200 "$PY" -m benchmarks.gpt_throughput --out "$WORK/throughput.json" ${QUICK[@]+"${QUICK[@]}"}

CLI=("$PY" -m trainers.train mesh=auto precision=bf16 task.n_layers=8 task.d_model=256
     task.d_ff=1024 task.n_heads=8 trainer.steps=100 trainer.progress=false
     "logger.peak_flops_per_device=$PEAK" "trainer.compilation_cache_dir=$WORK/jax_cache"
     "hydra.run.dir=$WORK/run")
MEMORY=("$PY" -m benchmarks.precision_memory --out "$WORK/memory.json")
PYTEST=("$PY" -m pytest "${TESTS[@]}" -q -m 'not slow' -p no:cacheprovider)
if [ "$DRY" = 1 ]; then
  dry cli "${CLI[@]}"
  dry memory "${MEMORY[@]}"
  QUICK=(--smoke)
else
  run_stage cli 90 "${CLI[@]}"
  run_stage memory 90 "${MEMORY[@]}"
  QUICK=(--steps 20)
fi
run_stage population 120 "$PY" -m benchmarks.population --out "$WORK/population.json" \
  --override mesh=auto "${QUICK[@]}"
if [ "$DRY" = 1 ]; then
  dry tests "${PYTEST[@]}"
else
  run_stage tests 90 "${PYTEST[@]}"
fi

# One JSON file whatever happened above: each stage's status and seconds, its JSON (if it
# wrote one) and the last lines of its log.
"$PY" - "$WORK" "$OUT" "$DRY" "$SECONDS" << 'PYEOF'
import json, sys, pathlib
work, out, dry, seconds = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1", sys.argv[4]

def read_json(name):
    try:
        return json.loads((work / name).read_text())
    except (OSError, ValueError):
        return None

def tail(name):
    try:
        return (work / name).read_text(errors="replace").splitlines()[-20:]
    except OSError:
        return []

stages = {}
for line in (work / "stages.tsv").read_text().splitlines():
    name, status, secs = line.split("\t")
    stages[name] = {"exit": status, "seconds": int(secs), "log_tail": tail(f"{name}.log")}
result = {
    "dry_run": dry,
    "seconds": int(seconds),
    "stages": stages,
    "probe": read_json("probe.json"),
    "zero_bytes": read_json("zero.json"),
    "throughput": read_json("throughput.json"),
    "memory": read_json("memory.json"),
    "population": read_json("population.json"),
}
pathlib.Path(out).write_text(json.dumps(result, indent=2) + "\n")
print(f"device_check: results in {out}")
PYEOF
