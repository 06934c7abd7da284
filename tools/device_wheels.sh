#!/usr/bin/env bash
# tools/device_wheels.sh DIR [--python X.Y] [--complete]
#
# Run on a CPU machine WITH the registry; carry DIR (e.g. `.whl`) to the GPU machine, which reaches nothing,
# and run tools/gpu_check.sh there (it installs DIR with --no-index --no-deps). DIR gets every wheel that
# megafixed's GPU run needs and the GPU image lacks, for CPython X.Y (default 3.12), manylinux x86_64:
#   * DeepSpeed, which has no wheel on the registry: built here, ops not pre-built and none JIT-built later
#     (`DS_BUILD_OPS=0 pip wheel --no-deps --no-build-isolation`; needs torch in this interpreter), py3-none-any;
#   * megatron-core (a cpXY manylinux wheel);
#   * every Requires-Dist of theirs and of megafixed (setup.py), transitively, that the image lacks.
# One version of each. The closure is checked at the end: every requirement of every wheel in DIR is met by a
# wheel in DIR or by the image (IMAGE below), or the script names what is missing and exits 1.
#   --python X.Y   target another interpreter (the CPU test builds for its own)
#   --complete     carry every dependency but torch (and torch's own dependencies, which come with torch), the
#                  ones the GPU check never imports included: for a bare virtualenv that holds only torch, as the
#                  CPU test of gpu_check.sh uses
set -euo pipefail
usage() { echo "usage: tools/device_wheels.sh DIR [--python X.Y] [--complete]" >&2; exit 2; }
[ $# -ge 1 ] || usage
DIR=$1; shift
PYV=3.12; COMPLETE=0
while [ $# -gt 0 ]; do
    case $1 in
        --python) [ $# -ge 2 ] || usage; PYV=$2; shift 2 ;;
        --complete) COMPLETE=1; shift ;;
        *) usage ;;
    esac
done
[[ $PYV =~ ^3\.[0-9]+$ ]] || { echo "error: --python wants X.Y (e.g. 3.12), got $PYV" >&2; exit 2; }
cd "$(dirname "$0")/.."
REPO=$(pwd)
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
PY=${PYTHON:-python3}
DEEPSPEED=deepspeed==0.19.8
MEGATRON=megatron-core==0.16.1
# The GPU image (the H200 test machine): Python 3.12, torch 2.11.0 built for CUDA 13, triton 3.6.0 and torch's
# own dependencies (versions as resolved for torch==2.11.0, cp312, manylinux_2_28_x86_64). Nothing else is
# assumed: DeepSpeed's small dependencies that the image may well have (numpy, packaging, einops, msgpack, ninja,
# psutil, py-cpuinfo, tqdm: 20 MiB) are carried anyway, since a missing one would cost a whole device attempt
# and a carried one only shadows the image's copy. --complete carries neither torch nor these (they come with it).
PRESENT="torch==2.11.0 triton==3.6.0 filelock==3.20.0 typing-extensions==4.15.0 setuptools==80.9.0
sympy==1.14.0 mpmath==1.3.0 networkx==3.5 jinja2==3.1.6 markupsafe==3.0.3 fsspec==2025.9.0
cuda-toolkit==13.0.2 cuda-bindings==13.0.3 nvidia-cudnn-cu13==9.19.0.56 nvidia-cusparselt-cu13==0.8.0
nvidia-nccl-cu13==2.28.9 nvidia-nvshmem-cu13==3.4.5"
# Left out by default: megafixed requires them, the GPU check never imports them (parquet input to
# `preprocess`; TensorBoard events, which the check's runs turn off), and with their dependencies they weigh
# about 70 MiB: with them the set (110 MiB) would not fit the device machine's carry limit (64 MiB in all).
LEAVE_OUT="pyarrow tensorboard"
[ "$COMPLETE" = 1 ] && LEAVE_OUT=""

echo "device wheels for CPython $PYV manylinux x86_64 -> $DIR ($([ "$COMPLETE" = 1 ] && echo "complete: all but torch" || echo "what the GPU image lacks"))"
# DeepSpeed: build once (pure Python without ops, so one wheel serves every interpreter). Built on a CPU box, its
# metadata says accelerator_name='cpu' and no op installed: harmless, since at run time the accelerator is detected
# afresh (cuda) and megafixed loads no DeepSpeed op (torch's AdamW); gpu_check.sh fails if one is ever JIT-built.
if ! ls "$DIR"/deepspeed-0.19.8-*.whl >/dev/null 2>&1; then
    build=$(mktemp -d)
    trap 'rm -rf "$build"' EXIT
    DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$build" "$DEEPSPEED" \
        || { echo "error: building the DeepSpeed wheel failed (it needs torch, setuptools and wheel here)" >&2; exit 1; }
    mv "$build"/deepspeed-*.whl "$DIR"/
