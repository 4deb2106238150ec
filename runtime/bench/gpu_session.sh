#!/usr/bin/env bash
# One GPU-machine session: correctness, then the two standard workloads, with a table at the end.
# Run from the repo root on the GPU machine: `bash runtime/bench/gpu_session.sh STAGE` where STAGE
# is one of: w2 w2warm w2l2 w2cublas w1 w1l2 w1fp8kv w1so sotests w2hf w1hf tests e2e2 kernels kdecode
# sleep kvtier sleeptests w2spec spectests (several may be given; w2/w1 run the default level (1 on CUDA),
# w2l2/w1l2 --compilation-level 2; w1fp8kv = W1 with --kv-cache-dtype fp8 (compare with w1);
# e2e2 = the level-2 end-to-end tests alone; w1so = W1 with a JSON-schema constraint on every
# request (needs QWEN3_TOKENIZER; compare with w1); sotests = the structured-output tests on CUDA
# (they need ../shared/tokenizers/qwen3 beside the repo); w2cublas = W2 with the skinny decode GEMMs off;
# kdecode = the kernel benchmark's skinny-GEMM and prepare_qkv parts; sleep = device memory before/after
# sleep level 1 and 2 and the time to wake up, Llama-3.1-8B shape with dummy weights; kvtier = a
# multi-turn shared-prefix workload larger than a 2048-block device KV cache, without and with a
# 32 GiB host tier (TTFT, throughput, hits per tier); sleeptests = the sleep / host-tier GPU tests;
# w2spec = W2 speculative decoding: plain on repetitive prompts (w2rep), the same without async
# scheduling (w2sync: speculation turns it off, this is its share of any slowdown), n-gram on them (w2ngram),
# n-gram on random prompts (w2ngramrand: lookups that rarely hit), a 2-layer dummy draft model
# (w2draft: dummy weights, so drafts are never accepted: the cost of verifying them);
# spectests = the speculative-decoding GPU tests (verify CUDA graphs)). Results land in $OUT
# (or ./bench_results). Each stage has its own time limit; one device call runs at most 10
# minutes, so split a session, e.g.: `w2 w2warm w1 tests` | `kernels w2hf w1hf`. w2 is the cold
# start (empty --cache-dir), w2warm the same command again (the cache matters at level 2).
# PROFILE_DIR=dir profiles W1 and W2 (kernel table in the log, trace in dir).
set -u
OUT=${OUT:-bench_results}; mkdir -p "$OUT"
CACHE=${RANKSERVE_CACHE_DIR:-/tmp/rankserve-cache}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
run() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  printf '%-10s rc=%-3s %4ss\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" | tee -a "$OUT/summary.txt"
  tail -n 25 "$OUT/$name.log"; }
