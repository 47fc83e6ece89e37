#!/usr/bin/env bash
# xshard on an accelerator, in one go (docs/benchmarks.md, "On a GPU or TPU"):
#
#   bash benchmarks/device_check.sh [--dry-run] [--out PATH]
#
# For a machine with JAX for its accelerator, flax, optax, orbax and tensorboard installed, and
# no network: installs xshard's other dependencies from the wheels beside this script
# (benchmarks/wheels, filled by `make device-wheels` on a machine with network), then
#   1. benchmarks.device_probe: the compiled step's dot dtypes (fp32, bf16), bf16 against fp32,
#      tokens/s and MFU of the 8x256 GPT, and whether grad_impl=gspmd with ZeRO-2 compiles a
#      reduce-scatter on these devices;
#   2. a CLI run of the 8x256 GPT in bf16 on every device (mesh=auto), with
#      logger.peak_flops_per_device for the device (its summary has the compile time);
#   3. the tests that mean something there: cross-shard semantics, ZeRO exactness, bf16,
#      checkpoints (on 8 simulated CPU devices of the same host: the installed stack);
# and writes every result into one JSON file (default benchmarks/device_results.json).
# Each stage has a time limit; the whole check stays under 8 minutes.
#
# --dry-run: no install, the probe with a tiny GPT on this machine, the CLI run and the tests
# only listed: checks the script works (tests/test_device_check.py runs it on CPU).
set -euo pipefail

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
cd "$ROOT"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# What is missing there: Hydra and its pinned parser, tensorboardX, grain (pyproject.toml).
MISSING=(hydra-core omegaconf "antlr4-python3-runtime==4.9.3" tensorboardX grain)
TESTS=(tests/test_cross_shard.py tests/test_cross_shard_options.py tests/test_zero.py
       tests/test_precision.py tests/test_checkpoints.py)

stage() { echo "== device_check: $*" >&2; }

stage "install ${MISSING[*]} from $HERE/wheels"
if [ "$DRY" = 1 ]; then
  echo "would run: $PY -m pip install --no-index --find-links $HERE/wheels ${MISSING[*]}" >&2
else
  "$PY" -m pip install --quiet --no-index --find-links "$HERE/wheels" "${MISSING[@]}"
fi

stage "probe (dots, bf16 vs fp32, MFU, ZeRO-2 reduce-scatter)"
PROBE_ARGS=(--out "$WORK/probe.json")
[ "$DRY" = 1 ] && PROBE_ARGS+=(--smoke)
timeout 240 "$PY" -m benchmarks.device_probe "${PROBE_ARGS[@]}"
PEAK="$("$PY" -c 'import json,sys; v=json.load(open(sys.argv[1]))["peak_flops_per_device"]; print(v or "null")' "$WORK/probe.json")"

stage "CLI: the 8x256 GPT in bf16 (logger.peak_flops_per_device=$PEAK)"
CLI=("$PY" -m trainers.train mesh=auto precision=bf16 task.n_layers=8 task.d_model=256
     task.d_ff=1024 task.n_heads=8 trainer.steps=100 trainer.progress=false
     "logger.peak_flops_per_device=$PEAK" "trainer.compilation_cache_dir=$WORK/jax_cache"
     "hydra.run.dir=$WORK/run")
if [ "$DRY" = 1 ]; then
  echo "would run: ${CLI[*]}" >&2
  echo "dry run: not run" > "$WORK/cli.txt"
else
  timeout 150 "${CLI[@]}" > "$WORK/cli.txt" 2>&1 || echo "exit $?" >> "$WORK/cli.txt"
fi

stage "tests: ${TESTS[*]}"
if [ "$DRY" = 1 ]; then
  echo "would run: $PY -m pytest ${TESTS[*]} -q -m 'not slow'" >&2
  echo "dry run: not run" > "$WORK/tests.txt"
else
  timeout 240 "$PY" -m pytest "${TESTS[@]}" -q -m 'not slow' -p no:cacheprovider \
    > "$WORK/tests.txt" 2>&1 || true
fi

"$PY" - "$WORK" "$OUT" "$DRY" <<'PYEOF'
import json, sys, pathlib
work, out, dry = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
tail = lambda name: (work / name).read_text().splitlines()[-15:]
result = {
    "dry_run": dry,
    "probe": json.loads((work / "probe.json").read_text()),
    "cli_bf16_gpt_8x256": tail("cli.txt"),
    "tests": tail("tests.txt"),
}
pathlib.Path(out).write_text(json.dumps(result, indent=2) + "\n")
print(f"device_check: results in {out}")
PYEOF
