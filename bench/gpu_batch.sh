#!/usr/bin/env bash
# Several GPU benchmarks and the GPU tests in one go, on one GPU, each writing under $OUT (a folder), for machines
# leased for a fixed time: each part is skipped when too little of LIMIT seconds is left for it.
#
#   OUT=/tmp/out PARTS="load2 load1 slots kontext tests" LIMIT=1800 bash bench/gpu_batch.sh
#
# Parts: load2 / load1 (bench/load.py against both pools on one GPU, bench/serve_config.one-gpu.yaml with
# max_batch_size 2 / 1, SECS seconds of load), slots (bench/lora_slots.py), kontext (bench/e2e.py on FLUX.1 Kontext,
# KREPEATS repeats), tests (the GPU tests; TEST_ARGS narrows them, e.g. one file), mutate (tests/mutate.py on the GPU:
# MUTATE_MODULES against MUTATE_TESTS, the mutants named in the file MUTATE_ONLY, MUTATE_CHILDREN at once, into
# $OUT/mut.tar.gz; mutmut among the wheels), perf (bench/high.py: the served high form against diffusers and
# lossless at 1024x1024, 28 steps, PERF_ARGS added), vae (bench/vae_decode.py: the VAE decode's forms), probe (bench/lora_exact_probe.py: Triton's K = r dot products
# against cuBLAS's, and the fused LoRA tail's time against PEFT's three kernels), shared (bench/lora_shared_a_probe.py:
# one GEMM against stacked LoRA A's against one per layer), rope (bench/lossless_ops.py --rope-tiles: the lossless
# RMSNorm+RoPE pass's launch tiles), toy (the toy preset trained on at every size for TOY_SECONDS, from
# the shipped weights or the folder TOY_RESUME (an earlier call's toy.tar.gz, unpacked and carried), at TOY_SIZES,
# its whole VAE first for TOY_VAE_SECONDS (TOY_VAE_FLAGS="" tunes the decoder only), the extent head's loss weighted
# TOY_EXTENT (0: off), then its adherence at
# TOY_ADHERE_SIZES; the folder comes back as $OUT/toy.tar.gz). Packages the machine lacks can come as a tarball of
# a site folder (SITE_TAR, e.g. from a Ray Serve build) and a folder of wheels (WHEELS), installed into /tmp/site
# first.
# A dry run of the load parts on a CPU: CONFIG=serve_config.yaml LSIZE=256x256 LWIDE=384x256 SECS=20.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to a folder for the results}"
mkdir -p "$OUT"
T0=$(date +%s); LIMIT=${LIMIT:-570}; SECS=${SECS:-200}
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0
exec > >(tee -a "$OUT/log.txt") 2>&1
left() { echo $(( T0 + LIMIT - $(date +%s) )); }
if [ -n "${SITE_TAR:-}${WHEELS:-}" ] && [ ! -f /tmp/site/.ok ]; then
  mkdir -p /tmp/site
  [ -n "${SITE_TAR:-}" ] && { tar -xJf "$SITE_TAR" -C /tmp/site || exit 1; }
  [ -n "${WHEELS:-}" ] && { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl || exit 1; }
  python3 -m compileall -q -j0 /tmp/site/ray >/dev/null 2>&1
  touch /tmp/site/.ok
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
if ! command -v serve >/dev/null; then  # a site folder has no console scripts: the demo needs `serve`
  mkdir -p /tmp/bin
  printf '#!/bin/sh\nexec python3 -c "import sys; from ray.serve.scripts import cli; sys.argv[0] = \\"serve\\"; sys.exit(cli())" "$@"\n' > /tmp/bin/serve
  chmod +x /tmp/bin/serve; export PATH=/tmp/bin:$PATH
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no GPU"; } | tee "$OUT/gpu.txt"
python3 -c "
import importlib
for name in ('torch', 'diffusers', 'triton', 'ray', 'peft', 'mutmut'):
    try:
        print(name, importlib.import_module(name).__version__, end='; ')
    except Exception:
        print(name, 'missing', end='; ')
print()" | tee -a "$OUT/gpu.txt"
echo "commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}; set up in $(( $(date +%s) - T0 )) s" | tee -a "$OUT/gpu.txt"

load() {  # $1 = max_batch_size
  local b=$1 cfg=/tmp/one-gpu-b$1.yaml
  sed "s/max_batch_size: 2 /max_batch_size: $b /" "${CONFIG:-bench/serve_config.one-gpu.yaml}" > $cfg
  local t=$(date +%s)
  python3 -m deployments.demo --config $cfg --out /tmp/demo-b$b.png --ready-timeout 400 > "$OUT/serve-b$b.log" 2>&1 &
  local pid=$!
  # the demo waits for /readyz itself (and exits with the reason if a pool fails to start), then serves on
  until grep -q "serving; Ctrl-C to stop" "$OUT/serve-b$b.log" || ! kill -0 $pid 2>/dev/null \
        || [ $(( $(date +%s) - t )) -gt 420 ]; do sleep 2; done
  if grep -q "serving; Ctrl-C to stop" "$OUT/serve-b$b.log"; then
    echo "ready after $(( $(date +%s) - t )) s"
    python3 bench/load.py --url http://127.0.0.1:8000 --seconds $SECS --size ${LSIZE:-1024x1024} --wide ${LWIDE:-1024x768} \
      --clients 4 --timeout 330 --out "$OUT/load-b$b.json"
  else
    echo "not serving"; grep -v readyz "$OUT/serve-b$b.log" | tail -40
  fi
  kill -INT $pid; for _ in $(seq 60); do kill -0 $pid 2>/dev/null || break; sleep 1; done
  kill -9 $pid 2>/dev/null; pkill -9 -f "ray::"; pkill -9 -f raylet; pkill -9 -f gcs_server; sleep 2
}