for stage in "$@"; do case $stage in
  w2) run w2 150 python3 -m rankserve.launch bench latency llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 \
        --num-iters 3 --max-num-seqs 8 --cache-dir "$CACHE" --output-json "$OUT/w2.json" \
        ${PROFILE_DIR:+--profile-dir "$PROFILE_DIR"} ;;
  w2l2) run w2l2 150 python3 -m rankserve.launch bench latency llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 \
        --num-iters 3 --max-num-seqs 8 --compilation-level 2 --cache-dir "$CACHE" --output-json "$OUT/w2l2.json" ;;
  w1fp8kv) run w1fp8kv 170 python3 -m rankserve.launch bench throughput qwen3-0.6b --workload w1 --max-num-seqs 256 \
        --kv-cache-dtype fp8 --cache-dir "$CACHE" --output-json "$OUT/w1fp8kv.json" ;;
  w1so) run w1so 200 python3 -m rankserve.launch bench throughput qwen3-0.6b --workload w1 --max-num-seqs 256 \
        --tokenizer "${QWEN3_TOKENIZER:?set QWEN3_TOKENIZER to a Qwen3 tokenizer directory}" \
        --structured-output json --cache-dir "$CACHE" --output-json "$OUT/w1so.json" ;;
  sotests) run sotests 200 python3 -m pytest -q -x tests/test_structured_output.py ;;
  w1l2) run w1l2 170 python3 -m rankserve.launch bench throughput qwen3-0.6b --workload w1 --max-num-seqs 256 \
        --compilation-level 2 --cache-dir "$CACHE" --output-json "$OUT/w1l2.json" ;;
  w2cublas) RANKSERVE_SKINNY_MAX_M=0 run w2cublas 100 python3 -m rankserve.launch bench latency llama-3.1-8b \
        --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 --max-num-seqs 8 --cache-dir "$CACHE" \
        --output-json "$OUT/w2cublas.json" ;;
  w2warm) run w2warm 80 python3 -m rankserve.launch bench latency llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 \
        --num-iters 3 --max-num-seqs 8 --cache-dir "$CACHE" --output-json "$OUT/w2warm.json" ;;
  w1) run w1 170 python3 -m rankserve.launch bench throughput qwen3-0.6b --workload w1 --max-num-seqs 256 \
        --cache-dir "$CACHE" --output-json "$OUT/w1.json" ${PROFILE_DIR:+--profile-dir "$PROFILE_DIR"} ;;
  w2hf) run w2hf 200 python3 -m rankserve.launch bench latency llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 \
        --num-iters 2 --backend hf --output-json "$OUT/w2hf.json" ;;
  w1hf) run w1hf 300 python3 -m rankserve.launch bench throughput qwen3-0.6b --num-prompts 32 --input-len 100 1024 \
        --output-len 100 1024 --backend hf --output-json "$OUT/w1hf.json" ;;
  tests) run tests 280 python3 -m pytest -q -m gpu tests/test_kernels.py tests/test_gemv.py tests/test_gpu.py ;;
  e2e2) run e2e2 100 python3 -m pytest -q -x -m gpu tests/test_gpu.py -k "match_eager and 2" ;;
  kernels) run kernels 240 python3 -m rankserve.kernels.benchmark --json "$OUT/kernels.json" ;;
  kdecode) run kdecode 150 python3 -m rankserve.kernels.benchmark --only skinny prepare_qkv --json "$OUT/kdecode.json" ;;
  sleep) run sleep 300 python3 -m rankserve.launch bench sleep llama-3.1-8b --max-num-seqs 64 \
        --cache-dir "$CACHE" --output-json "$OUT/sleep.json" ;;
  kvtier) for gib in 0 32; do run kvtier$gib 300 python3 -m rankserve.launch bench multiturn llama-3.1-8b \
        --num-gpu-blocks-override 2048 --max-model-len 4096 --max-num-seqs 64 --num-conversations 32 \
        --prefix-len 2048 --turns 4 --turn-len 64 --output-len 64 --concurrency 4 --kv-offload-size $gib \
        --cache-dir "$CACHE" --output-json "$OUT/kvtier$gib.json"; done ;;
  sleeptests) run sleeptests 200 python3 -m pytest -q -m gpu tests/test_gpu_sleep.py ;;
  w2spec) W2="python3 -m rankserve.launch bench latency llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 --max-num-seqs 8 --cache-dir $CACHE"
        NG='{"method": "ngram", "num_speculative_tokens": 4}'
        DM='{"method": "draft_model", "model": "llama-3.1-8b-draft", "num_speculative_tokens": 4}'
        run w2rep 150 $W2 --prompt-kind repeat --output-json "$OUT/w2rep.json"
        run w2sync 150 $W2 --prompt-kind repeat --no-async-scheduling --output-json "$OUT/w2sync.json"
        run w2ngram 150 $W2 --prompt-kind repeat --speculative-config "$NG" --output-json "$OUT/w2ngram.json"
        run w2ngramrand 150 $W2 --speculative-config "$NG" --output-json "$OUT/w2ngramrand.json"
        run w2draft 180 $W2 --speculative-config "$DM" --output-json "$OUT/w2draft.json" ;;
  spectests) run spectests 300 python3 -m pytest -q -x -m gpu tests/test_spec_decode.py ;;
  *) echo "unknown stage $stage" ;;
esac; done
echo "== summary"; cat "$OUT/summary.txt"
