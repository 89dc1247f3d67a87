#!/usr/bin/env bash
# Install pd-serve for Ascend NPUs into a virtual environment, the way vllm-ascend installs itself
# (its Dockerfile and installation guide, release v0.23.0.post1), on every node of the cluster.
#
# Why a script and not `pip install '.[ascend]'`: that cannot resolve. vLLM 0.23.0's wheels on PyPI
# require torch==2.11.0 where vllm-ascend pins torch==2.10.0; vllm-ascend is a source archive built
# against CANN; triton-ascend 3.2.2 is on Huawei's index only; and vllm-ascend caps fastapi below
# what Ray 2.60's serve needs. So, as vllm-ascend does:
#   1. torch, torch-npu, torchvision, torchaudio (on x86_64 the CPU build of torch, from PyTorch's
#      CPU index, as torch-npu requires);
#   2. vLLM v0.23.0 built from source with VLLM_TARGET_DEVICE=empty: no kernels, and only vLLM's
#      common requirements (no torch pin of its own);
#   3. vllm-ascend 0.23.0.post1 from its source archive (sha256-checked), its requirements first,
#      then the archive itself built against CANN with --no-deps --no-build-isolation;
#   4. triton-ascend last, from Huawei's index (it shares files with triton, which is removed);
#   5. Mooncake's NPU transfer engine, then pd-serve with Ray 2.60 and serve.
# Every step is constrained by scripts/ascend-constraints.txt. The one requirement left unmet on
# purpose is listed there (`override:` lines, each with its reason): it is left out of what step 3
# installs, and `pip check` at the end must report nothing else.
#
# Prerequisites (docs/ascend.md): Linux x86_64 or aarch64 with the NPU driver and firmware, CANN
# 9.1.0 and NNAL 9.1.0 with their environment sourced
#   source /usr/local/Ascend/ascend-toolkit/set_env.sh && source /usr/local/Ascend/nnal/atb/set_env.sh
# Python 3.11 or 3.12, gcc/g++, cmake, git; network access to PyPI, download.pytorch.org,
# mirrors.huaweicloud.com and github.com. Without npu-smi (a build host), set SOC_VERSION
# (Atlas A2: ascend910b1; A3: ascend910_9391).
#
# Usage:
#   scripts/install_ascend.sh [VENV]        install (default VENV: .venv-ascend in the repository;
#                                           not .venv, which `make` fills with the CPU build)
#   DRY_RUN=1 scripts/install_ascend.sh     print the install's commands, run nothing
#   scripts/install_ascend.sh requirements SDIST   vllm-ascend's requirements, less the overrides
#   scripts/install_ascend.sh check-pip < OUTPUT   fail on any `pip check` line that is no override
#   scripts/install_ascend.sh overrides     list the overrides and their reasons
# Environment: PYTHON (default python3), VLLM_SRC (a vLLM v0.23.0 checkout to use instead of
# cloning), WORK (download and build folder, default a fresh temporary one).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
CONSTRAINTS="$HERE/ascend-constraints.txt"
PYTHON=${PYTHON:-python3}

VLLM_REPO=https://github.com/vllm-project/vllm.git
VLLM_TAG=v0.23.0
VLLM_ASCEND_VERSION=0.23.0.post1
# As PyPI publishes it (the file scripts/fetch_reference.py fetches and checks). Fetched as a file,
# not with `pip download`, which would prepare its metadata and so need its build requirements.
VLLM_ASCEND_URL=https://files.pythonhosted.org/packages/ab/7a/32a1b1f13467fb7372588206fa1ffb735f28dcd8504d562f5c7ccdbd90d0/vllm_ascend-0.23.0.post1.tar.gz
VLLM_ASCEND_SHA256=a3b9f4a5dd7aa50c37e03d1f35937c4ae5aeacc49b734cac74d59ce5757738e1
CANN_VERSION=9.1.0
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ASCEND_INDEX=https://mirrors.huaweicloud.com/ascend/repos/pypi

