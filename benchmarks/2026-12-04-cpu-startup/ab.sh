#!/bin/bash
# A/B of the W2 config phase (llama-3.1-8b config: read + meta parameter count) and a tiny
# bench latency start (stories260K config, dummy weights, CPU): base (2da9d05) vs this branch
N=${N:-3}
for rep in $(seq $N); do
  for v in base new; do
    if [ $v = base ]; then export PYTHONPATH=/tmp/st/basepkg; else unset PYTHONPATH; fi
    c=$(mktemp -d)
    for s in cold warm; do
      echo "$v $s cfg $(/work/venv-st/bin/python benchmarks/2026-12-04-cpu-startup/cfgphase.py llama-3.1-8b $c 2>/dev/null)"
    done
    c=$(mktemp -d)
    for s in cold warm; do
      echo "$v $s bench $(/work/venv-st/bin/python -c "import sys; from rankserve.launch.cli import main; sys.argv[0]=\"rankserve\"; main()" bench latency /tmp/st/model --device cpu --load-format dummy --batch-size 1 --input-len 8 --output-len 8 --cache-dir $c --max-model-len 64 2>&1 | grep 'start to first token' | head -1)"
    done
  done
done
