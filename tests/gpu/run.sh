#!/usr/bin/env bash
# On the GPU machine, from the repository root, with the stripped binaries compressed in
# .gpu/chimera.xz and .gpu/chimera-gpu-check.xz (tests/gpu/prepare.sh makes them on a machine
# without a GPU; they are unpacked here when the .xz is newer than the binary or it is missing):
#
#   tests/gpu/run.sh kernels|hybrid|parity|archs|graphs|bench|bench-kernels|bench-archs|bench-mixed|moe|spec|bench-spec|fp8|bench-fp8|bench-fp8-short|kv-fp8|serve|all
#   tests/gpu/run.sh attention|model|fixtures   (subsets of kernels and parity/hybrid, for planted faults)
#   tests/gpu/run.sh serving-caching|serving-idle|serving-prefill|serving-routing   (QUICK=1: small)
#   tests/gpu/run.sh serving-dynamo   (also .gpu/chimera-dynamo.xz and a Dynamo stage: see
#                                      tests/gpu/prepare_dynamo.sh)
#   tests/gpu/run.sh serving-constrained   (64 JSON-schema responses on a Llama-3-8B shape)
#
# Prints one table (check | measured | bound | pass), writes every row as JSON under $OUT (or
# .gpu/out), and exits non-zero if any row fails. Each suite finishes in under 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/../.."
suite=${1:-all}
out=${OUT:-.gpu/out}
mkdir -p "$out"
# `chimera` serves (the serve and serving-* suites); `chimera-gpu-check` runs the suites.
bin=.gpu/chimera
check_bin=.gpu/chimera-gpu-check
# unpack B: B.xz → B, the .xz kept and B given its time; python3's lzma where xz is missing.
unpack() {
  if command -v xz > /dev/null; then
    xz -d -k -f "$1.xz"
  else
    python3 -c 'import lzma, shutil, sys
with lzma.open(sys.argv[1]) as i, open(sys.argv[2], "wb") as o: shutil.copyfileobj(i, o)' "$1.xz" "$1"
  fi && chmod +x "$1" && touch -r "$1.xz" "$1"
}
# The serving suites need `chimera` (and serving-dynamo the worker), the others the checker.
case $suite in
  serving-dynamo) needed=("$bin" .gpu/chimera-dynamo) ;;
  serving-*) needed=("$bin") ;;
  *) needed=("$bin" "$check_bin") ;;
esac
for b in "${needed[@]}"; do
  if [ -f "$b.xz" ] && [ "$b.xz" -nt "$b" ]; then
    unpack "$b" || { echo "cannot unpack $b.xz" >&2; exit 2; }
  fi
  [ -x "$b" ] || { echo "no $b: run tests/gpu/prepare.sh on the build machine first" >&2; exit 2; }
done

# NVRTC and cuBLASLt from the CUDA toolkit or the nvidia-* Python wheels, whichever is there.
libs=$(python3 - <<'PY' 2>/dev/null
import glob, os
dirs = set()
for pat in ["/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"]:
    dirs.update(glob.glob(pat))
try:
    import nvidia
    for base in nvidia.__path__:
        for lib in glob.glob(os.path.join(base, "**", "lib"), recursive=True):
            if glob.glob(os.path.join(lib, "libnvrtc.so*")) or glob.glob(os.path.join(lib, "libcublasLt.so*")):
                dirs.add(lib)
except ImportError:
    pass
print(":".join(sorted(dirs)))
PY
)
export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export CHIMERA_KERNEL_CACHE="${CHIMERA_KERNEL_CACHE:-$out/kernel-cache}"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader || true

status=0
run_check() {
  local s=$1
  echo "== chimera-gpu-check $s"
  # GPU_CHECK_ARGS: extra flags, e.g. "--seed N" to repeat a run.
  timeout 470 "$check_bin" --suite "$s" --json "$out/$s.json" --dump "$out/logits" ${GPU_CHECK_ARGS:-} \
    > "$out/$s.log" 2>&1 || status=1
  tail -n 5 "$out/$s.log"
}

