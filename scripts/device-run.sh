#!/usr/bin/env bash
# On the device machine: unpack the carries `make device-stage` wrote, then run a command.
#
#   bash scripts/device-run.sh DEST [-- COMMAND ...]
#
# DEST is the stage folder of this checkout, e.g. .device/engine; each call brings some of its
# carry folders (DEST/carry-01, DEST/carry-02, ..., each <= 60 MiB, each with a copy of
# manifest.json). Every call unpacks the carries it brought into the staging area, checking
# each piece's sha256 against the manifest, and keeps what earlier calls unpacked:
#   - a file split into parts (x.part-00, ...) is reassembled once all its parts are in,
#   - kernels/<path>.xz are decompressed into $SITE/<path> (vllm/_C_stable_libtorch.abi3.so ...),
#   - tree/vllm-tree.tar.xz (vLLM's Python tree and dist-info) is unpacked into $SITE,
#   - wheels/*.whl are collected in $STAGE/wheels,
#   - the files beside manifest.json that the manifest names (`beside`: liveness.json, the lines each patch
#     added) are copied into $STAGE; COMMAND then runs with OVERLAY_LIVENESS=$STAGE/liveness.json
#     (engine-check --coverage's default --liveness).
# Once every carry named in the manifest has arrived, all collected wheels are installed into
# $SITE with ONE `pip install --no-index --no-deps --target` (pip --target replaces whole
# top-level folders such as nvidia/ that several wheels share: never in batches), a stamp is
# written, and only then is COMMAND run, with PYTHONPATH=$SITE and NVLink multicast kept off
# (NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1).
# COMMAND given while carries are missing: they are named, exit 3. No COMMAND: unpack only.
# A manifest from another staging (another sha256) wipes $STAGE and $SITE first.
#
# $SITE and $STAGE (/tmp/site, /tmp/stage; OVERLAY_DEVICE_SITE / OVERLAY_DEVICE_STAGE) lie outside
# the repository: they survive on the device only while the machine stays warm (30 s between
# calls), so make the calls back to back. `make device-stage` prints the exact sequence, e.g.:
#   1. carry [".device/engine/carry-01"], command: bash scripts/device-run.sh .device/engine
#   ...
#   N. carry [".device/engine/carry-NN"], command:
#      bash scripts/device-run.sh .device/engine -- python3 -m pytest -m gpu tests/patches
# Later calls (machine still warm) carry nothing: bash scripts/device-run.sh .device/engine -- ...
set -euo pipefail
DEST=${1:?usage: bash scripts/device-run.sh DEST [-- COMMAND ...]}; shift
[ "${1:-}" = "--" ] && shift
SITE=${OVERLAY_DEVICE_SITE:-/tmp/site}
STAGE=${OVERLAY_DEVICE_STAGE:-/tmp/stage}
PY=${OVERLAY_DEVICE_PYTHON:-python3}

