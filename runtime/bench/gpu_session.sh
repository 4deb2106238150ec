#!/usr/bin/env bash
# One GPU-machine session: correctness, then the workloads, each stage with its own time limit, a
# table at the end. Run from the repo root on the GPU machine: `bash runtime/bench/gpu_session.sh
# STAGE...`; results land in $OUT (or ./bench_results). One device call runs at most 10 minutes,
# so split a session, e.g. `w2 w2warm w1 tests` | `kernels w2hf w1hf`. Stages:
#   w2, w2warm        W2 cold (empty --cache-dir) and again warm; w2l2 / w1l2 at --compilation-level 2
#   w1                W1; w1fp8kv with --kv-cache-dtype fp8; w1so with a JSON-schema constraint on
#                     every request (needs QWEN3_TOKENIZER); w2cublas with the skinny GEMMs off;
#                     w1sothreads: w1so with 4, 8 and 14 mask-fill threads (RANKSERVE_GRAMMAR_THREADS);
#                     w1sofill: w1so filling every mask row (RANKSERVE_GRAMMAR_REUSE_MASKS=0, the
#                     A/B of the row reuse); gbench: the CPU benchmark of the masks' host cost
#                     (runtime/bench/grammar.py); grows: its per-row fill cost by matcher state
#   w2hf, w1hf        the same workloads on transformers
#   w2fp8, w2gptq     W2 with FP8 weights (--quantization fp8: per channel) / GPTQ 4-bit (g128 sym,
#                     llama-3.1-8b-gptq); w2fp8blk block FP8 (llama-3.1-8b-fp8block, as Qwen3-FP8);
#                     the same with the tensor-core skinny kernels (RANKSERVE_QUANT_TC_MAX_M=16):
#                     w2fp8tc, w2gptqtc, w2fp8blktc (about 40 s each with a warm cache)
#   ktc               tensor-core vs current quantized skinny GEMMs (correctness table first, then
#                     us / TB/s beside the floor; Llama-8B and DeepSeek-V3 shapes; ~1-2 min);
#                     tctests the GPU tests of kernels/quant_tc.py
#   tests, e2e2       GPU tests (kernels, skinny GEMMs, graphs/compile vs eager); e2e2 level 2 only
#   sotests           structured-output tests on CUDA (need ../shared/tokenizers/qwen3)
#   kernels, kdecode  kernel benchmark (all / skinny GEMM + prepare_qkv)
#   sleep, kvtier     sleep level 1/2 memory and wake time (Llama-3.1-8B shape); a multi-turn
#                     workload over a 2048-block device cache without and with a 32 GiB host tier
#   sleeptests        sleep / host-tier GPU tests
#   preempt           W1 over a 4096-block device cache (heavy preemption) with a 16 GiB host tier:
#                     --preemption-mode by the cost model (preemptauto), swap, recompute
#   launchtests       srun-style ranks without MPI over NCCL (needs 2 GPUs)
#   servew1           `rankserve serve` (Qwen3-0.6B shape) + `rankserve bench serve` with W1's
#                     lengths at concurrency 256 and Poisson 10/20/40 req/s; servew1dp2 the same
#                     against `mpiexec -n 2 ... --data-parallel-size 2` (2 GPUs)
#   servew1b2k        servew1's concurrency-256 and 40 req/s runs with --max-num-batched-tokens 2048
#                     (shorter mixed prefill+decode steps: ITL p99 against TTFT); servew1bN the
#                     concurrency-256 run at N (servew1b4096); w1bN offline W1 at N; every server
#                     writes RANKSERVE_STEP_LOG (NAME-steps.csv, summarised in NAME-steps.txt)
#   sweepdecode       W1 over split-KV decode tiles (benchmarks/2026-12-05-h200-s10/sweep_decode.py;
#                     SWEEP="64,2,8 128,2,8" picks the configs); sweepdecodew2 the same on W2
#   servew1full       servew1's concurrency-256 run with --cudagraph-mode full; servew1fullbN the same
#                     at --max-num-batched-tokens N; w1full / w1fullbN offline W1 likewise
#   frontend          CPU only: the API process against a fake engine (256 streams, a token each every
#                     5 ms; runtime/bench/frontend.py), with the raw client and with bench serve's
#   dsw2, dsw1        W2 / W1 on deepseek-v3-small (V3 layers and MLA widths, 8 layers, 64 experts,
#                     dummy bf16 weights); dsw2fp8 / dsw1fp8 block FP8; dsw1kv8 the fp8 latent cache;
#                     dskv KV bytes per token (MLA vs GQA); dstests DeepSeek GPU tests; kmla MLA kernels
#   dsw2mtp           W2 on deepseek-v3-small-mtp (the same plus one MTP layer, dummy weights: its
#                     drafts are never accepted, so this is the cost of MTP drafting): plain
#                     (dsw2mtp0), MTP k=1 (dsw2mtp1), k=3 (dsw2mtp3); mtptests the MTP GPU tests (graphs at
#                     levels 1 and 2, and the pause / catch-up test with graphs)
#   w2echo            the speed-up at the 8B shape: llama-3.1-8b-echo (repeats its last token) plain
#                     (w2echo), n-gram k=4 (w2echongram), draft llama-3.1-8b-echo-draft k=4 (w2echodraft):
#                     every draft accepted, speculative decoding's ceiling; w2echot the same at
#                     temperature $ECHO_T (6.5: about 2 of 3 drafts accepted)
#   w1hybrid          W1 on the Nemotron-H-8B shape (hybrid Mamba2 / attention, dummy weights);
#                     w1hybridbf16 with bf16 SSM states (each may take most of a call); hybtests the
#                     hybrid / Mamba2 GPU tests; kmamba the Mamba2 kernel benchmark
#   gputests          dstests hybtests spectests mtptests sleeptests in one pytest ($GPUTESTS: other files)
#   lora              W2 (1 adapter) and W1 (8 rank-16 adapters) beside the base model, Llama-3.1-8B shape
#   klora, loratests  LoRA kernel benchmark (one Llama-8B layer's projections, base vs adapters, CUDA
#                     graphs, bs 1/16/256); the LoRA GPU tests (kernels vs references, engine vs PEFT)
#   w2spec            W2 speculative decoding: plain on repetitive prompts (w2rep), the same without
#                     async scheduling (w2sync), n-gram on them (w2ngram), n-gram on random prompts
#                     (w2ngramrand), a 2-layer dummy draft (w2draft: never accepted, the cost of
#                     verifying); spectests the speculative-decoding GPU tests (verify CUDA graphs)
#   w2eagle           W2 with dummy EAGLE heads of Llama-3.1-8B's shape (llama-3.1-8b-eagle3: one layer,
#                     32k draft vocabulary, the target's layers 2/16/29; llama-3.1-8b-eagle: EAGLE-1):
#                     their drafts are never accepted, so this is the cost of EAGLE drafting (drafting
#                     backs off after misses): plain (w2eagle0), EAGLE-3 k=3 (w2eagle3), EAGLE-1 k=3
#                     (w2eagle1), EAGLE-3 at --compilation-level 2 (w2eagle3l2); eagletests its GPU tests
#   w2specstories     the speed-up on a trained model: stories260K, prompts that tile a 16-token segment,
#                     plain (w2s) / n-gram k=4 (w2sngram)
#   pdl, w1pdl        RANKSERVE_PDL=1 (programmatic dependent launch): pdltests, then w2pdl; w1pdl W1 with it
#   s13tests          session 13's code, never run on a GPU when written: --cudagraph-mode auto across
#                     the families (mixed graphs vs eager tokens), prepare_qkv head blocks, the fused
#                     decode attention (kernel and end to end), the 4-bit MoE kernel
#   moetests          the fused-MoE GPU tests (bf16, FP8 per channel / block, 4-bit); moediag: the
#                     block-FP8 MoE against its reference per tile config (session 16: its GPU test
#                     failed at T = 64 / 1024 on an H100; benchmarks/2026-12-05-s16/moe_fp8_diag.py)
#   thinktests        the thinking-token budget tests on CUDA (async scheduling, graphs: written on CPU)
#   s17tests          session 17's, written on CPU: the thinking budget, the profiler's window on CUDA,
#                     sleep mode (host-tier copy before sleep, level 2 freeing pinned weights), the
#                     logprobs of accepted drafts
#   s14tests          session 14's: the SwiGLU epilogue (kernel, engine tokens), the split-KV
#                     decode that skips empty segments, the LPT decode order
#   w1lpt             W1 with RANKSERVE_DECODE_LPT=1 (decode programs longest context first); compare
#                     with w1
#   layers            benchmarks/2026-12-04-h200-s12/gemv_chain.py --mode layers: 32 Llama-8B decode
#                     layers' GEMVs in a CUDA graph, the production prologues against the SwiGLU
#                     epilogue (and the FP8 rows), us a layer beside the copy ceiling
#   w2swiglu          W2 with RANKSERVE_SWIGLU_EPILOGUE=1 (silu(gate) * up in gate_up's epilogue, down
#                     a plain GEMV); w2fusedswiglu with both; compare with w2
#   w2fused           W2 with RANKSERVE_FUSED_DECODE_MAX_B=8 (q/k RoPE and the KV store inside the
#                     split-KV kernel: prepare_qkv's launch gone); compare with w2
#   mixedtests        --cudagraph-mode full: its GPU tests (graphs vs eager tokens); w1full / servew1full
#                     W1 offline / online (concurrency 256) with it
#   w1prof, w2prof    W1 / W2 with --profile-dir (kernel table in the log, trace beside it; w2fp8prof,
#                     w2gptqprof the quantized W2s); w1ramp:
#                     W1's prefill ramp (steps 2..17, prefix caching off)
#   w2startprof       cProfile of one W2 run: where start-up time goes (top functions by cumulative time)
#   w2importtime      one W2 run under `python -X importtime`: its start-up account line, the top 30
#                     imports by cumulative time, the cost per package (runtime/bench/importtime.py)
#   w2start           W2's start to first token on its own caches, whatever ran before: cold (empty
#                     --cache-dir and TRITON_CACHE_DIR), then warm twice; starttests the start-up
#                     tests on CUDA (a level-1 engine imports no dynamo / sympy / transformers)
# PROFILE_DIR=dir profiles W1 and W2 (kernel table in the log, trace in dir).
set -u
OUT=${OUT:-bench_results}; mkdir -p "$OUT"
CACHE=${RANKSERVE_CACHE_DIR:-/tmp/rankserve-cache}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# every GPU-test stage names each test as it finishes and explains its failures: a stage cut by
# its time limit (session 16's s13tests) still says which test ran last and what failed
export PYTEST_ADDOPTS="${PYTEST_ADDOPTS:-} -vv -rfE --tb=short --durations=10"
# Python bytecode (issue #21): W2's warm `imports` (3-3.9 s) ran torch's large modules ~7x slower
# than its small ones against a CPU machine's run: their sources compiled again in every process
# (no .pyc the image's Python can use, none written: PYTHONDONTWRITEBYTECODE or a read-only
# site-packages). On the CPU machine that costs `imports` 1.05 -> 3.7 s. A writable prefix keeps
# the bytecode from the first process on (this session's first python3 below fills most of it).
python3 -c "import importlib.util as u, os; o = u.find_spec('torch').origin; print('bytecode: the image has',
  'a' if os.path.exists(u.cache_from_source(o)) else 'no', '.pyc of torch; PYTHONDONTWRITEBYTECODE',
  os.environ.get('PYTHONDONTWRITEBYTECODE'), '; PYTHONPYCACHEPREFIX', os.environ.get('PYTHONPYCACHEPREFIX'))"
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/rankserve-pycache}
unset PYTHONDONTWRITEBYTECODE
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
# DEADLINE=epoch seconds: every stage's limit is cut to what is left (one device call, one budget)
run() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  if [ -n "${DEADLINE:-}" ]; then local left=$(( DEADLINE - t0 )); [ $left -lt $limit ] && limit=$left
    [ $limit -le 10 ] && { echo "$name skipped (DEADLINE)" | tee -a "$OUT/summary.txt"; return; }; fi
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  printf '%-10s rc=%-3s %4ss\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" | tee -a "$OUT/summary.txt"
  tail -n 25 "$OUT/$name.log"; }
