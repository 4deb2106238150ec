#!/bin/bash
# One device call (the lent GPU machine): `BUDGET=s bash runtime/bench/device_run.sh 'gs STAGE...' 'g NAME LIMIT CMD...'`
# after `bash ../shared/gpu/wheels.sh` (carry .whl; drop wheels the benches never import to stay under
# the 64 MiB tree limit) and a Qwen3 tokenizer copied to .gpu/qwen3tok (carry .gpu). Results go to
# bench_results/ (the device returns at most 8 files from $OUT: end the call with
# `tar czf $OUT/logs.tgz bench_results`).
# gs: stages of runtime/bench/gpu_session.sh; g: one command under its own limit. DEADLINE cuts every limit.
set -u
. .whl/gpu-env.sh || { echo "gpu-env failed"; exit 1; }
export QWEN3_TOKENIZER=$PWD/.gpu/qwen3tok OUT=bench_results PYTHONUNBUFFERED=1
export DEADLINE=$(( $(date +%s) + ${BUDGET:-540} ))
mkdir -p "$OUT"
for spec in "$@"; do
  read -r kind rest <<< "$spec"
  case $kind in
    gs) bash runtime/bench/gpu_session.sh $rest 2>&1 | grep -v '^== summary' ;;
    g) read -r name limit cmd <<< "$rest"; t0=$(date +%s); left=$(( DEADLINE - t0 )); [ $left -lt $limit ] && limit=$left
       if [ $limit -le 10 ]; then echo "$name skipped (DEADLINE)"; continue; fi
       timeout $limit bash -c "$cmd" > "$OUT/$name.log" 2>&1; rc=$?
       printf '%-12s rc=%-3s %4ss\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" | tee -a "$OUT/summary.txt"; tail -n 30 "$OUT/$name.log" ;;
  esac
done
echo "== all"; cat "$OUT/summary.txt"