# Unpack: exit 0 when every carry has arrived, 10 when some are missing (named on stdout).
set +e
missing=$("$PY" - "$DEST" "$SITE" "$STAGE" <<'PYEOF'
import hashlib, json, lzma, os, shutil, sys, tarfile
from pathlib import Path

dest, site, stage = map(Path, sys.argv[1:4])


def say(msg):
    print(f"[device-run] {msg}", file=sys.stderr, flush=True)


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


here = sorted(dest.glob("carry-*/manifest.json"))
texts = {p.read_bytes() for p in here}
if len(texts) > 1:
    sys.exit(f"error: the carries of {dest} hold different manifests; stage again and carry them all")
if not texts:
    if not (stage / "manifest.json").is_file():
        sys.exit(f"error: no carry of {dest} in this call and nothing staged in {stage} yet")
    texts = {(stage / "manifest.json").read_bytes()}
text = texts.pop()
mid = hashlib.sha256(text).hexdigest()
if (stage / "id").is_file() and (stage / "id").read_text() != mid:
    say(f"another staging was unpacked here before: wiping {stage} and {site}")
    shutil.rmtree(stage)
    shutil.rmtree(site, ignore_errors=True)
for sub in ("parts", "wheels", "done", "arrived"):
    (stage / sub).mkdir(parents=True, exist_ok=True)
site.mkdir(parents=True, exist_ok=True)
if not (stage / "id").is_file():
    (stage / "manifest.json").write_bytes(text)
    (stage / "id").write_text(mid)
manifest = json.loads(text)
files = {f["path"]: f for f in manifest["files"]}


def flat(path):
    return path.replace("/", "__")


def done(entry):
    return stage / "done" / entry["sha256"]


def process(entry, src):
    """Put one complete, verified file where it belongs."""
    kind = entry["kind"]
    if kind == "wheel":
        shutil.copyfile(src, stage / "wheels" / Path(entry["path"]).name)
    elif kind == "kernel":
        out = site / entry["target"]
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        with lzma.open(src) as fin, open(tmp, "wb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
        if sha256(tmp) != entry["target_sha256"]:
            sys.exit(f"error: {entry['target']}: sha256 after xz -d does not match the manifest")
        os.replace(tmp, out)
    elif kind == "tree":
        with tarfile.open(src, "r:xz") as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(site, filter="data")
            else:
                tar.extractall(site)
    else:
        sys.exit(f"error: {entry['path']}: unknown kind {kind!r}")
    done(entry).write_text(entry["path"] + "\n")
    say(f"{entry['path']} -> {'wheels' if kind == 'wheel' else site}")


for carry in manifest["carries"]:
    folder = dest / carry["name"]
    if not folder.is_dir() or (stage / "arrived" / carry["name"]).exists():
        continue
    for name, entry in sorted(manifest.get("beside", {}).items()):
        src = folder / Path(name).name
        if (stage / src.name).is_file():
            continue
        if not src.is_file() or sha256(src) != entry["sha256"]:
            sys.exit(f"error: {src}: missing, or its sha256 differs from the manifest")
        shutil.copyfile(src, stage / src.name)
        say(f"{src.name} -> {stage}")
    for piece in carry["pieces"]:
        src = folder / piece["path"]
        entry = files[piece["file"]]
        if done(entry).exists():
            continue
        if not src.is_file() or src.stat().st_size != piece["size"] or sha256(src) != piece["sha256"]:
            sys.exit(f"error: {src}: missing, or its size or sha256 differs from the manifest")
        if "part" in piece:
            shutil.copyfile(src, stage / "parts" / flat(piece["path"]))
        else:
            process(entry, src)
    (stage / "arrived" / carry["name"]).write_text(mid + "\n")
    say(f"{carry['name']}: unpacked ({carry['size'] / 2**20:.1f} MiB)")

for entry in files.values():
    parts = [stage / "parts" / flat(p) for p in entry.get("parts", [])]
    if not parts or done(entry).exists() or not all(p.is_file() for p in parts):
        continue
    whole = stage / "parts" / flat(entry["path"])
    with open(whole, "wb") as fout:
        for p in parts:
            with open(p, "rb") as fin:
                shutil.copyfileobj(fin, fout, 1 << 20)
    if sha256(whole) != entry["sha256"]:
        sys.exit(f"error: {entry['path']}: reassembled from {len(parts)} parts, sha256 differs")
    process(entry, whole)
    for p in (*parts, whole):
        p.unlink()

missing = [c["name"] for c in manifest["carries"] if not (stage / "arrived" / c["name"]).exists()]
left = [f["path"] for f in manifest["files"] if not done(f).exists()]
if missing:
    n = len(manifest["carries"])
    say(f"{n - len(missing)}/{n} carries in; still to carry: {' '.join(missing)}")
    print(" ".join(missing))
    sys.exit(10)
if left:
    sys.exit(f"error: every carry arrived but {len(left)} file(s) are incomplete: {left[:3]}")
PYEOF
)
rc=$?
set -e
case $rc in
  0) ;;
  10) if [ $# -gt 0 ]; then
        echo "[device-run] not running '$*': carries missing: $missing (carry them, back to back)" >&2
        exit 3
      fi
      exit 0 ;;
  *) exit "$rc" ;;
esac

if [ ! -e "$STAGE/installed" ]; then
  shopt -s nullglob
  wheels=("$STAGE"/wheels/*.whl)
  shopt -u nullglob
  if [ ${#wheels[@]} -gt 0 ]; then
    # One call; --upgrade only replaces what an interrupted earlier attempt may have left.
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
      --upgrade --target "$SITE" "${wheels[@]}"
  fi
  echo "${#wheels[@]} wheel(s) installed into $SITE" >"$STAGE/installed"
  echo "[device-run] installed ${#wheels[@]} wheel(s) into $SITE" >&2
fi

# PYTHONPATH entries are not site folders: their .pth files (nvidia-cutlass-dsl's puts `cutlass`
# on sys.path that way) would be ignored. Let site.addsitedir process them once, keep the paths
# they add.
pth_paths=$("$PY" -c 'import site, sys
before = list(sys.path)
site.addsitedir(sys.argv[1])
print(":".join(p for p in sys.path if p not in before and p != sys.argv[1]))' "$SITE")
export PYTHONPATH=$SITE${pth_paths:+:$pth_paths}${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -f "$STAGE/liveness.json" ]; then export OVERLAY_LIVENESS=$STAGE/liveness.json; fi
[ $# -gt 0 ] && exec "$@"
echo "[device-run] staged into $SITE (every carry in)" >&2