serve_suite() {
  # The repo's openai-client tests against `chimera serve` on the GPU (f32 mode, a Llama
  # fixture), with streaming, prefix caching and agent requests; then a hung-up stream must
  # free its blocks.
  echo "== serve"
  # Wheels for this machine's Python: .whl/cpXY/ (one folder per version), else .whl/.
  local whl
  whl=.whl/cp$(python3 -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
  [ -d "$whl" ] || whl=.whl
  if ls "$whl"/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$whl"/*.whl \
      && export PYTHONPATH=/tmp/site
  fi
  local port=8017
  "$bin" serve --model tests/fixtures/models/llama-gqa --backend cuda --dtype float32 \
    --tool-call-parser hermes --port $port > "$out/serve.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 120); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
    sleep 0.5
  done
  CHIMERA_BASE_URL="http://127.0.0.1:$port/v1" timeout 300 python3 tests/openai_client/test_openai.py \
    > "$out/openai.log" 2>&1
  local rc=$?
  tail -n 3 "$out/openai.log"
  # Agent requests (constrained on the device): structured outputs, forced tool calls.
  CHIMERA_BASE_URL="http://127.0.0.1:$port/v1" timeout 300 python3 tests/openai_client/test_agents.py \
    > "$out/agents.log" 2>&1 || rc=1
  tail -n 7 "$out/agents.log"
  # Device idle between steps with 64 constrained responses at once, against the same load
  # unconstrained (reported: the masks are computed before the step is launched, not yet
  # while the device runs the step before).
  timeout 240 python3 tests/gpu/constrained_load.py --port $port --json "$out/constrained.json" \
    || status=1
  python3 tests/gpu/hangup.py --port $port --json "$out/serve.json" --openai-rc $rc \
    --openai-log "$out/openai.log" || status=1
  kill $pid 2>/dev/null
  wait $pid 2>/dev/null
}

constrained_suite() {
  # Device idle with 64 constrained responses at once (a 2.7 KB tool-call schema) on a
  # Llama-3-8B shape with dummy weights and a 49,152-token byte-level tokenizer trained here
  # (tests/gpu/constrained_model.py): the masks are computed while the forward pass runs.
  echo "== serving-constrained"
  local model=/tmp/chimera-constrained-model port=8019
  if ! timeout 300 python3 tests/gpu/constrained_model.py "$model" > "$out/constrained-model.log" 2>&1; then
    tail -n 5 "$out/constrained-model.log"
    status=1
    return
  fi
  tail -n 1 "$out/constrained-model.log"
  # CONSTRAINT_THREADS: [plugins] constraint_threads (the default when unset).
  printf '[model]\npath = "%s"\nload_format = "dummy"\ndtype = "bfloat16"\n\n[engine]\nbackend = "cuda"\nmax_running = 128\n\n[cache]\nmemory_fraction = 0.85\n' \
    "$model" > "$out/constrained.toml"
  if [ -n "${CONSTRAINT_THREADS:-}" ]; then
    printf '\n[plugins]\nconstraint_threads = %s\n' "$CONSTRAINT_THREADS" >> "$out/constrained.toml"
  fi
  "$bin" serve --config "$out/constrained.toml" --port $port > "$out/constrained-serve.log" 2>&1 &
  local pid=$! up=0
  for _ in $(seq 1 600); do
    if curl -sf "http://127.0.0.1:$port/health" > /dev/null; then up=1; break; fi
    kill -0 $pid 2>/dev/null || break
    sleep 0.5
  done
  if [ "$up" = 1 ]; then
    timeout 420 python3 tests/gpu/constrained_load.py --port $port --concurrency 64 --per-thread 2 \
      --schema plugins/constraint-core/examples/tool_schema.json --vocab 49152 --bound 0.02 \
      --json "$out/serving-constrained.json" || status=1
  else
    echo "chimera serve did not come up:"; tail -n 20 "$out/constrained-serve.log"
    status=1
  fi
  kill $pid 2>/dev/null
  wait $pid 2>/dev/null
}

case $suite in
  kernels|hybrid|parity|archs|graphs|bench|bench-kernels|bench-archs|bench-mixed|moe|attention|model|fixtures|spec|bench-spec|fp8|bench-fp8|bench-fp8-short|kv-fp8) run_check "$suite" ;;
  # chimera serve + chimera bench with NemotronH-8B-shaped dummy weights (tests/gpu/serving.py;
  # QUICK=1 for a small workload); serving-routing needs two GPUs.
  # serving-dynamo: two Dynamo workers sharing the GPU behind Dynamo's frontend.
  serving-caching|serving-idle|serving-prefill|serving-routing|serving-dynamo)
    echo "== $suite"
    python3 tests/gpu/serving.py "${suite#serving-}" ${QUICK:+--quick} ${SERVING_ARGS:-} --out "$out" || status=1 ;;
  serve) serve_suite ;;
  serving-constrained) constrained_suite ;;
  all) run_check kernels; run_check hybrid; run_check parity; run_check graphs; run_check bench; serve_suite ;;
  *) echo "unknown suite $suite" >&2; exit 2 ;;
esac
# The transformers comparison of the fixtures (SKIP_HF=1 leaves it out of a short call).
if [ -z "${SKIP_HF:-}" ] && { [ "$suite" = parity ] || [ "$suite" = hybrid ] || [ "$suite" = archs ] || [ "$suite" = fixtures ] || [ "$suite" = all ]; }; then
  timeout 300 python3 tests/gpu/hf_bf16.py --fixtures tests/fixtures/models --dump "$out/logits" \
    --json "$out/hf_bf16.json" || status=1
fi
if [ "$suite" = bench ] || [ "$suite" = all ]; then
  timeout 120 python3 tests/gpu/peers.py --json "$out/peers.json" || status=1
fi
if [ "$suite" = bench-archs ] || [ "$suite" = all ]; then
  # fla's chunked gated delta rule from the wheels in .gpu/whl (carried; no internet there).
  timeout 300 python3 tests/gpu/peer_gdn.py --json "$out/peer_gdn.json" || status=1
fi
python3 tests/gpu/table.py "$out"/*.json || status=1
exit $status
