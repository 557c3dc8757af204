#!/usr/bin/env bash
# One call on a lent NVIDIA GPU (the `device` tool): checks and benchmarks in one command,
# logs under $OUT (or ./gpu-out). Steps, in the order given:
#   env          versions and the GPU
#   attention    the attention kernel's tests alone (compiled, on the GPU)
#   kernels      the GPU kernels' tests (attention, quantized and grouped matmul) compiled,
#                not interpreted, against the reference on the GPU
#   engine       the engine end to end on the GPU against transformers (test_parity.py,
#                test_prompt_logprobs.py)
#   engine-more  the engine's, quantized engine's and MoE tests on the GPU
#   suite        the rest of the default test suite on the GPU
#   bench        benchmarks/kernel_speed.py --full, attention and quantized matmul
#   offline      benchmarks/offline_throughput.py on a Llama-3-8B-shaped random bf16 model
#   forward      benchmarks/forward_step.py: that model's forward pass alone (no engine)
#   sweep        benchmarks/gpu_attention_sweep.py: the attention kernel's launch choices
#   dispatch     benchmarks/gpu_dispatch.py: the 8B model's host time inside each step's
#                call and the steps queued behind a running one (one and 8 steps a program)
#   hostloop     benchmarks/host_overhead.py (tiny model, no peers) with the step's host
#                inputs packed in one transfer and not (jaxserve/engine/packing.py); on an
#                H200 its tiny model's 32 programs compile in ~2.5 minutes per run
#   servers      benchmarks/http_vs_grpc.py: issue 54's 256 streams of the tiny model through
#                gRPC and HTTP against the offline LLM, on the host's CPU cores
#                (JAX_PLATFORMS=cpu): the servers' share where the front, the engine and
#                the client do not share two cores (~4 minutes)
# Each step has a time limit (SIGINT, so pytest still prints what failed) and a log. The
# Python packages the device's image lacks travel as wheels in .whl, and the 8B model's
# tokenizer in .tok8b (both ignored by git, named in the call's carry):
# `bash benchmarks/gpu_carry.sh` makes them here.
#   bash benchmarks/gpu_session.sh env kernels engine bench
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda,cpu XLA_FLAGS= XLA_PYTHON_CLIENT_PREALLOCATE=false
# Tests: 8 workers, XLA's GEMM autotuning off (compile time; results stay within rounding).
PYTEST="env XLA_FLAGS=--xla_gpu_autotune_level=0 python3 -m pytest -q -p no:cacheprovider -n 8 -rfE"

step() {  # name, seconds, command...: run with a time limit, log to $OUT/name.log, say how it went
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  # SIGINT first: pytest then still prints its summary of what failed
  timeout -s INT -k 30 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc $rc in $((SECONDS - t0)) s"
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/$name.log" | tail -30
}

checkpoint_8b() {  # the random Llama-3-8B checkpoint, in its own process (torch keeps GPU memory)
  # The device's sentencepiece failed to train the 128k vocabulary (trainer_interface.cc
  # (650)); a tokenizer trained by peers._write_tokenizer elsewhere can travel in .tok8b.
  step checkpoint 120 python3 -c "import glob, shutil, sys; sys.path.insert(0, 'benchmarks')
import peers
if glob.glob('.tok8b/*'):
    peers._write_tokenizer = lambda out, *_: [shutil.copy(f, out) for f in glob.glob('.tok8b/*')]
print(peers.checkpoint('configs/models/llama3-8b.yaml'))"
}

for s in "$@"; do
  case $s in
    env)
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
      python3 -c "import jax, jaxlib, triton, torch; print('jax', jax.__version__, 'jaxlib', \
jaxlib.__version__, 'triton', triton.__version__, 'torch', torch.__version__); print(jax.devices())"
      ;;
    attention)
      step attention 60 $PYTEST tests/test_attention_kernels.py -k "not tpu" ;;
    kernels)
      step kernels 150 $PYTEST tests/test_attention_kernels.py tests/test_quantized_matmul.py \
        tests/test_grouped_matmul.py \
        tests/test_lora.py::test_grouped_delta_matches_the_token_by_token_reference -k "not tpu" ;;
    engine)
      step engine 150 $PYTEST -v tests/test_parity.py tests/test_prompt_logprobs.py \
        -k "greedy_batch or (prompt_logits and kn) or prompt_logprobs_match" ;;
    engine-more)
      step engine-more 240 $PYTEST tests/test_engine.py tests/test_quantized_engine.py \
        tests/test_moe.py ;;
    suite)
      step suite 540 $PYTEST tests --ignore tests/test_parity.py \
        --ignore tests/test_attention_kernels.py --ignore tests/test_quantized_matmul.py \
        --ignore tests/test_grouped_matmul.py --ignore tests/test_engine.py \
        --ignore tests/test_quantized_engine.py --ignore tests/test_moe.py \
        --ignore tests/test_tpu_aot.py ;;
    bench)
      step bench 240 python3 benchmarks/kernel_speed.py --full --only attention,quantized
      sed -n '/^|/p;/target/p' "$OUT/bench.log" | tail -80 ;;
    forward)
      checkpoint_8b
      step forward 150 python3 benchmarks/forward_step.py
      sed -n '/^|/p' "$OUT/forward.log" ;;
    offline)
      checkpoint_8b
      step offline 300 python3 benchmarks/offline_throughput.py --preset \
        configs/models/llama3-8b.yaml --dtype bfloat16 --skip-hf --skip-llamacpp --skip-vllm --skip-restarts
      sed -n '/^|/p' "$OUT/offline.log" | tail -40 ;;
    dispatch)
      checkpoint_8b
      step dispatch 300 python3 benchmarks/gpu_dispatch.py
      sed -n '/^[|-]/p' "$OUT/dispatch.log" ;;
    sweep)
      step sweep 130 python3 benchmarks/gpu_attention_sweep.py
      sed -n '/^[|#]/p' "$OUT/sweep.log" | awk '/^#/{n=0} {if (n++ < 8) print}' ;;
    hostloop)
      for pack in on off; do
        step "hostloop-$pack" 300 python3 benchmarks/host_overhead.py --skip-peers --rounds 1 \
          --pack "$pack"
        sed -n '/^|/p' "$OUT/hostloop-$pack.log"
      done ;;
    servers)
      step servers-model 120 python3 -c "import sys; sys.path.insert(0, 'benchmarks')
import peers
print(peers.checkpoint('configs/models/tiny-llama.yaml', dtype='float32'))"
      model=$(tail -1 "$OUT/servers-model.log")
      for interval in 1 16; do
        step "servers-$interval" 200 env JAX_PLATFORMS=cpu python3 benchmarks/http_vs_grpc.py \
          --model "$model" --dtype float32 --concurrency 256 --num-prompts 1024 \
          --input-len 16 --output-len 128 --offline --rounds 1 --stream-interval "$interval"
        sed -n '/^|/p;/^offline LLM/p' "$OUT/servers-$interval.log"
      done ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
