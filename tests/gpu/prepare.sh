#!/usr/bin/env bash
# On the build machine (no GPU needed): build the release binary with the CUDA backend, strip
# it and stage it in .gpu/ (git-ignored), ready to be carried to the GPU machine, where
# `tests/gpu/run.sh SUITE` runs it. The `serve` suite's openai client comes from the GPU
# machine's Python, or from wheels in .whl/ (carried too) for that machine's Python version.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release -p chimera
mkdir -p .gpu
strip -o .gpu/chimera "${CARGO_TARGET_DIR:-target}/release/chimera"
size=$(stat -c %s .gpu/chimera)
echo "staged .gpu/chimera: $((size / 1048576)) MiB"
[ "$size" -lt $((60 * 1048576)) ] || { echo "binary over 60 MiB: too big to carry" >&2; exit 1; }
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