TOY_ALL="256x256 384x384 512x512 768x768 1024x1024 1024x576 576x1024 1360x768 768x1360"
SERVED_HIGH=$(python3 -c "from bench.high import SERVED_HIGH; print(SERVED_HIGH)" 2>/dev/null)
for part in ${PARTS:-}; do
  case $part in
    load2|load1) need=$(( SECS + 130 )) ;;
    slots) need=240 ;;
    perf) need=240 ;;
    vae) need=120 ;;
    probe) need=60 ;;
    shared) need=60 ;;
    rope) need=90 ;;
    kontext) need=240 ;;
    tests) need=${TESTS_NEED:-300} ;;
    mutate) need=200 ;;
    toy) need=$(( ${TOY_SECONDS:-330} + ${TOY_VAE_SECONDS:-0} + 150 )) ;;
    *) echo "unknown part $part"; continue ;;
  esac
  echo "=== $part ($(left) s left) $(date +%T)"
  if [ "$(left)" -lt "$need" ]; then echo "skip $part: $(left) s left, it needs about $need"; continue; fi
  case $part in
    load2) load 2 ;;
    load1) load 1 ;;
    slots) timeout $(( $(left) - 5 )) python3 bench/lora_slots.py ${SLOTS_ARGS:-} --out "$OUT/lora-slots.json" ;;
    perf) timeout $(( $(left) - 5 )) python3 bench/high.py --only "$SERVED_HIGH" --steps 28 --e2e-steps 28 \
            --batches 1 --in-batch 0 --repeats 7 --e2e-repeats 3 ${PERF_ARGS:-} --out "$OUT/perf.json" ;;
    vae) timeout $(( $(left) - 5 )) python3 bench/vae_decode.py --repeats 9 --out "$OUT/vae-decode.json" ;;
    probe) timeout $(( $(left) - 5 )) python3 bench/lora_exact_probe.py ${PROBE_ARGS:-} --out "$OUT/lora-exact-probe.json" ;;
    shared) timeout $(( $(left) - 5 )) python3 bench/lora_shared_a_probe.py --out "$OUT/lora-shared-a-probe.json" ;;
    rope) timeout $(( $(left) - 5 )) python3 bench/lossless_ops.py --rope-tiles --out "$OUT/rope-tiles.md" ;;
    kontext) timeout $(( $(left) - 5 )) python3 bench/e2e.py --model flux-kontext-random --edit --high-default \
               --cuda-graphs --steps 28 --repeats ${KREPEATS:-3} --out "$OUT/e2e-kontext.json" ;;
    tests) timeout $(( $(left) - 5 )) python3 -m pytest -q -p no:cacheprovider -m gpu ${TEST_ARGS:-tests/} -rfEs \
             2>&1 | tee "$OUT/gpu-tests.log" ;;
    mutate) [ -d /tmp/site/bin ] && export PATH=/tmp/site/bin:$PATH
            # shellcheck disable=SC2046  # one mutant name per line
            FLUXSERVE_MUTATE_GPU=1 FLUXSERVE_MUTATE_K="${MUTATE_K:-gpu and not compile and not graph}" \
              timeout $(( $(left) - 5 )) python3 tests/mutate.py --together --out "$OUT/mut" \
              --max-children "${MUTATE_CHILDREN:-12}" --seconds $(( $(left) - 70 )) $MUTATE_MODULES \
              --tests $MUTATE_TESTS --only $(cat "$MUTATE_ONLY")
            tar -czf "$OUT/mut.tar.gz" -C "$OUT" mut && rm -rf "$OUT/mut" ;;
    toy) # shellcheck disable=SC2086  # size lists
         python3 -m model.toy.train --resume "${TOY_RESUME:-model/toy/flux-toy}" --out /tmp/toy \
           --report "$OUT/toy-train.json" --transformer-seconds "${TOY_SECONDS:-330}" --batch 128 --precision fp32 \
           --probe-weight 0.03 --extent-weight "${TOY_EXTENT:-0.1}" --lr "${TOY_LR:-3e-4}" --warmup 200 \
           --tokens-per-size 4000000 \
           --tune-decoder-seconds "${TOY_VAE_SECONDS:-0}" ${TOY_VAE_FLAGS---tune-encoder} \
           --sizes ${TOY_SIZES:-$TOY_ALL} --vae-sizes ${TOY_SIZES:-$TOY_ALL} \
         && tar -czf "$OUT/toy.tar.gz" -C /tmp toy \
         && timeout $(( $(left) - 5 )) python3 bench/toy_adherence.py --model /tmp/toy --device cuda --prompts 64 \
              --sizes ${TOY_ADHERE_SIZES:-256x256 512x512 1024x1024 1360x768} --no-variants \
              --out "$OUT/toy-adherence-gpu.json" ;;
  esac
  echo "=== $part done $(date +%T)"
done
