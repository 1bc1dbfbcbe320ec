#!/usr/bin/env bash
# On the build machine (no GPU needed): build the release binaries with the CUDA backend
# (`chimera` for serving, `chimera-gpu-check` for the suites), strip them and stage them in
# .gpu/ (git-ignored) compressed with xz, ready to be carried to the GPU machine, where
# `tests/gpu/run.sh SUITE` unpacks and runs them. A carry holds at most 64 MiB in all and each
# stripped binary is about 33 MiB, hence xz. The `serve` suite's openai client comes from the
# GPU machine's Python, or from wheels in .whl/ (carried too) for that machine's Python version.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release -p chimera -p chimera-gpu-check
mkdir -p .gpu
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude

# stage NAME: strip target/release/NAME to .gpu/NAME and compress it to .gpu/NAME.xz (xz
# removes .gpu/NAME once the .xz is written; run.sh unpacks it again), sizes printed.
stage() {
  local name=$1 raw packed
  strip -o ".gpu/$name" "${CARGO_TARGET_DIR:-target}/release/$name"
  raw=$(stat -c %s ".gpu/$name")
  xz -T0 -6 -f ".gpu/$name"
  packed=$(stat -c %s ".gpu/$name.xz")
  echo "staged .gpu/$name.xz: $((packed / 1048576)) MiB ($((raw / 1048576)) MiB stripped)"
}

stage chimera
stage chimera-gpu-check
total=$(( $(stat -c %s .gpu/chimera.xz) + $(stat -c %s .gpu/chimera-gpu-check.xz) ))
echo "carried: $((total / 1048576)) MiB"
[ "$total" -lt $((60 * 1048576)) ] || { echo "binaries over 60 MiB together: too big to carry" >&2; exit 1; }
