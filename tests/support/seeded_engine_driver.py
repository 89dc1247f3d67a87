"""One vLLM CPU engine in this process, seeded sampling through it: run as a script by
tests/integration/test_seeded_sampling.py, in a fresh interpreter so that vLLM loads pd-serve's
general plug-ins (or not) from the environment it is given.

Argument: the engine's step budgets (``max_num_batched_tokens``), comma-separated; one engine is
built for each in turn. Prints one line, ``RESULT <json>``: for each budget, the sampled tokens of
one uninterrupted seeded request and of the same request resumed after ``EARLIER`` tokens (its
prompt followed by them, marked as the router marks a resumed attempt).
"""

from __future__ import annotations

import gc
import json
import os
import sys
from typing import Any

from serve_app.config.settings import DEFAULT_MODEL_DIR
from serve_app.wire.sampling import RESUMED_OUTPUT_TOKENS

# Nothing here changes the environment on import: the test module imports the constants, and an
# environment variable set in the test process would reach every engine the session starts.

PROMPT = [(i * 37) % 900 + 20 for i in range(300)]
MAX_TOKENS = 24
EARLIER = 10


def sample(llm: Any, prompt: list[int], max_tokens: int, extra_args: dict | None = None) -> list[int]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.95, seed=11, ignore_eos=True, extra_args=extra_args)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return list(out.outputs[0].token_ids)


def main(budgets: list[int]) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: seconds to start
    from vllm import LLM

    result = {}
    for budget in budgets:
        llm = LLM(
            model=str(DEFAULT_MODEL_DIR),
            enforce_eager=True,
            dtype="float32",
            max_model_len=2048,
            max_num_batched_tokens=budget,
            kv_cache_memory_bytes=64 << 20,
            enable_prefix_caching=False,
        )
        whole = sample(llm, PROMPT, MAX_TOKENS)
        resumed = sample(llm, PROMPT + whole[:EARLIER], MAX_TOKENS - EARLIER, {RESUMED_OUTPUT_TOKENS: EARLIER})
        result[budget] = {"whole": whole, "resumed": resumed}
        del llm
        gc.collect()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main([int(b) for b in sys.argv[1].split(",")])
