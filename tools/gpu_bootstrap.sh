#!/usr/bin/env bash
# Put the payload of tools/gpu_payload.py together on a GPU machine and install it (docs/gpu.md).
#
#   bash tools/gpu_bootstrap.sh [--require-complete] [--check | --no-check] [--src DIR]
#
# Run from the repository root in every call that carries one part folder (.gpu-payload/pK):
# it copies the parts that arrived into /tmp/gpu-tune-payload (each checked against the manifest's
# sha256), and once every part is there it reassembles the archive, checks it, extracts it,
# installs TensorFlow and the wheels into /tmp/site (pip --no-index --no-deps --target), unpacks
# the .deb files into / and runs ldconfig, points TensorFlow's CUDA 12 sonames at the CUDA 13
# libraries PyTorch brought (only where TensorFlow's own are absent and those are present), writes
# /tmp/gpu-tune-env.sh (source it) and imports gpu-tune and TensorFlow once to prove it works.
# Running it again changes nothing that is already in place. One line per step; on a failure the
# last line names what failed and the exit code is not 0:
#   2 bad arguments or no payload, 3 parts missing with --require-complete, 4 a checksum differs,
#   5 extraction or installation failed, 6 the import check failed.
#
# Where things go can be moved (the tests do): GPU_TUNE_PAYLOAD_DIR, GPU_TUNE_SITE,
# GPU_TUNE_ENV_FILE, GPU_TUNE_DATA_DIR, GPU_TUNE_DEB_ROOT, GPU_TUNE_SHIM_DIR, GPU_TUNE_TORCH_SITE,
# GPU_TUNE_CUDA_DIR, PYTHON; GPU_TUNE_PIP_EXTRA adds options to pip install (the tests install the
# cp312 wheels elsewhere with --python-version 3.12 --platform ...).
set -u -o pipefail

SRC=.gpu-payload
DEST=${GPU_TUNE_PAYLOAD_DIR:-/tmp/gpu-tune-payload}
SITE=${GPU_TUNE_SITE:-/tmp/site}
ENV_FILE=${GPU_TUNE_ENV_FILE:-/tmp/gpu-tune-env.sh}
DATA_DIR=${GPU_TUNE_DATA_DIR:-/tmp/gpu-tune-data}
DEB_ROOT=${GPU_TUNE_DEB_ROOT:-/}
SHIM=${GPU_TUNE_SHIM_DIR:-/tmp/shim}
TORCH_SITE=${GPU_TUNE_TORCH_SITE:-/opt/torch/.venv/lib/python3.12/site-packages}
PY=${PYTHON:-python3}
REQUIRE=0
CHECK=0
NOCHECK=0

step() { echo "bootstrap: $*"; }
fail() { echo "bootstrap: FAILED: $1" >&2; exit "${2:-1}"; }

while [ $# -gt 0 ]; do
  case "$1" in
    --require-complete) REQUIRE=1 ;;
    --check) CHECK=1 ;;
    --no-check) NOCHECK=1 ;;
    --src) shift; SRC=${1:?--src needs a folder} ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) fail "unknown argument $1 (see --help)" 2 ;;
  esac
  shift
done

command -v "$PY" >/dev/null || fail "$PY not found (set PYTHON)" 2
mkdir -p "$DEST" || fail "cannot create $DEST" 5

# manifest_get FILE EXPR: print a value of the manifest (EXPR is Python over `m`)
# bounded() SECONDS CMD...: CMD with a time limit where coreutils' timeout is there
bounded() { if command -v timeout >/dev/null; then timeout "$@"; else shift; "$@"; fi; }
manifest_get() { "$PY" -c 'import json,sys; m=json.load(open(sys.argv[1])); v=eval(sys.argv[2]); print(v if not isinstance(v,(list,tuple)) else "\n".join(map(str,v)))' "$1" "$2"; }
sha() { sha256sum "$1" | cut -d' ' -f1; }

