"""A tiny Llama model for the real vLLM engines, made at test time with no
download: the byte-level BPE tokenizer of tokenizer_fixtures.py (trained on
local text), a ChatML chat template that writes BOS, and a randomly
initialised ``LlamaForCausalLM`` of about a million parameters saved with
``save_pretrained``.

It needs ``torch`` and ``transformers``, which live in the engine's own
environment (``.venv-engine``, see scripts/setup-engine), so it runs there as a
script: ``.venv-engine/bin/python tests/tiny_model.py DIR``; ``build(DIR)``
does that from the test environment.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tokenizer_fixtures import CHAT_TEMPLATE, build_tokenizer

ROOT = Path(__file__).resolve().parent.parent
#: The engine's environment (vLLM, torch, transformers): scripts/setup-engine.
ENGINE_PYTHON = ROOT / ".venv-engine" / "bin" / "python"

#: The name the engines serve the model under (``--served-model-name``).
MODEL_NAME = "tiny-llama"
BOS = "<s>"
EOS = "<|im_end|>"
#: ChatML with BOS first, as Llama-style templates write it.
TEMPLATE = "{{ bos_token }}" + CHAT_TEMPLATE
#: The longest sequence the model takes (prompt and answer).
MAX_MODEL_LEN = 2048


def build(out: Path) -> Path:
    """Makes the model in ``out`` (created) with the engine's Python; returns ``out``."""
    subprocess.run(
        [str(ENGINE_PYTHON), __file__, str(out)],
        check=True,
        timeout=300,
        cwd=Path(__file__).parent,
    )
    return out


def _write(out: Path) -> None:
    """Writes the tokenizer, its config and the model into ``out`` (the
    engine's Python only: it imports torch and transformers)."""
    import json

    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_file(str(build_tokenizer(out / "tokenizer.json")))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": BOS,
                "eos_token": EOS,
                "chat_template": TEMPLATE,
                "model_max_length": MAX_MODEL_LEN,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=MAX_MODEL_LEN,
        bos_token_id=tokenizer.token_to_id(BOS),
        eos_token_id=tokenizer.token_to_id(EOS),
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)


if __name__ == "__main__":
    _write(Path(sys.argv[1]))
