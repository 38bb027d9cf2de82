"""Token counting from Python the way routers do it today: the chat rendered in
Python, then the Hugging Face `tokenizers` package's `Tokenizer.encode`, the
reference people call (its core is the same Rust library routecore links; the
difference is the Python side: the render, the call, the `Encoding` object)."""

from __future__ import annotations

from pathlib import Path

import tokenizers

from tests.tokenizer_fixtures import render_chatml


class ReferenceCounter:
    def __init__(self, path: Path) -> None:
        self.tokenizer = tokenizers.Tokenizer.from_file(str(path))

    def count_chat(self, messages: list[dict[str, str]]) -> int:
        encoding = self.tokenizer.encode(render_chatml(messages), add_special_tokens=False)
        return len(encoding.ids)
