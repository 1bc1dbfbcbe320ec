#!/usr/bin/env bash
# On the build machine, after tests/gpu/prepare.sh: stage what the `serving-dynamo` GPU suite
# needs beside .gpu/chimera.
#   .gpu/chimera-dynamo.xz  the release Dynamo worker (host/dynamo), stripped
#   .dyn/a/                 Dynamo's runtime library (the ai-dynamo-runtime wheel's one
#                           extension module), stripped and compressed: 38 MiB alone
#   .dyn/b/                 the rest of ai-dynamo-runtime, ai-dynamo, the frontend's Python
#                           dependencies the GPU machine lacks (wheels for its CPython 3.12),
#                           and Debian's etcd and nats-server
# A call carries at most 64 MiB with the working tree (about 21 MiB), so the parts travel in
# separate calls to one warm machine, each moved out of the working tree there by
# tests/gpu/dynamo_stage.sh:
#   call 1: carry [".dyn"] (made with PART=a)    bash tests/gpu/dynamo_stage.sh
#   call 2: carry [".dyn"] (made with PART=b)    bash tests/gpu/dynamo_stage.sh
#   call 3: carry [".gpu"]                       bash tests/gpu/dynamo_stage.sh &&
#                                                OUT=$OUT bash tests/gpu/run.sh serving-dynamo
# PART=a or PART=b leaves only that part in .dyn/ (the other kept in .dyn-parts/).
set -euo pipefail
cd "$(dirname "$0")/../.."
version=1.6.1
for p in /.gpu/ /.dyn/ /.dyn-parts/; do
  grep -qx "$p" .git/info/exclude 2>/dev/null || echo "$p" >> .git/info/exclude
done
parts=.dyn-parts
mkdir -p "$parts/a" "$parts/b" "$parts/download" .gpu

# The worker: Dynamo's tree in release (about 25 minutes from scratch on 2 cores). WORKER=0
# stages the parts alone.
if [ "${WORKER:-1}" != 0 ]; then
  (cd host/dynamo && cargo build --release --locked --bin chimera-dynamo)
  strip -o .gpu/chimera-dynamo "${CARGO_TARGET_DIR:-host/dynamo/target}/release/chimera-dynamo"
  xz -T0 -6 -f .gpu/chimera-dynamo
  echo "staged .gpu/chimera-dynamo.xz: $(($(stat -c %s .gpu/chimera-dynamo.xz) / 1048576)) MiB"
fi

if [ ! -e "$parts/a/dynamo-core.so.xz" ]; then
  dl() {
    python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
      --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
      --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d "$parts/download" "$@"
  }
  dl "ai-dynamo-runtime==$version" "ai-dynamo==$version"
  # What ai-dynamo and ai-dynamo-runtime require and the GPU machine's image does not hold
  # (device KINDS.md: aiohttp, certifi, prometheus-client, tqdm, transformers, uvloop are
  # there). ai-dynamo's aisimulate is left out, as in .ci/run.
  dl 'pydantic==2.12.5' 'pydantic-core==2.41.5' annotated-types typing-inspection msgspec \
    pyzmq zstandard redis 'kubernetes==32.0.1' google-auth websocket-client requests-oauthlib \
    oauthlib durationpy pyasn1 pyasn1-modules rsa cachetools

  # Part a: the runtime's extension module.
  python3 - "$parts" <<'PY'
import glob, sys, zipfile
parts = sys.argv[1]
wheel = glob.glob(f"{parts}/download/ai_dynamo_runtime-*.whl")[0]
with zipfile.ZipFile(wheel) as z, open(f"{parts}/a/dynamo-core.so", "wb") as f:
    f.write(z.read("dynamo/_core.abi3.so"))
# Part b: the same wheel without it (tests/gpu/dynamo_stage.sh puts it back).
name = wheel.rsplit("/", 1)[1]
with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(f"{parts}/b/{name}", "w", zipfile.ZIP_DEFLATED) as dst:
    for item in src.infolist():
        if item.filename != "dynamo/_core.abi3.so":
            dst.writestr(item, src.read(item.filename))
PY
  strip "$parts/a/dynamo-core.so"
  xz -T0 -9 -f "$parts/a/dynamo-core.so"
  for w in "$parts"/download/*.whl; do
    case "$w" in *ai_dynamo_runtime-*) ;; *) cp "$w" "$parts/b/" ;; esac
  done
  # etcd and NATS: Debian's (static Go binaries), as CI installs them.
  deb=$(mktemp -d)
  (cd "$deb" && apt-get download etcd-server nats-server >/dev/null 2>&1) \
    || (apt-get update -q >/dev/null && cd "$deb" && apt-get download etcd-server nats-server >/dev/null)
  for f in "$deb"/*.deb; do dpkg -x "$f" "$deb/x"; done
  xz -T0 -9 -c "$deb/x/usr/bin/etcd" > "$parts/b/etcd.xz"
  xz -T0 -9 -c "$deb/x/usr/sbin/nats-server" > "$parts/b/nats-server.xz"
  rm -rf "$deb"
fi
du -sh "$parts/a" "$parts/b"

if [ -n "${PART:-}" ]; then
  rm -rf .dyn
  mkdir -p .dyn
  cp -a "$parts/$PART/." .dyn/
  echo ".dyn holds part $PART: $(du -sh .dyn | cut -f1)"
fi