# 1. the parts that came with this call ------------------------------------------------------
arrived=0
for folder in "$SRC"/p[0-9]*; do
  [ -d "$folder" ] || continue
  [ -f "$folder/manifest.json" ] || fail "$folder has no manifest.json" 2
  new_id=$(manifest_get "$folder/manifest.json" 'm["payload_id"]') || fail "$folder/manifest.json unreadable" 2
  if [ -f "$DEST/manifest.json" ]; then
    old_id=$(manifest_get "$DEST/manifest.json" 'm["payload_id"]' 2>/dev/null || echo none)
    if [ "$old_id" != "$new_id" ]; then
      step "payload $new_id replaces payload $old_id in $DEST"
      rm -rf "${DEST:?}"/* || fail "cannot clear $DEST" 5
    fi
  fi
  cp "$folder/manifest.json" "$DEST/manifest.json.tmp" && mv "$DEST/manifest.json.tmp" "$DEST/manifest.json" \
    || fail "cannot write $DEST/manifest.json" 5
  while IFS=' ' read -r name want; do
    [ -f "$folder/$name" ] || continue
    if [ -f "$DEST/$name" ] && [ "$(sha "$DEST/$name")" = "$want" ]; then
      step "part $name already in $DEST"
      arrived=$((arrived + 1))
      continue
    fi
    got=$(sha "$folder/$name")
    [ "$got" = "$want" ] || fail "part $folder/$name: sha256 $got, manifest says $want (a broken transfer? send it again)" 4
    cp "$folder/$name" "$DEST/$name.tmp" && mv "$DEST/$name.tmp" "$DEST/$name" || fail "cannot copy $name to $DEST" 5
    step "part $name arrived ($(du -m "$DEST/$name" | cut -f1) MiB, sha256 ok) -> $DEST"
    arrived=$((arrived + 1))
  done < <(manifest_get "$folder/manifest.json" '[p["name"] + " " + p["sha256"] for p in m["parts"]]')
done

M="$DEST/manifest.json"
[ -f "$M" ] || fail "no payload: no part folder under $SRC in this call and none arrived before in $DEST (carry .gpu-payload/p0 first)" 2
ID=$(manifest_get "$M" 'm["payload_id"]')
COMMIT=$(manifest_get "$M" 'm.get("commit") or ""')
STAMP="$SITE/.gpu-tune-payload"

# 2. all there? -------------------------------------------------------------------------------
installed=0
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$ID" ]; then
  installed=1
  step "payload $ID already installed in $SITE"
else
  missing=""
  have=0
  total=0
  while IFS=' ' read -r folder name bytes; do
    total=$((total + 1))
    if [ -f "$DEST/$name" ] && [ "$(stat -c %s "$DEST/$name")" = "$bytes" ]; then
      have=$((have + 1))
    else
      missing="$missing $folder"
    fi
  done < <(manifest_get "$M" '[p["folder"] + " " + p["name"] + " " + str(p["bytes"]) for p in m["parts"]]')
  if [ -n "$missing" ]; then
    step "payload $ID: $have of $total parts here; still to carry, one folder per call:$missing"
    [ "$REQUIRE" = 1 ] && fail "parts missing:$missing (--require-complete)" 3
    exit 0
  fi
  step "payload $ID: all $total parts here"

  # 3. reassemble and check -----------------------------------------------------------------
  ARCHIVE="$DEST/$(manifest_get "$M" 'm["archive"]["name"]')"
  want=$(manifest_get "$M" 'm["archive"]["sha256"]')
  if [ ! -f "$ARCHIVE" ] || [ "$(sha "$ARCHIVE")" != "$want" ]; then
    : > "$ARCHIVE.tmp"
    while read -r name; do
      cat "$DEST/$name" >> "$ARCHIVE.tmp" || fail "cannot append $name" 5
    done < <(manifest_get "$M" '[p["name"] for p in m["parts"]]')
    got=$(sha "$ARCHIVE.tmp")
    [ "$got" = "$want" ] || fail "reassembled archive: sha256 $got, manifest says $want" 4
    mv "$ARCHIVE.tmp" "$ARCHIVE"
  fi
  step "archive reassembled: $(du -m "$ARCHIVE" | cut -f1) MiB, sha256 ok"

  # 4. extract and check every file -----------------------------------------------------------
  STAGE="$DEST/stage"
  rm -rf "$STAGE" && mkdir -p "$STAGE" || fail "cannot create $STAGE" 5
  t0=$(date +%s)
  if command -v xz >/dev/null; then
    bounded 300 xz -T0 -dc "$ARCHIVE" | bounded 300 tar -x -C "$STAGE" || fail "extracting $ARCHIVE failed" 5
  else
    bounded 600 "$PY" -c 'import sys,tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' "$ARCHIVE" "$STAGE" \
      || fail "extracting $ARCHIVE failed" 5
  fi
  got=$(sha "$STAGE/contents.sha256")
  [ "$got" = "$(manifest_get "$M" 'm["contents_sha256"]')" ] || fail "contents.sha256 differs from the manifest's" 4
  (cd "$STAGE" && sha256sum --quiet --strict -c contents.sha256) || fail "some extracted files differ from contents.sha256" 4
  step "extracted $(wc -l < "$STAGE/contents.sha256") files in $(( $(date +%s) - t0 )) s, every sha256 ok"

  # 5. install --------------------------------------------------------------------------------
  NEW="$SITE.new"
  rm -rf "$NEW"
  if compgen -G "$STAGE/wheels/*.whl" >/dev/null; then
    # shellcheck disable=SC2086
    bounded 300 "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check ${GPU_TUNE_PIP_EXTRA:-} \
      --target "$NEW" "$STAGE"/wheels/*.whl || fail "pip install --target $NEW failed" 5
  fi
  mkdir -p "$NEW"
  if [ -d "$STAGE/site" ]; then
    for item in "$STAGE"/site/* "$STAGE"/site/.[!.]*; do
      [ -e "$item" ] || continue
      rm -rf "$NEW/$(basename "$item")"
      mv "$item" "$NEW/" || fail "cannot move $(basename "$item") into $NEW" 5
    done
  fi
  rm -rf "$SITE" && mv "$NEW" "$SITE" || fail "cannot put $NEW in place of $SITE" 5
  tf_note="no TensorFlow"
  [ -d "$SITE/tensorflow" ] && tf_note="TensorFlow ($(du -sm "$SITE/tensorflow" | cut -f1) MiB, slimmed)"
  step "installed into $SITE: $(ls "$STAGE"/wheels/*.whl 2>/dev/null | wc -l) wheels and $tf_note"

  mkdir -p "$DATA_DIR"
  if compgen -G "$STAGE/data/*" >/dev/null; then
    cp "$STAGE"/data/* "$DATA_DIR/" || fail "cannot copy the data to $DATA_DIR" 5
    mkdir -p "${HOME:-/root}/.keras/datasets"
    for f in "$STAGE"/data/*; do
      [ -e "${HOME:-/root}/.keras/datasets/$(basename "$f")" ] || cp "$f" "${HOME:-/root}/.keras/datasets/"
    done
    step "data: $(ls "$DATA_DIR" | tr '\n' ' ')in $DATA_DIR (and ~/.keras/datasets, where the probe looks by default)"
  fi

  if compgen -G "$STAGE/debs/*.deb" >/dev/null; then
    command -v dpkg >/dev/null || fail "dpkg not found: cannot unpack $(ls "$STAGE"/debs)" 5
    for f in "$STAGE"/debs/*.deb; do
      dpkg -x "$f" "$DEB_ROOT" || fail "dpkg -x $f $DEB_ROOT failed" 5
    done
    if [ "$DEB_ROOT" = / ]; then
      ldconfig || fail "ldconfig failed" 5
      lib=$(ldconfig -p | awk '/libjemalloc\.so\.2 /{print $NF; exit}')
      step "unpacked $(ls "$STAGE"/debs | tr '\n' ' ')into /, ldconfig: libjemalloc.so.2 -> ${lib:-NOT FOUND}; numactl: $(command -v numactl || echo NOT FOUND)"
    else
      step "unpacked $(ls "$STAGE"/debs | tr '\n' ' ')into $DEB_ROOT"
    fi
  fi
  echo "$ID" > "$STAMP"
  rm -rf "$STAGE"
  CHECK=1
fi

# 6. CUDA 12 sonames -> the CUDA 13 libraries that are there (a test harness, see docs/gpu.md) --
CU13="$TORCH_SITE/nvidia/cu13/lib"
CUDNN="$TORCH_SITE/nvidia/cudnn/lib"
LDPATH="$SITE/nvidia/cuda_runtime/lib"
if [ -e "$SITE/nvidia/cublas/lib/libcublas.so.12" ]; then
  step "TensorFlow's own CUDA 12 libraries are installed: no shims"
elif [ -e "$CU13/libcublas.so.13" ]; then
  mkdir -p "$SHIM" || fail "cannot create $SHIM" 5
  (
    cd "$SHIM" || exit 1
    ln -sf "$CU13/libcublas.so.13" libcublas.so.12 &&
    ln -sf "$CU13/libcublasLt.so.13" libcublasLt.so.12 &&
    ln -sf "$CU13/libcufft.so.12" libcufft.so.11 &&
    ln -sf "$CU13/libcusolver.so.12" libcusolver.so.11 &&
    ln -sf "$CU13/libnvJitLink.so.13" libnvJitLink.so.12 &&
    ln -sf "$CU13/libcupti.so.13" libcupti.so.12
  ) || fail "cannot create the CUDA shims in $SHIM" 5
  dangling=$(find "$SHIM" -xtype l -printf '%f ' 2>/dev/null)
  step "CUDA 12 sonames -> CUDA 13 in $SHIM (cuBLAS, cuBLASLt, cuFFT, cuSOLVER, nvJitLink, CUPTI)${dangling:+; DANGLING: $dangling}"
  LDPATH="$LDPATH:$SHIM:$CU13:$CUDNN"
else
  step "no CUDA 13 libraries at $CU13 and none of TensorFlow's own: no shims (TensorFlow will see no GPU)"
fi

CUDA_DIR=${GPU_TUNE_CUDA_DIR:-}
if [ -z "$CUDA_DIR" ]; then
  for d in /usr/local/cuda-13.0 /usr/local/cuda; do
    if [ -x "$d/bin/ptxas" ]; then CUDA_DIR=$d; break; fi
  done
fi

# 7. the environment ---------------------------------------------------------------------------
DATA_FILE=$(ls "$DATA_DIR"/* 2>/dev/null | head -n 1)
{
  echo "# written by tools/gpu_bootstrap.sh for payload $ID; source it: . $ENV_FILE"
  echo "export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH}"
  echo "export LD_LIBRARY_PATH=$LDPATH\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
  if [ -n "$CUDA_DIR" ]; then
    echo "export XLA_FLAGS=--xla_gpu_cuda_data_dir=$CUDA_DIR"
    echo "export PATH=$CUDA_DIR/bin:$SITE/bin:\$PATH"
  else
    echo "export PATH=$SITE/bin:\$PATH"
  fi
  echo "export COLUMNS=200"
  echo "export GPU_TUNE_SITE_DIR=$SITE"
  echo "export GPU_TUNE_LD_ADDED=$LDPATH"
  echo "export GPU_TUNE_PAYLOAD_ID=$ID"
  echo "export GPU_TUNE_COMMIT=$COMMIT"
  [ -n "$DATA_FILE" ] && echo "export GPU_TUNE_DATA=$DATA_FILE"
} > "$ENV_FILE.tmp" && mv "$ENV_FILE.tmp" "$ENV_FILE" || fail "cannot write $ENV_FILE" 5
if [ -n "$CUDA_DIR" ]; then
  step "wrote $ENV_FILE (PYTHONPATH, LD_LIBRARY_PATH, XLA_FLAGS, PATH; CUDA toolkit at $CUDA_DIR)"
else
  step "wrote $ENV_FILE (PYTHONPATH, LD_LIBRARY_PATH, PATH; no CUDA toolkit with ptxas found: XLA_FLAGS not set)"
fi

# 8. prove it imports -------------------------------------------------------------------------
if [ "$CHECK" = 1 ] && [ "$NOCHECK" = 0 ]; then
  IMPORTS=$(manifest_get "$M" '" ".join(m.get("check_imports", ["gpu_tune"]))')
  out=$(
    # shellcheck disable=SC1090
    . "$ENV_FILE" && cd / && bounded 240 "$PY" - $IMPORTS 2>&1 <<'EOF'
import importlib, sys, time
t = time.monotonic()
for name in sys.argv[1:]:
    importlib.import_module(name)
print("imported " + ", ".join(sys.argv[1:]) + f" in {time.monotonic() - t:.1f} s", end="")
gt = sys.modules.get("gpu_tune")
if gt is not None:
    print(f"; gpu_tune {gt.__version__} from {gt.__file__.rsplit('/', 2)[0]}", end="")
tf = sys.modules.get("tensorflow")
if tf is not None:
    info = tf.sysconfig.get_build_info()
    gpus = tf.config.list_physical_devices("GPU")
    print(f"; TensorFlow {tf.__version__} (CUDA build {info.get('cuda_version')}, cuDNN {info.get('cudnn_version')})"
          f" sees {len(gpus)} GPU(s)", end="")
print()
EOF
  ) || fail "import check failed: $(echo "$out" | grep -v '^\s*$' | tail -n 3 | tr '\n' ' ')" 6
  step "check: $(echo "$out" | tail -n 1)"
fi
step "ready: . $ENV_FILE${COMMIT:+ (commit $COMMIT)}"