# The helper behind `requirements`, `check-pip` and `overrides`: reads the override lines of the
# constraints file (package, requirement, reason) and compares requirements as `packaging` parses
# them, so spelling (fastapi<0.124.0 vs fastapi <0.124.0, vllm_ascend vs vllm-ascend) cannot matter.
HELPER_PY=$(
    cat <<'EOF'
import re
import sys
import tarfile
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

constraints, mode, *args = sys.argv[1:]


def key(package: str, requirement: str) -> tuple[str, str]:
    return canonicalize_name(package), str(Requirement(requirement))


overrides = {}
for line in open(constraints):
    m = re.match(r"#\s*override:\s*(\S+)\s+(.+?)\s*\|\s*(.+)$", line)
    if m:
        overrides[key(m[1], m[2])] = m[3]

if mode == "overrides":
    for (package, requirement), why in overrides.items():
        print(f"{package}: {requirement}: {why}")
elif mode == "requirements":
    # The archive's declared requirements (PKG-INFO) and its build requirements (pyproject.toml:
    # it is built without isolation), less the overrides; each once, in order.
    with tarfile.open(args[0]) as tar:
        top = tar.getnames()[0].split("/")[0]
        info = tar.extractfile(f"{top}/PKG-INFO").read().decode()
        build = tomllib.loads(tar.extractfile(f"{top}/pyproject.toml").read().decode())["build-system"]["requires"]
    name = re.search(r"^Name: (.+)$", info, re.M)[1].strip()
    declared = [line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("Requires-Dist:")]
    for requirement in dict.fromkeys(declared + build):
        if key(name, requirement) not in overrides:
            print(requirement)
elif mode == "check-pip":
    # `pip check` says "<name> <version> has requirement <req>, but you have <name> <version>."
    bad = []
    for line in sys.stdin:
        line = line.strip()
        if not line or line == "No broken requirements found.":
            continue
        m = re.match(r"^(\S+) \S+ has requirement (.+), but you have \S+ \S+\.$", line)
        if m and key(m[1], m[2]) in overrides:
            print(f"known, overridden: {line}")
        else:
            bad.append(line)
    for line in bad:
        print(f"pip check: {line}", file=sys.stderr)
    sys.exit(1 if bad else 0)
else:
    sys.exit(f"unknown helper mode {mode!r}")
EOF
)
helper() {
    "$PYTHON" -c "$HELPER_PY" "$CONSTRAINTS" "$@"
}

case "${1:-}" in
    requirements | check-pip | overrides)
        helper "$@"
        exit $?
        ;;
    -h | --help)
        sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
        exit 0
        ;;
esac

VENV=${1:-$ROOT/.venv-ascend}
DRY_RUN=${DRY_RUN:-}
run() {
    echo "+ $*"
    if [ -z "$DRY_RUN" ]; then "$@"; fi
}
die() {
    echo "install_ascend.sh: $*" >&2
    exit 1
}

# Preflight: what the build and the engines need from the host, checked before anything installs.
MACHINE=$(uname -m)
case "$MACHINE" in
    x86_64 | aarch64) ;;
    *) die "vllm-ascend is built for Linux x86_64 and aarch64, not $MACHINE" ;;
esac
PYVER=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
case "$PYVER" in
    3.11 | 3.12) ;;
    # starlette 1.10 (Ray 2.60's serve needs >=1.0.1) requires 3.11; vllm-ascend supports <3.13.
    *) die "Python $PYVER: use 3.11 or 3.12 (PYTHON=...)" ;;
esac
if [ -z "$DRY_RUN" ]; then
    [ -n "${ASCEND_HOME_PATH:-${ASCEND_TOOLKIT_HOME:-}}" ] \
        || die "CANN's environment is not set: source /usr/local/Ascend/ascend-toolkit/set_env.sh and /usr/local/Ascend/nnal/atb/set_env.sh (CANN and NNAL $CANN_VERSION)"
    command -v npu-smi >/dev/null || [ -n "${SOC_VERSION:-}" ] \
        || die "no npu-smi (NPU driver) and no SOC_VERSION: vllm-ascend's build cannot tell which chip to build for"
    command -v git >/dev/null || [ -n "${VLLM_SRC:-}" ] || die "git is needed to fetch vLLM $VLLM_TAG (or set VLLM_SRC)"
