"""classify() on real text found on this machine, and on CJK samples written here."""

import json
import os
import sysconfig
from pathlib import Path

import pytest

from routecore import classify

STDLIB = Path(sysconfig.get_paths()["stdlib"])
LICENSES = Path("/usr/share/common-licenses")

CODE_FILES = [Path(os.__file__), Path(json.__file__), STDLIB / "argparse.py", STDLIB / "shutil.py"]
CODE_FILES += [
    p for p in [Path("/usr/include/stdio.h"), Path("/usr/include/string.h")] if p.exists()
]
PROSE_FILES = [STDLIB / "LICENSE.txt"]
PROSE_FILES += [LICENSES / n for n in ["GPL-3", "Apache-2.0", "MPL-2.0"] if (LICENSES / n).exists()]


@pytest.mark.parametrize("path", CODE_FILES, ids=lambda p: p.name)
def test_real_source_files_are_code(path):
    assert classify(path.read_bytes()) == "code"


@pytest.mark.parametrize("path", PROSE_FILES, ids=lambda p: p.name)
def test_real_prose_is_prose(path):
    assert classify(path.read_text("utf-8")) == "prose"


@pytest.mark.parametrize(
    "text",
    [
        "大型语言模型的推理服务需要根据请求的长度选择合适的实例池。短请求占大多数。",
        "このドキュメントを三行で要約してください。重要な数字は残してください。",
        "오늘은 날씨가 좋습니다. 내일도 맑을 것입니다.",
    ],
)
def test_cjk(text):
    assert classify(text) == "cjk"


@pytest.mark.parametrize(
    "text",
    [
        "请把这段 English text 翻译成中文, and keep every name and number as it is in the text.",
        "Привет! Как дела? Всё хорошо, спасибо. Hello and welcome.",
        "Install the package with pip, then build a router from your pools. The router\n"
        "estimates each request's total budget and picks the smallest pool that holds it.\n"
        "Requests that fit no pool are rejected rather than truncated, and the decision\n"
        "names the pool and the estimate it was made on, so you can log both.\n\n"
        "    pools = [Pool('short', 8192), Pool('long', 65536)]\n"
        "    router = TokenBudgetRouter(pools)\n"
        "    d = router.route(len(body), 'prose', 8192)\n"
        "    print(d.pool, d.est_total_tokens)\n\n"
        "Feed the usage numbers of every response back, and the estimate improves.",
    ],
)
def test_mixed(text):
    assert classify(text) == "mixed"


def test_str_and_bytes_agree_and_edge_cases():
    text = PROSE_FILES[0].read_text("utf-8")
    assert classify(text) == classify(text.encode())
    assert classify("") == "prose"
    assert classify(b"\xff\xfe\x00 invalid utf-8 \x80") == "prose"
    with pytest.raises(TypeError):
        classify(42)


def test_huge_prompt_reads_a_bounded_sample():
    code = CODE_FILES[0].read_bytes()
    huge = code * (40_000_000 // len(code))  # ~40 MB
    assert classify(huge) == "code"
    # Only the head and tail are read: prose in the middle does not count.
    sandwich = code[:40_000] + b"The quick brown fox. " * 1_000_000 + code[-40_000:]
    assert classify(sandwich) == "code"