# W1's lengths for bench serve: 562 × (1 ± 0.822) = [100, 1023], EOS ignored (every length checked)
W1_SERVE="--random-vocab-size 151936 --random-input-len 562 --random-output-len 562 --random-range-ratio 0.822
  --ignore-eos --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --disable-tqdm --save-result
  --result-dir $OUT"
# serve_w1 NAME [LAUNCHER...]: start a server on Qwen3-0.6B's shape ($SERVE_EXTRA added), wait until
# it answers, run the bench serve runs of $SERVE_RUNS ("name:flags;..."), stop it
# The server needs a tokenizer (QWEN3_TOKENIZER) to stream text token by token: without one it has no
# text to send before the last chunk, and TTFT / ITL would time that chunk.
serve_w1() { local name=$1; shift; local d; d=$(mktemp -d); cp runtime/bench/configs/qwen3-0.6b.json "$d/config.json"
  cp "${QWEN3_TOKENIZER:?set QWEN3_TOKENIZER to a Qwen3 tokenizer directory}"/* "$d/"
  local port=$((20000 + RANDOM % 10000)) t0; t0=$(date +%s)
  RANKSERVE_STEP_LOG="$OUT/$name-steps.csv" "$@" "$(command -v python3)" -m rankserve.launch serve "$d" --load-format dummy --max-num-seqs 256 --max-model-len 4096 \
    --cache-dir "$CACHE" --port $port ${SERVE_EXTRA:-} > "$OUT/$name-server.log" 2>&1 &
  local srv=$!
  until python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=5)" 2> /dev/null; do
    if ! kill -0 $srv 2> /dev/null || [ $(( $(date +%s) - t0 )) -gt 300 ]; then
      echo "$name: the server did not start"; tail -n 30 "$OUT/$name-server.log"; kill $srv 2> /dev/null; return; fi
    sleep 2; done
  echo "$name: server ready in $(( $(date +%s) - t0 )) s"
  local runs run_spec; IFS=';' read -ra runs <<< "$SERVE_RUNS"
  for run_spec in "${runs[@]}"; do local rname=${run_spec%%:*} flags=${run_spec#*:}
    run "$name-$rname" 300 python3 -m rankserve.launch bench serve --base-url "http://127.0.0.1:$port" \
      $W1_SERVE $flags --result-filename "$name-$rname.json" --plot "$OUT/$name-$rname.png" --metadata gpus=$GPUS
  done
  python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:$port/metrics', timeout=10).read().decode())" \
    > "$OUT/$name-metrics.txt" 2>&1  # the API side's TTFT / ITL histograms beside the client's
  kill -INT $srv; ( sleep 60; kill -9 $srv 2> /dev/null ) & local killer=$!
  wait $srv; kill $killer 2> /dev/null
  python3 -m rankserve.runtime.bench.steplog "$OUT/$name-steps.csv" | tee "$OUT/$name-steps.txt"; }
for stage in "$@"; do case $stage in
  s13tests) run s13tests 400 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_mixed_graphs.py \
          tests/test_kernels.py tests/test_quant_kernels.py tests/test_quant_moe_w4.py tests/test_gpu.py \
          -k "default_mode or mixed_graphs or prepare or fused_decode or w4a16_linear or match_eager" ;;
  moetests) run moetests 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_quant_kernels.py \
          tests/test_quant_moe_w4.py tests/test_kernels.py -k "fused_moe or moe_w4" ;;
  thinktests) run thinktests 200 python3 -m pytest -q -p no:cacheprovider tests/test_thinking_budget.py ;;
  s17tests) run s17tests 400 python3 -m pytest -q -p no:cacheprovider tests/test_thinking_budget.py \
          tests/test_gpu_sleep.py "tests/test_profiler.py::test_gpu_profile_window_records_kernels" \
          "tests/test_spec_decode_edge.py::test_gpu_stop_in_draft_run_and_seed_beside_drafts" ;;
  s18tests) run s18tests 300 python3 -m pytest -q -p no:cacheprovider tests/test_beam_search.py tests/test_spec_decode_structured.py \
          tests/test_sampling.py ;;
  moediag) run moediag 200 python3 benchmarks/2026-12-05-s16/moe_fp8_diag.py ;;
  layers) run layers 200 python3 benchmarks/2026-12-04-h200-s12/gemv_chain.py --mode layers \
          --out "$OUT/layers.json" ;;
  s14tests) run s14tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gemv.py \
          tests/test_kernels.py tests/test_gpu.py -k "swiglu or split or ops_bf16 or decode or lpt" ;;
  w1lpt) RANKSERVE_DECODE_LPT=1 run w1lpt 170 python3 -m rankserve.launch bench throughput qwen3-0.6b --workload w1 --max-num-seqs 256 \
          --cache-dir "$CACHE" --output-json "$OUT/w1lpt.json" ;;
  w2swiglu) RANKSERVE_SWIGLU_EPILOGUE=1 run w2swiglu 150 python3 -m rankserve.launch bench latency llama-3.1-8b \
          --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 --max-num-seqs 8 --cache-dir "$CACHE" \
          --output-json "$OUT/w2swiglu.json" ;;
  w2fusedswiglu) RANKSERVE_SWIGLU_EPILOGUE=1 RANKSERVE_FUSED_DECODE_MAX_B=8 run w2fusedswiglu 150 python3 -m \
          rankserve.launch bench latency llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 \
          --max-num-seqs 8 --cache-dir "$CACHE" --output-json "$OUT/w2fusedswiglu.json" ;;
  w2fused) RANKSERVE_FUSED_DECODE_MAX_B=8 run w2fused 150 python3 -m rankserve.launch bench latency llama-3.1-8b \
          --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 --max-num-seqs 8 --cache-dir "$CACHE" \
          --output-json "$OUT/w2fused.json" ;;
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
  w1sothreads) for n in 4 8 14; do RANKSERVE_GRAMMAR_THREADS=$n run w1so$n 200 python3 -m rankserve.launch bench \
        throughput qwen3-0.6b --workload w1 --max-num-seqs 256 --cache-dir "$CACHE" --output-json "$OUT/w1so$n.json" \
        --tokenizer "${QWEN3_TOKENIZER:?set QWEN3_TOKENIZER to a Qwen3 tokenizer directory}" --structured-output json; done ;;
  w1sofill) RANKSERVE_GRAMMAR_REUSE_MASKS=0 run w1sofill 200 python3 -m rankserve.launch bench throughput qwen3-0.6b \
        --workload w1 --max-num-seqs 256 --cache-dir "$CACHE" --output-json "$OUT/w1sofill.json" \
        --tokenizer "${QWEN3_TOKENIZER:?set QWEN3_TOKENIZER to a Qwen3 tokenizer directory}" --structured-output json ;;
  grows) run grows 120 python3 -m rankserve.runtime.bench.grammar --rows --num-seqs 256 --steps 60 \
        --tokenizer "${QWEN3_TOKENIZER:?set QWEN3_TOKENIZER to a Qwen3 tokenizer directory}" --output-json "$OUT/grows.json" ;;
  gbench) for f in 5 20; do run gbench$f 120 python3 -m rankserve.runtime.bench.grammar --forward-ms $f --steps 100 \
        --tokenizer "${QWEN3_TOKENIZER:?set QWEN3_TOKENIZER to a Qwen3 tokenizer directory}" --output-json "$OUT/gbench$f.json"; done ;;
  sotests) run sotests 200 python3 -m pytest -q -x tests/test_structured_output.py tests/test_structured_output_reuse.py \
        tests/test_structured_output_fill.py ;;
  w1l2) run w1l2 170 python3 -m rankserve.launch bench throughput qwen3-0.6b --workload w1 --max-num-seqs 256 \
        --compilation-level 2 --cache-dir "$CACHE" --output-json "$OUT/w1l2.json" ;;
  w2cublas) RANKSERVE_SKINNY_MAX_M=0 run w2cublas 100 python3 -m rankserve.launch bench latency llama-3.1-8b \
        --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 --max-num-seqs 8 --cache-dir "$CACHE" \
        --output-json "$OUT/w2cublas.json" ;;
  w2fp8|w2fp8tc|w2gptq|w2gptqtc|w2fp8blk|w2fp8blktc) m=llama-3.1-8b; q=
        case $stage in w2fp8*blk*) m=llama-3.1-8b-fp8block ;; w2fp8*) q="--quantization fp8" ;;
          w2gptq*) m=llama-3.1-8b-gptq ;; esac
        tc=0; [ "${stage%tc}" != "$stage" ] && tc=16
        RANKSERVE_QUANT_TC_MAX_M=$tc run $stage 120 python3 -m rankserve.launch bench latency $m $q --batch-size 1 \
        --input-len 128 --output-len 256 --num-iters 3 --max-num-seqs 8 --cache-dir "$CACHE" --output-json "$OUT/$stage.json" ;;
  ktc) run ktc 240 python3 benchmarks/2026-12-03-h200-s3/tune.py tc ;;
  tctests) run tctests 200 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_quant_tc.py ;;
  w2warm) run w2warm 80 python3 -m rankserve.launch bench latency llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 \
        --num-iters 3 --max-num-seqs 8 --cache-dir "$CACHE" --output-json "$OUT/w2warm.json" ;;
  w1full) run w1full 170 python3 -m rankserve.launch bench throughput qwen3-0.6b --workload w1 --max-num-seqs 256 \
        --cudagraph-mode full --cache-dir "$CACHE" --output-json "$OUT/w1full.json" ;;
  mixedtests) run mixedtests 200 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_mixed_graphs.py ;;
  w1b*) run $stage 170 python3 -m rankserve.launch bench throughput qwen3-0.6b --workload w1 --max-num-seqs 256 \
        --max-num-batched-tokens ${stage#w1b} --cache-dir "$CACHE" --output-json "$OUT/$stage.json" ;;
  sweepdecode) run sweepdecode 400 python3 benchmarks/2026-12-05-h200-s10/sweep_decode.py --cache-dir "$CACHE" ${SWEEP:-} ;;
  sweepdecodew2) run sweepdecodew2 400 python3 benchmarks/2026-12-05-h200-s10/sweep_decode.py --w2 --cache-dir "$CACHE" ${SWEEP:-} ;;
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
  w1hybrid) run w1hybrid 540 python3 -m rankserve.launch bench throughput nemotron-h-8b --workload w1 \
        --max-num-seqs 256 --cache-dir "$CACHE" --output-json "$OUT/w1hybrid.json" ;;
  w1hybridbf16) run w1hybridbf16 540 python3 -m rankserve.launch bench throughput nemotron-h-8b --workload w1 \
        --max-num-seqs 256 --mamba-ssm-cache-dtype auto --cache-dir "$CACHE" --output-json "$OUT/w1hybridbf16.json" ;;
  hybtests) run hybtests 300 python3 -m pytest -q -m gpu tests/test_hybrid.py tests/test_mamba_kernels.py ;;
  kmamba) run kmamba 150 python3 -m rankserve.kernels.benchmark --only mamba --json "$OUT/kmamba.json" ;;
  preempt) for mode in auto swap recompute; do run preempt$mode 200 python3 -m rankserve.launch bench throughput \
        qwen3-0.6b --workload w1 --max-num-seqs 256 --num-gpu-blocks-override 4096 --kv-offload-size 16 \
        $([ $mode = auto ] || echo --preemption-mode $mode) --cache-dir "$CACHE" --output-json "$OUT/preempt$mode.json"; done ;;
  sleeptests) run sleeptests 200 python3 -m pytest -q -m gpu tests/test_gpu_sleep.py tests/test_preemption_mode.py ;;
  launchtests) run launchtests 200 python3 -m pytest -q -m gpu tests/test_launch_gpu.py ;;
  servew1) GPUS=1 SERVE_RUNS=${SERVE_RUNS:-"c256:--num-prompts 256 --max-concurrency 256;r10:--num-prompts 400 --request-rate 10;r20:--num-prompts 400 --request-rate 20;r40:--num-prompts 400 --request-rate 40"} \
        serve_w1 servew1 ;;
  servew1b2k) GPUS=1 SERVE_RUNS=${SERVE_RUNS:-"c256:--num-prompts 256 --max-concurrency 256;r40:--num-prompts 400 --request-rate 40"} \
        SERVE_EXTRA="--max-num-batched-tokens 2048" serve_w1 servew1b2k ;;
  servew1full) # servew1's concurrency-256 run with --cudagraph-mode full (graphs for the mixed steps)
        GPUS=1 SERVE_RUNS=${SERVE_RUNS:-"c256:--num-prompts 256 --max-concurrency 256"} \
        SERVE_EXTRA="--cudagraph-mode full" serve_w1 servew1full ;;
  servew1fullb*) # servew1full at --max-num-batched-tokens N (stage servew1fullbN): shorter mixed steps,
        # measured after a warm-up burst of other prompts (the first burst after start is slower)
        GPUS=1 SERVE_RUNS=${SERVE_RUNS:-"c256:--num-prompts 256 --max-concurrency 256 --num-warmups 256"} \
        SERVE_EXTRA="--cudagraph-mode full --max-num-batched-tokens ${stage#servew1fullb}" serve_w1 $stage ;;
  w1fullb*) run $stage 170 python3 -m rankserve.launch bench throughput qwen3-0.6b --workload w1 --max-num-seqs 256 \
        --cudagraph-mode full --max-num-batched-tokens ${stage#w1fullb} --cache-dir "$CACHE" --output-json "$OUT/$stage.json" ;;
  servew1b*) # servew1's concurrency-256 run with --max-num-batched-tokens N (stage servew1bN)
        GPUS=1 SERVE_RUNS=${SERVE_RUNS:-"c256:--num-prompts 256 --max-concurrency 256"} \
        SERVE_EXTRA="--max-num-batched-tokens ${stage#servew1b}" serve_w1 $stage ;;
  frontend) run frontend 240 python3 -m rankserve.runtime.bench.frontend --tokenizer "${QWEN3_TOKENIZER:?}" \
        --num-requests 1024 --output-json "$OUT/frontend.json"
        run frontendbs 200 python3 -m rankserve.runtime.bench.frontend --tokenizer "$QWEN3_TOKENIZER" --mode e2e \
        --client bench-serve --num-requests 1024 --output-json "$OUT/frontendbs.json" ;;
  servew1dp2) GPUS=2 SERVE_RUNS="c256:--num-prompts 256 --max-concurrency 256;r40:--num-prompts 400 --request-rate 40" \
        SERVE_EXTRA="--data-parallel-size 2" serve_w1 servew1dp2 mpiexec -n 2 ;;
  klora) run klora 80 python3 -m rankserve.kernels.benchmark --only lora --json "$OUT/klora.json" ;;
  loratests) run loratests 100 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_lora_kernels.py tests/test_lora.py ;;
  kmla) run kmla 200 python3 -m rankserve.kernels.benchmark --only mla --json "$OUT/kmla.json" ;;
  dskv) run dskv 60 python3 -m rankserve.runtime.bench.kv_bytes deepseek-v3-small qwen3-30b-a3b llama-3.1-70b ;;
  dstests) run dstests 200 python3 -m pytest -q -m gpu tests/test_deepseek_mla_kernel.py tests/test_deepseek.py ;;
  dsw2|dsw2fp8) m=deepseek-v3-small; [ $stage = dsw2fp8 ] && m=deepseek-v3-small-fp8
        run $stage 240 python3 -m rankserve.launch bench latency $m --batch-size 1 --input-len 128 --output-len 256 \
        --num-iters 3 --max-num-seqs 8 --max-model-len 4096 --cache-dir "$CACHE" --output-json "$OUT/$stage.json" ;;
  dsw1|dsw1fp8|dsw1kv8) m=deepseek-v3-small; [ $stage = dsw1fp8 ] && m=deepseek-v3-small-fp8
        kv=; [ $stage = dsw1kv8 ] && kv="--kv-cache-dtype fp8"
        run $stage 420 python3 -m rankserve.launch bench throughput $m --workload w1 --max-num-seqs 256 \
        --max-model-len 4096 $kv --cache-dir "$CACHE" --output-json "$OUT/$stage.json" ;;
  dsw2mtp) W2="python3 -m rankserve.launch bench latency deepseek-v3-small-mtp --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 --max-num-seqs 8 --max-model-len 4096 --cache-dir $CACHE"
        run dsw2mtp0 200 $W2 --output-json "$OUT/dsw2mtp0.json"
        run dsw2mtp1 200 $W2 --speculative-config '{"method": "mtp", "num_speculative_tokens": 1}' --output-json "$OUT/dsw2mtp1.json"
        run dsw2mtp3 200 $W2 --speculative-config '{"method": "mtp", "num_speculative_tokens": 3}' --output-json "$OUT/dsw2mtp3.json" ;;
  mtptests) run mtptests 300 python3 -m pytest -q -x -m gpu tests/test_spec_decode_mtp.py \
          "tests/test_spec_decode_pause.py::test_gpu_pause_and_catch_up_with_graphs[mtp]" ;;
  w2eagle) W2="python3 -m rankserve.launch bench latency llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 --max-num-seqs 8 --cache-dir $CACHE"
        E3='{"method": "eagle3", "model": "llama-3.1-8b-eagle3", "num_speculative_tokens": 3}'
        E1='{"method": "eagle", "model": "llama-3.1-8b-eagle", "num_speculative_tokens": 3}'
        run w2eagle0 150 $W2 --output-json "$OUT/w2eagle0.json"
        run w2eagle3 180 $W2 --speculative-config "$E3" --output-json "$OUT/w2eagle3.json"
        run w2eagle1 180 $W2 --speculative-config "$E1" --output-json "$OUT/w2eagle1.json"
        run w2eagle3l2 240 $W2 --compilation-level 2 --speculative-config "$E3" --output-json "$OUT/w2eagle3l2.json" ;;
  eagletests) run eagletests 200 python3 -m pytest -q -x -m gpu tests/test_spec_decode_eagle.py ;;
  w2spec) W2="python3 -m rankserve.launch bench latency llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 --max-num-seqs 8 --cache-dir $CACHE"
        NG='{"method": "ngram", "num_speculative_tokens": 4}'
        DM='{"method": "draft_model", "model": "llama-3.1-8b-draft", "num_speculative_tokens": 4}'
        run w2rep 150 $W2 --prompt-kind repeat --output-json "$OUT/w2rep.json"
        run w2sync 150 $W2 --prompt-kind repeat --no-async-scheduling --output-json "$OUT/w2sync.json"
        run w2ngram 150 $W2 --prompt-kind repeat --speculative-config "$NG" --output-json "$OUT/w2ngram.json"
        run w2ngramrand 150 $W2 --speculative-config "$NG" --output-json "$OUT/w2ngramrand.json"
        run w2draft 180 $W2 --speculative-config "$DM" --output-json "$OUT/w2draft.json" ;;
  w2echo) # the speed-up at the 8B shape: llama-3.1-8b-echo (dummy weights that write nothing to the
        # residual stream, tied embeddings: it repeats its last token) and a draft that agrees, so
        # every draft is accepted: speculative decoding's ceiling, beside the same model plain
        W2E="python3 -m rankserve.launch bench latency llama-3.1-8b-echo --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 --max-num-seqs 8 --prompt-kind repeat --cache-dir $CACHE"
        run w2echo 150 $W2E --output-json "$OUT/w2echo.json"
        run w2echongram 150 $W2E --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' --output-json "$OUT/w2echongram.json"
        run w2echodraft 180 $W2E --speculative-config '{"method": "draft_model", "model": "llama-3.1-8b-echo-draft", "num_speculative_tokens": 4}' --output-json "$OUT/w2echodraft.json" ;;
  w2echot) # the same at temperature 6.5: the echo target then repeats its last token with
        # probability about 0.67 (CPU estimate), the acceptance of each greedy draft
        W2E="python3 -m rankserve.launch bench latency llama-3.1-8b-echo --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 --max-num-seqs 8 --prompt-kind repeat --temperature ${ECHO_T:-6.5} --cache-dir $CACHE"
        run w2echot 150 $W2E --output-json "$OUT/w2echot.json"
        run w2echotngram 150 $W2E --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' --output-json "$OUT/w2echotngram.json"
        run w2echotdraft 180 $W2E --speculative-config '{"method": "draft_model", "model": "llama-3.1-8b-echo-draft", "num_speculative_tokens": 4}' --output-json "$OUT/w2echotdraft.json" ;;
  gputests) # the GPU tests of the feature issues in one pytest (parallel processes would each see
        # the others' memory in their memory profile and find no room for a KV cache)
        run gputests 400 python3 -m pytest -q -m gpu -p no:cacheprovider ${GPUTESTS:-tests/test_deepseek_mla_kernel.py \
          tests/test_deepseek.py tests/test_hybrid.py tests/test_mamba_kernels.py tests/test_spec_decode.py tests/test_spec_decode_edge.py \
          tests/test_spec_decode_mtp.py tests/test_spec_decode_eagle.py tests/test_gpu_sleep.py tests/test_preemption_mode.py} ;;
  lora) # 8 rank-16 adapters over W1's requests, 1 adapter on W2, each beside the base model
        L="--enable-lora --max-lora-rank 16"
        for w in w2 w1; do run ${w}base 200 python3 -m rankserve.launch bench throughput llama-3.1-8b --workload $w \
            --cache-dir "$CACHE" --output-json "$OUT/${w}base.json"
          n=1; [ $w = w1 ] && n=8
          run ${w}lora 200 python3 -m rankserve.launch bench throughput llama-3.1-8b --workload $w $L --num-loras $n \
            --max-loras $n --cache-dir "$CACHE" --output-json "$OUT/${w}lora.json"; done ;;
  w2specstories) # the speed-up itself: stories260K (trained, so drafts are accepted) on prompts that tile a
        # 16-token segment, plain / n-gram k=4 (a draft cut from its layers is no use: 4 % of drafts
        # accepted with 3 of its 5 layers, 19 % with 4; no trained pair is available offline)
        W2S="python3 -m rankserve.launch bench latency models/default/stories260K --batch-size 1 --input-len 128 --output-len 256 --num-iters 5 --max-num-seqs 8 --prompt-kind repeat --cache-dir $CACHE"
        run w2s 100 $W2S --output-json "$OUT/w2s.json"
        run w2sngram 100 $W2S --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' --output-json "$OUT/w2sngram.json" ;;
  w2startprof) # where W2's start goes: cProfile of one W2 run (process start to exit), top functions by
        # cumulative time (the engine's own startup line covers only part of start to first token)
        run w2startprof 150 python3 -m cProfile -o "$OUT/w2start.prof" -m rankserve.launch bench latency llama-3.1-8b \
          --batch-size 1 --input-len 128 --output-len 256 --num-iters 1 --num-iters-warmup 0 --max-num-seqs 8 --cache-dir "$CACHE"
        python3 -c "import pstats; pstats.Stats('$OUT/w2start.prof').sort_stats('cumulative').print_stats(60)" \
          > "$OUT/w2startprof-top.log" 2>&1; head -n 90 "$OUT/w2startprof-top.log" | cut -c1-200 ;;
  w2importtime) # what W2's imports cost on this machine (run after w2 so that the compile caches are warm)
        run w2importtime 150 python3 -X importtime -m rankserve.launch bench latency llama-3.1-8b --batch-size 1 \
          --input-len 128 --output-len 256 --num-iters 1 --num-iters-warmup 0 --max-num-seqs 8 --cache-dir "$CACHE"
        grep -E "startup account|start to first token" "$OUT/w2importtime.log" | cut -c1-400
        python3 -m rankserve.runtime.bench.importtime "$OUT/w2importtime.log" 30 ;;
  w2start) d=$(mktemp -d)  # its own compile caches (Triton's too): the first run is cold on any machine
        for r in cold warm warm2; do TRITON_CACHE_DIR="$d/triton" run w2start$r 150 python3 -m rankserve.launch \
          bench latency llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256 --num-iters 1 \
          --num-iters-warmup 0 --max-num-seqs 8 --cache-dir "$d" --output-json "$OUT/w2start$r.json"
          grep -E "startup account|start to first token" "$OUT/w2start$r.log" | cut -c1-400; done ;;
  starttests) run starttests 200 python3 -m pytest -q -s -p no:cacheprovider tests/test_startup.py \
          tests/test_config_readers.py ;;
  pdl) # programmatic dependent launch (RANKSERVE_PDL=1): its GPU tests, then W2 with it (compare with w2)
        run pdltests 150 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_gemv.py tests/test_kernels.py -k "pdl"
        RANKSERVE_PDL=1 run w2pdl 150 python3 -m rankserve.launch bench latency llama-3.1-8b --batch-size 1 --input-len 128 \
          --output-len 256 --num-iters 3 --max-num-seqs 8 --cache-dir "$CACHE" --output-json "$OUT/w2pdl.json" ;;
  w1pdl) RANKSERVE_PDL=1 run w1pdl 170 python3 -m rankserve.launch bench throughput qwen3-0.6b --workload w1 \
          --max-num-seqs 256 --cache-dir "$CACHE" --output-json "$OUT/w1pdl.json" ;;
  w1ramp) # the prefill ramp of W1 (steps 2..17: mixed prefill + decode steps) under the profiler; prefix
        # caching off, or the profiled second run would find every prompt cached
        run w1ramp 200 python3 -m rankserve.launch bench throughput qwen3-0.6b --workload w1 --max-num-seqs 256 \
          --no-enable-prefix-caching --cache-dir "$CACHE" --profile-dir "$OUT/prof-w1ramp" --profile-steps 2 16 ;;
  w1prof|w2prof|w2gptqprof|w2fp8prof) # a window of steady-state steps under the profiler: the kernel table (where the time goes)
        if [ $stage = w1prof ]; then B="throughput qwen3-0.6b --workload w1 --max-num-seqs 256"
        else m=llama-3.1-8b; [ $stage = w2gptqprof ] && m=llama-3.1-8b-gptq; [ $stage = w2fp8prof ] && m="$m --quantization fp8"
          B="latency $m --batch-size 1 --input-len 128 --output-len 256 --num-iters 2 --max-num-seqs 8"; fi
        run $stage 200 python3 -m rankserve.launch bench $B --cache-dir "$CACHE" --profile-dir "$OUT/prof-$stage" ;;
  spectests) run spectests 300 python3 -m pytest -q -x -m gpu tests/test_spec_decode.py tests/test_spec_decode_pause.py tests/test_spec_decode_edge.py ;;
  *) echo "unknown stage $stage" ;;
esac; done
echo "== summary"; cat "$OUT/summary.txt"