fi

# A constraints file of the caller's own would be applied on top of ours, and could pin what
# vllm-ascend needs otherwise: this install's constraints are the file above alone.
unset PIP_CONSTRAINT
WORK=${WORK:-$(mktemp -d -t pd-serve-ascend.XXXXXX)}
P="$VENV/bin/python"
PIP=("$P" -m pip install -c "$CONSTRAINTS" --extra-index-url "$TORCH_CPU_INDEX")

run "$PYTHON" -m venv "$VENV"
run "$P" -m pip install --upgrade pip packaging

# 1. PyTorch and the NPU adapter.
run "${PIP[@]}" torch torch-npu torchvision torchaudio

# 2. vLLM from source, no device: vLLM's common requirements only.
VLLM_SRC=${VLLM_SRC:-$WORK/vllm}
if [ ! -e "$VLLM_SRC/setup.py" ]; then
    run git clone --depth 1 --branch "$VLLM_TAG" "$VLLM_REPO" "$VLLM_SRC"
fi
run env VLLM_TARGET_DEVICE=empty "${PIP[@]}" "$VLLM_SRC"
# As vllm-ascend's Dockerfile: triton does not work on Ascend (triton-ascend replaces it in step 4).
run "$P" -m pip uninstall -y triton

# 3. vllm-ascend: its requirements (less the overrides), then the archive, built against CANN.
SDIST="$WORK/vllm_ascend-$VLLM_ASCEND_VERSION.tar.gz"
run "$P" -c 'import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])' "$VLLM_ASCEND_URL" "$SDIST"
if [ -z "$DRY_RUN" ]; then
    echo "$VLLM_ASCEND_SHA256  $SDIST" | sha256sum -c - >/dev/null || die "$SDIST is not the published vllm-ascend $VLLM_ASCEND_VERSION"
    PYTHON="$P" helper requirements "$SDIST" >"$WORK/vllm-ascend-requirements.txt"
    echo "vllm-ascend's requirements, less the overrides:"
    sed 's/^/  /' "$WORK/vllm-ascend-requirements.txt"
fi
run "${PIP[@]}" --extra-index-url "$ASCEND_INDEX" -r "$WORK/vllm-ascend-requirements.txt"
run "$P" -m pip install --no-deps --no-build-isolation "$SDIST"

# 4. triton-ascend last, as vllm-ascend's Dockerfile does: it and triton share the `triton` package.
run "$P" -m pip uninstall -y triton triton-ascend
run "${PIP[@]}" --extra-index-url "$ASCEND_INDEX" triton-ascend

# 5. Mooncake's NPU transfer engine (the MooncakeLayerwiseConnector's transport; its wheels need
# glibc 2.35, manylinux_2_35), then pd-serve with Ray 2.60 and serve (its base dependencies).
run "${PIP[@]}" mooncake-transfer-engine-npu
run "${PIP[@]}" -e "$ROOT"

# The whole environment: nothing broken but the overrides.
if [ -z "$DRY_RUN" ]; then
    "$P" -m pip check >"$WORK/pip-check.txt" || true
    PYTHON="$P" helper check-pip <"$WORK/pip-check.txt" || die "pip check reports requirements no override names (above)"
    run "$P" -c "import torch, torch_npu, vllm, vllm_ascend, ray, serve_app; print('torch', torch.__version__, 'npu available:', torch.npu.is_available()); print('vllm', vllm.__version__, 'ray', ray.__version__)"
else
    echo "+ $P -m pip check | install_ascend.sh check-pip"
fi
echo "installed into $VENV; start Ray on each node ($VENV/bin/ray start ...), then $VENV/bin/serve run configs/serve-ascend.yaml (docs/ascend.md)"
