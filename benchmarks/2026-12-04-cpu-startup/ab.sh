#!/bin/bash
# A/B of the W2 config phase (llama-3.1-8b config: read + meta parameter count) and a tiny
# bench latency start (stories260K config, dummy weights, CPU): BASE (default 2da9d05, run from a
# plain copy on PYTHONPATH) vs the checked-out tree. Run from the repository root.
N=${N:-3}; BASE=${BASE:-2da9d05}; PY=${PY:-python}; D=$(mktemp -d)
git archive "$BASE" | tar -x -C "$D" && mkdir -p "$D/pkg/rankserve" && cp -r "$D/launch/_root/." "$D/pkg/rankserve/"
for p in launch runtime models kernels; do ln -s "$D/$p" "$D/pkg/rankserve/$p"; done
mkdir -p "$D/model" && cp models/default/stories260K/config.json "$D/model/"
CLI='import sys; from rankserve.launch.cli import main; sys.argv[0] = "rankserve"; main()'
for rep in $(seq $N); do
  for v in base new; do
    if [ $v = base ]; then export PYTHONPATH=$D/pkg; else unset PYTHONPATH; fi
    c=$(mktemp -d)
    for s in cold warm; do
      echo "$v $s cfg $($PY benchmarks/2026-12-04-cpu-startup/cfgphase.py llama-3.1-8b $c 2>/dev/null)"
    done
    c=$(mktemp -d)
    for s in cold warm; do
      echo "$v $s bench $($PY -c "$CLI" bench latency $D/model --device cpu --load-format dummy --batch-size 1 \
        --input-len 8 --output-len 8 --cache-dir $c --max-model-len 64 2>&1 | grep 'start to first token' | head -1)"
    done
  done
done
