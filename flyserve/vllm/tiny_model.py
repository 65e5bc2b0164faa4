"""A tiny random-weight Llama and a locally trained tokenizer, for CPU tests and the demo.

Why: the tests, the demo and the arms comparison need a real vLLM model directory on a
machine with no model hub. A 2-layer, hidden-128 Llama (about 2 MB on disk) is built in a
few seconds; its outputs are noise, but every batch shape vLLM produces is real.

The directory is a cache: building twice into the same directory reuses it (a marker file
written last says the build finished, so a half-written directory is rebuilt).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

# The model's shape (4 query heads, 2 KV heads: GQA like real models; head size 32).
HIDDEN = 128
LAYERS = 2
HEADS = 4
KV_HEADS = 2
VOCAB = 2048
MAX_POSITIONS = 4096
BUILD_VERSION = 1  # bump when the recipe changes; old caches are rebuilt

_MARKER = "flyserve-tiny-model.json"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_WORDS = [
    "attention",
    "kernel",
    "prefill",
    "decode",
    "batch",
    "token",
    "query",
    "key",
    "value",
    "cache",
    "block",
    "page",
    "rank",
    "step",
    "threshold",
    "policy",
    "route",
    "path",
    "unified",
    "causal",
    "latency",
    "throughput",
    "model",
    "layer",
    "head",
    "tensor",
    "the",
    "a",
    "of",
    "and",
    "to",
    "in",
    "is",
    "it",
    "that",
    "for",
    "on",
    "with",
    "as",
    "was",
    "by",
    "at",
    "from",
    "this",
    "be",
    "are",
    "or",
    "an",
    "which",
    "fly",
    "serve",
    "dispatch",
    "sidecar",
    "metric",
    "counter",
    "histogram",
    "gauge",
    "trace",
    "span",
    "operator",
    "profile",
]


def _training_text(n_lines: int = 4000, seed: int = 0) -> list[str]:
    """Deterministic pseudo-sentences (words, numbers, punctuation) for the BPE trainer."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        k = rng.randint(4, 16)
        words = [rng.choice(_WORDS) if rng.random() < 0.85 else str(rng.randint(0, 9999)) for _ in range(k)]
        lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
    return lines


def _build_tokenizer(vocab_size: int):
    """Byte-level BPE trained on generated text, wrapped as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=MAX_POSITIONS,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def is_built(model_dir: str | Path) -> bool:
    """True when ``model_dir`` holds a finished build of the current recipe."""
    marker = Path(model_dir) / _MARKER
    try:
        return json.loads(marker.read_text()).get("build_version") == BUILD_VERSION
    except (OSError, ValueError):
        return False


def build_tiny_model(model_dir: str | Path, *, seed: int = 0, dtype: str = "bfloat16") -> Path:
    """Build (or reuse) the tiny model in ``model_dir`` and return its path.

    Offline: sets HF_HUB_OFFLINE=1 for this process (nothing is downloaded). Random weights
    from ``seed`` (deterministic). Takes a few seconds the first time, nothing afterwards.
    """
    path = Path(model_dir)
    if is_built(path):
        return path
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(VOCAB)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        intermediate_size=4 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        torch_dtype=dtype,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / _MARKER).write_text(
        json.dumps({"build_version": BUILD_VERSION, "seed": seed, "dtype": dtype}) + "\n"
    )
    return path


def main() -> None:  # pragma: no cover - convenience: python -m flyserve.vllm.tiny_model DIR
    import sys

    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m flyserve.vllm.tiny_model DIR")
    print(build_tiny_model(sys.argv[1]))


if __name__ == "__main__":  # pragma: no cover
    main()
