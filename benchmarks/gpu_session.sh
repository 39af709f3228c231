#!/usr/bin/env bash
# One device session stage: build the CUDA extension, run the GPU tests, run benchmarks.
# Usage: benchmarks/gpu_session.sh STAGE...
#   (stages: env build test kernels bench layer-kernels profile profile-prefill profile-tree e2e e2e-next ttft batch
#    serve e2e-demo world e2e-families invariance mixed multiturn demo-tau)
# Results go to $OUT (or benchmarks/results/raw when OUT is unset).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results/raw}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}   # scripts under benchmarks/ import the in-place build
for stage in "$@"; do
  echo "=== stage $stage $(date -u +%FT%TZ)"
  case $stage in
    env)
      nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
      $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"
      ;;
    build)
      # the image's pip/setuptools cannot do an offline editable install: build in place
      $PY setup.py -q build_ext --inplace 2>&1 | grep -v -i "warn\|deprecat\|^ *\*\|^$\|!!" | tail -15
      [ -L tabed_engine/kernels ] && rm tabed_engine/kernels   # a link left by an older tree
      $PY -c "import tabed_engine.ops._ext as e; print('extension:', e.HAS_EXT, 'cuda kernels:', e.HAS_CUDA_KERNELS)"
      ;;
    test)
      # one process per file: a device fault in one must not poison the CUDA context of the rest
      for f in ${TEST_FILES:-tests/test_*.py}; do
        grep -q "gpu" "$f" || continue
        echo "--- $f"
        timeout 300 $PY -m pytest -m gpu -q -rfE -p no:cacheprovider --timeout=200 "$f" > "$OUT/last.log" 2>&1
        tail -n 14 "$OUT/last.log" | grep -E "passed|failed|error|FAILED|Error" | head -14
        { echo "=== $f"; cat "$OUT/last.log"; } >> "$OUT/gpu_tests.log"
        rm -f "$OUT/last.log"
      done
      ;;
    kernels)
      timeout 280 $PY benchmarks/bench_ensemble_ops.py --time-budget 230 --out "$OUT/ensemble_ops.json" 2>&1 | tail -40
      timeout 240 $PY benchmarks/bench_tree_attention.py --rows 1 8 --prefix 600 2000 --nodes 1 8 32 64 \
        --out "$OUT/tree_attention.json" 2>&1 | tail -25
      timeout 200 $PY benchmarks/bench_tree_attention.py --sweep --rows 1 --prefix 600 2000 --nodes 6 32 64 \
        --out "$OUT/tree_attention_sweep.json" 2>&1 | tail -8
      timeout 120 $PY benchmarks/bench_verify.py --out "$OUT/verify.json" 2>&1 | tail -12
      timeout 100 $PY benchmarks/bench_history_update.py --out "$OUT/history_update.json" 2>&1 | tail -8
      ;;
    bench)
      # every kernel alone at the engine's shapes (pytest-benchmark: GB/s and the copy ceiling in extra_info)
      timeout 500 $PY -m pytest benchmarks/ --benchmark-only -q -p no:cacheprovider \
        --benchmark-json "$OUT/bench_kernels.json" 2>&1 | tail -70
      ;;
    layer-kernels)
      timeout 120 $PY benchmarks/bench_rope_kv_write.py --out "$OUT/rope_kv_write.json" 2>&1 | tail -14
      timeout 120 $PY benchmarks/bench_add_rms_norm.py --out "$OUT/add_rms_norm.json" 2>&1 | tail -14
      timeout 120 $PY benchmarks/bench_silu_mul.py --out "$OUT/silu_mul.json" 2>&1 | tail -8
      # (GEMV_ARGS="--model qwen2-7b --out $OUT/gemv_qwen2.json": the OneVision / Qwen2.5-VL 7B shapes)
      timeout 300 $PY benchmarks/bench_gemv.py --out "$OUT/gemv.json" ${GEMV_ARGS:-} 2>&1 | tail -26
      ;;
    world)
      # the bundled demo pair, trained on the GPU (seeded), packed into one file
      timeout 560 $PY -m benchmarks.world.train --device cuda --out /tmp/world_pair ${WORLD_ARGS:-} --skip-eval \
        2>&1 | grep -E "00/|saved|Error" | tail -30
      tar -C /tmp -cf "$OUT/world_pair.tar" world_pair
      ;;
    profile)
      timeout 300 $PY benchmarks/profile_decode.py --out "$OUT" 2>&1 | tail -45
      ;;
    profile-prefill)
      # the target's prefill by kernel kind, eager and as the engine's graph, at the prompt's length and its bucket
      timeout 300 $PY benchmarks/profile_prefill.py --out "$OUT" 2>&1 | grep -v Warn | tail -60
      ;;
    profile-tree)
      # a tree block's graphs (draft, verification, history) by kernel, beside the chain's
      timeout 300 $PY benchmarks/profile_tree.py --trees 5x3x5 10x3x2 12x2x2 --out "$OUT" 2>&1 | grep -v Warn | tail -40
      ;;
    e2e)
      timeout 540 $PY benchmarks/e2e.py --preset llava-1.5-7b --out "$OUT" \
        --scenario-taus benchmarks/results/tree_scenarios_gpu_fp32{,_seed1,_seed2,_seed3}.json 2>&1 | tail -60
      ;;
    ttft)
      # time to first token: 616 / 1,800 tokens, AR and SD K=1/2/4, prefill graph vs eager,
      # draft views on a second stream or not, the FLOP floor and transformers
      timeout 560 $PY benchmarks/ttft.py --preset llava-1.5-7b --out "$OUT" 2>&1 | tail -50
      ;;
    e2e-next)
      # LLaVA-NeXT target at the llava-v1.6-vicuna-7b shape (672x672 image: 2,928 image tokens)
      # with a LLaVA-1.5-style draft: prefill split, TTFT, AR vs floor and transformers, SD
      # (NEXT_ARGS="--preset llava-v1.6-34b --skip-hf": the Yi-34B target on one GPU, no transformers copy)
      timeout ${NEXT_TIMEOUT:-540} $PY benchmarks/e2e_next.py --out "$OUT" \
        ${NEXT_ARGS:---preset llava-v1.6-vicuna-7b} 2>&1 | tail -45
      ;;
    batch)
      # many requests at once: B in 1/4/16/64, AR vs SD at fixed tau, mixed arrivals
      timeout 560 $PY benchmarks/batch.py --out "$OUT" 2>&1 | tail -40
      ;;
    serve)
      # the HTTP layer against the engine called directly: N = 1/4/16 streams, AR and SD at tau 2.31
      timeout 400 $PY benchmarks/serve.py --out "$OUT" 2>&1 | tail -30
      ;;
    e2e-families)
      # LLaVA-OneVision-7B + 0.5B, Qwen2.5-VL-7B + 3B and -32B + 3B at the published shapes (random
      # weights): TTFT, AR vs the weight floor, SD over chain lengths at tau 2.31, transformers (7B)
      timeout ${FAMILIES_TIMEOUT:-470} $PY benchmarks/e2e_families.py --out "$OUT" --budget-s ${FAMILIES_BUDGET:-420} \
        ${FAMILIES_ARGS:-} 2>&1 | grep -v Warn | tail -90
      ;;
    invariance)
      # bf16 token equality (SD vs AR, batched vs alone) and speed: the default path vs invariant=True
      timeout ${INVARIANCE_TIMEOUT:-560} $PY benchmarks/invariance.py --out "$OUT" ${INVARIANCE_ARGS:-} 2>&1 \
        | grep -v Warn | tail -30
      ;;
    mixed)
      # arrivals at 40/s (benchmarks/batch.py's mixed section alone) at several prefill budgets
      timeout ${MIXED_TIMEOUT:-560} $PY benchmarks/batch.py --out "$OUT" --fixed 0 --sampling 0 \
        ${MIXED_ARGS:---rates 40 --prefill-chunks 1664 512 256 --mixed-steps 0 1} 2>&1 | grep -v Warn | tail -20
      ;;
    multiturn)
      # multi-turn TTFT with and without the prefix cache (MULTITURN_ARGS="--invariant": both engines
      # invariant=True, whose bf16 tokens then equal with and without the cache; "--defer-views")
      timeout ${MULTITURN_TIMEOUT:-300} $PY benchmarks/multiturn.py --out "$OUT" ${MULTITURN_ARGS:-} 2>&1 | grep -v Warn | tail -25
      ;;
    demo-tau)
      # the bundled pair's acceptance in float32 and bf16, the default path and invariant=True
      for run in "fp32" "bf16" "bf16 --invariant" "fp32 --invariant"; do
        read -r dt inv <<< "$run"
        timeout ${DEMO_TAU_TIMEOUT:-150} $PY benchmarks/e2e.py --preset demo-pair --skip-hf --repeats 1 \
          --out "$OUT/demo_tau_$dt${inv:+_inv}" --dtype $dt $inv ${DEMO_TAU_ARGS:-} 2>&1 \
          | grep -E "tau|mismatch|FAIL|Error" | tail -8
      done
      ;;
    e2e-demo)
      # bundled trained pair, real acceptance (no override), S1-S5 x 10 prompts
      timeout 300 $PY benchmarks/e2e.py --preset demo-pair --out "$OUT" 2>&1 | tail -45
      ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
