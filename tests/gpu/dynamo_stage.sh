#!/usr/bin/env bash
# On the GPU machine: moves the parts tests/gpu/prepare_dynamo.sh staged in .dyn/ (one part a
# call) out of the working tree into $CHIMERA_DYNAMO_STAGE, and once both are there installs
# Dynamo's frontend into $CHIMERA_DYNAMO_STAGE/site, etcd and nats-server into .../bin, checks
# that `dynamo.frontend` imports, and marks the stage ready (what `serving.py dynamo` looks
# for). Safe to run in every call.
set -euo pipefail
cd "$(dirname "$0")/../.."
stage=${CHIMERA_DYNAMO_STAGE:-$HOME/chimera-dynamo-stage}
mkdir -p "$stage/parts" "$stage/bin"
if [ -d .dyn ]; then
  find .dyn -maxdepth 1 -type f -exec mv -f {} "$stage/parts/" \;
fi
if [ -e "$stage/ready" ]; then
  echo "dynamo stage: ready ($stage)"
  exit 0
fi
have_a=$([ -e "$stage/parts/dynamo-core.so.xz" ] && echo yes || echo no)
have_b=$([ -e "$stage/parts/etcd.xz" ] && echo yes || echo no)
echo "dynamo stage: part a $have_a, part b $have_b ($stage)"
[ "$have_a" = yes ] && [ "$have_b" = yes ] || exit 0

unxz_to() {
  python3 -c 'import lzma, shutil, sys
with lzma.open(sys.argv[1]) as i, open(sys.argv[2], "wb") as o: shutil.copyfileobj(i, o)' "$1" "$2"
}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$stage/site" "$stage"/parts/*.whl
unxz_to "$stage/parts/dynamo-core.so.xz" "$stage/site/dynamo/_core.abi3.so"
unxz_to "$stage/parts/etcd.xz" "$stage/bin/etcd"
unxz_to "$stage/parts/nats-server.xz" "$stage/bin/nats-server"
chmod +x "$stage/bin/etcd" "$stage/bin/nats-server"
PYTHONPATH="$stage/site" python3 -c 'import dynamo.frontend, dynamo._core; print("dynamo.frontend imports")'
"$stage/bin/etcd" --version | head -1
"$stage/bin/nats-server" --version
rm -rf "$stage/parts"
touch "$stage/ready"
echo "dynamo stage: ready ($stage)"
