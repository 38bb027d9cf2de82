"""A small byte-level BPE tokenizer, trained at test time with the Hugging Face
``tokenizers`` package (no download), and a ChatML chat template."""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

WORDS = (
    "the a of to and in request router token budget pool prefix cache engine model "
    "prompt latency queue tenant admission block hash endpoint replica context window "
    "route send answer measure learn count exact estimate bytes per second fleet GPU "
    "def return import class self value list dict for while if else print 42 3.14 "
    "数据 路由 模型 (x) [y] {z} == != -> => :: // # @ ! ? , . ;"
).split()

#: ChatML, as Qwen and others write it.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<s>", "<|im_start|>", "<|im_end|>"]


def corpus(n: int, seed: int = 0) -> list[str]:
    """``n`` lines of words from WORDS, with varied spacing and line breaks."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        words = rng.choices(WORDS, k=rng.randint(3, 30))
        sep = rng.choice([" ", " ", " ", "  ", "\n", "\t"])
        lines.append(sep.join(words))
    return lines


def build_tokenizer(path: Path, vocab_size: int = 600, lines: int = 2000) -> Path:
    """Trains a GPT-2-style byte-level BPE (its pre-tokenizer regex has
    look-arounds) with BOS added by its post-processor; saves ``tokenizer.json``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(lines), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    tok.save(str(path))
    return path


def render_chatml(messages: list[dict[str, str]]) -> str:
    """CHAT_TEMPLATE by hand, for one turn per message."""
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"
