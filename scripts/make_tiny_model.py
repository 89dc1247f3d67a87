"""Build the tiny random-weight Llama that pd-serve runs on the CPU.

No model can be downloaded on the machines this project is developed and tested on, so the
project makes its own: a 2-layer Llama with random weights from a fixed seed and a byte-level
BPE tokenizer trained on ``scripts/tiny_corpus.txt``, which the repo ships. Every input is fixed,
so the output folder is byte-identical on every run and machine (``tests/unit/test_tiny_model.py``
builds it twice and compares hashes).

A second recipe, ``--recipe medium`` (hidden 256, 4 layers, about 3.5 M parameters, 14 MB), is
large enough that a long prompt's prefill costs what it does on a real model relative to a decode
step (a 2,048-token prefill takes about 130 ms on one core here, a decode step of 8 requests 2 ms), so
``scripts/bench_goodput.py`` can show what disaggregation buys; the tiny model's prefill is nearly
free, so on it only overhead can be measured. The benchmark builds it on demand; ``make`` does not.

Usage: ``python scripts/make_tiny_model.py [--recipe tiny|medium] [OUT_DIR]`` (default
``.cache/tiny-llama`` or ``.cache/medium-llama``). The folder is written atomically: a half-built
model never sits at OUT_DIR.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CORPUS = REPO_ROOT / "scripts" / "tiny_corpus.txt"
SEED = 1234


@dataclass(frozen=True)
class Recipe:
    """A Llama shape. head_dim must be one the CPU attention backend accepts (32, 64, 80, ...)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int


RECIPES = {
    "tiny": Recipe(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32
    ),
    "medium": Recipe(
        hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32
    ),
}


def default_out(recipe: str) -> Path:
    return REPO_ROOT / ".cache" / f"{recipe}-llama"


DEFAULT_OUT = default_out("tiny")

# Sizes the CPU attention backend accepts (head_dim 32); vocab_size leaves room above the
# tokenizer's own vocabulary so a bigger corpus never overflows the embedding.
VOCAB_SIZE = 1024
MAX_POSITIONS = 4096
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

# A small chat template in the style of the Zephyr/Phi family: each message is framed by a
# role tag and <|end|>; add_generation_prompt opens the assistant's turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def build_tokenizer(out_dir: Path) -> int:
    """Train the BPE tokenizer and save it in Hugging Face form; returns its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = CORPUS.read_text(encoding="utf-8")
    tokenizer.train_from_iterator(text.splitlines(), trainer=trainer)
    # Like Llama: BOS is prepended when special tokens are added (completions); chat prompts get
    # it from the template instead.
    bos_id = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)])

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<unk>",
        model_max_length=MAX_POSITIONS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return tokenizer.get_vocab_size()


def build_model(out_dir: Path, bos_id: int, eos_id: int, recipe: Recipe = RECIPES["tiny"]) -> None:
    """Random Llama weights from a fixed seed, saved as safetensors (float32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        **asdict(recipe),
        max_position_embeddings=MAX_POSITIONS,
        # A wide init keeps the logits peaked, so greedy argmax has clear margins and does not
        # flip on the last-bit differences between batch shapes.
        initializer_range=0.3,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=0,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.eval()
    model.save_pretrained(str(out_dir), safe_serialization=True)
    # generation_config.json records library defaults only; drop it so nothing depends on it.
    (out_dir / "generation_config.json").unlink(missing_ok=True)


def folder_digest(folder: Path) -> str:
    """SHA-256 over every file's relative path and bytes: equal digests mean equal folders."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(folder)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def build(out_dir: Path, recipe: str = "tiny") -> str:
    """Build into a temporary sibling folder, then move it into place; returns the digest."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        build_tokenizer(tmp)
        vocab = json.loads((tmp / "tokenizer.json").read_text())["model"]["vocab"]
        build_model(tmp, bos_id=vocab["<s>"], eos_id=vocab["</s>"], recipe=RECIPES[recipe])
        digest = folder_digest(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
        return digest
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="tiny")
    parser.add_argument("out_dir", nargs="?", type=Path, default=None)
    args = parser.parse_args(argv)
    out_dir = args.out_dir or default_out(args.recipe)
    digest = build(out_dir, args.recipe)
    print(f"{args.recipe} model written to {out_dir} (sha256 {digest})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