fi

# The rest: fixed point over Requires-Dist, one `pip download --no-deps` round per level, then the closure check.
"$PY" - "$DIR" "$PYV" "$REPO/setup.py" "$MEGATRON" "$PRESENT" "$LEAVE_OUT" <<'PYEOF'
import ast, os, subprocess, sys, zipfile
from email.parser import Parser
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

wheel_dir, pyv, setup_py, megatron, present, leave_out = sys.argv[1:7]
leave_out = {canonicalize_name(n) for n in leave_out.split()}
image = {canonicalize_name(s.split("==")[0]): Version(s.split("==")[1]) for s in present.split()}
env = {**default_environment(), "python_version": pyv, "python_full_version": pyv + ".0", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
tag = "cp" + pyv.replace(".", "")
platforms = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64", "linux_x86_64"]


def install_requires():
    tree = ast.parse(open(setup_py).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            return [ast.literal_eval(e) for e in node.value.elts]
    raise SystemExit("error: no install_requires in setup.py")


def wheels():
    out = {}
    for f in os.listdir(wheel_dir):
        if f.endswith(".whl"):
            name, version, _, _ = parse_wheel_filename(f)
            if name in out:
                raise SystemExit(f"error: two versions of {name} in {wheel_dir}: {out[name][1]} and {f}")
            out[name] = (version, f)
    return out


def requires(f):
    with zipfile.ZipFile(os.path.join(wheel_dir, f)) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = Parser().parsestr(z.read(meta).decode())
    reqs = [Requirement(r) for r in msg.get_all("Requires-Dist") or []]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(env)]


def needed(reqs, have):
    """Requirements met neither by the image nor by a wheel already in the directory."""
    todo = {}
    for r in reqs:
        name = canonicalize_name(r.name)
        if name == "megafixed" or (name in image and r.specifier.contains(image[name], prereleases=True)):
            continue  # an image package too old for a requirement is carried (ahead of it on the path)
        if name in have:
            if not r.specifier.contains(have[name][0], prereleases=True):
                raise SystemExit(f"error: {have[name][1]} does not satisfy {r} (needed by another wheel): "
                                 f"pin a version that satisfies both in tools/device_wheels.sh")
            continue
        todo.setdefault(name, []).append(str(r.specifier))
    return {n: ",".join(s for s in specs if s) for n, specs in todo.items()}


def download(todo):
    args = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:", "--python-version",
            pyv, "--implementation", "cp", "--abi", tag, "--abi", "abi3", "--abi", "none", "-d", wheel_dir]
    for p in platforms:
        args += ["--platform", p]
    specs = [f"{n}{s}" for n, s in sorted(todo.items())]
    print("  downloading", " ".join(specs), flush=True)
    if subprocess.run(args + specs).returncode != 0:
        raise SystemExit(f"error: pip could not download {' '.join(specs)} for CPython {pyv} manylinux x86_64")


top = [r for r in map(Requirement, install_requires()) if canonicalize_name(r.name) not in leave_out]
top.append(Requirement(megatron))
for _ in range(20):  # levels of the dependency tree
    have = wheels()
    reqs = list(top)
    for name, (_, f) in have.items():
        reqs += requires(f)
    todo = needed(reqs, have)
    if not todo:
        break
    download(todo)
# The closure check, on what is now in the directory.
have, missing = wheels(), []
for name, (_, f) in sorted(have.items()):
    for r in requires(f) + (top if name == "deepspeed" else []):
        n = canonicalize_name(r.name)
        ok_image = n in image and r.specifier.contains(image[n], prereleases=True)
        ok_wheel = n in have and r.specifier.contains(have[n][0], prereleases=True)
        if n in have and not ok_wheel or not (ok_image or ok_wheel or n == "megafixed"):
            missing.append(f"{r} (needed by {f})")
if missing:
    print("error: the wheel set is not closed; missing:\n  " + "\n  ".join(sorted(set(missing))), file=sys.stderr)
    sys.exit(1)
size = sum(os.path.getsize(os.path.join(wheel_dir, f)) for _, f in have.values())
left = f" (left out: {' '.join(sorted(leave_out))})" if leave_out else ""
print(f"{len(have)} wheels, {size / 2**20:.1f} MiB, closure complete{left}: " + " ".join(sorted(f for _, f in have.values())))
PYEOF
