"""``routecore compress``: compress prose files with the extractive compressor
and report fidelity (ROUGE-L recall, TF-IDF cosine), one JSON line a file."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from routecore._core import MAX_TOKENS, Compressor
from routecore.commands._args import positive_float, proper_fraction, token_count
from routecore.fidelity import rouge_l_recall, tfidf_cosine

NAME = "compress"
HELP = (
    "Compress text files (prose, CJK) to a token budget with the extractive "
    "compressor of FleetOpt section 5.2; prints one JSON line a file with the "
    "token counts, the reduction, ROUGE-L recall and TF-IDF cosine. Without FILE, "
    "compresses the license texts Debian ships in /usr/share/common-licenses."
)
# Real prose every Debian machine has (package base-files): the fidelity corpus.
COMMON_LICENSES = Path("/usr/share/common-licenses")
DEFAULT_CORPUS = (
    "Apache-2.0",
    "Artistic",
    "CC0-1.0",
    "GFDL-1.3",
    "GPL-2",
    "GPL-3",
    "LGPL-2.1",
    "MPL-1.1",
    "MPL-2.0",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="*", help="UTF-8 text files (default: the license corpus)")
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--reduction",
        type=proper_fraction,
        default=0.15,
        help="cut each text by this share of its estimated tokens (default 0.15, the "
        "paper's operating point)",
    )
    group.add_argument("--budget", type=token_count, help="token budget for every file instead")
    p.add_argument(
        "--bytes-per-token",
        type=positive_float,
        help="ratio of the estimate ceil(bytes / ratio) (default: per category)",
    )
    p.add_argument("--output-dir", help="write each compressed text here, same file name")


def default_files() -> list[Path]:
    return [COMMON_LICENSES / name for name in DEFAULT_CORPUS if (COMMON_LICENSES / name).exists()]


def study(
    text: str,
    compressor: Compressor,
    reduction: float = 0.15,
    budget: int | None = None,
    bytes_per_token: float | None = None,
) -> tuple[dict[str, object], str]:
    """Compresses one text; returns its report and the compressed text."""
    if budget is None:
        if not 0.0 <= reduction < 1.0:
            raise ValueError(f"reduction must be in [0, 1), got {reduction}")
        full = compressor.compress(text, MAX_TOKENS, bytes_per_token=bytes_per_token)
        budget = max(1, math.floor(full.tokens_before * (1.0 - reduction)))
    r = compressor.compress(text, budget, bytes_per_token=bytes_per_token)
    report: dict[str, object] = {
        "status": r.status,
        "budget": budget,
        "tokens_before": r.tokens_before,
        "tokens_after": r.tokens_after,
        "reduction": round(1 - r.tokens_after / max(r.tokens_before, 1), 4),
        "sentences": r.sentences,
        "kept": len(r.kept_sentence_indices),
        "rouge_l_recall": round(rouge_l_recall(text, r.text), 4),
        "tfidf_cosine": round(tfidf_cosine(text, r.text), 4),
    }
    return report, r.text


def run(args: argparse.Namespace) -> int:
    files = [Path(f) for f in args.files] or default_files()
    if not files:
        print("routecore compress: no files (and no /usr/share/common-licenses)", file=sys.stderr)
        return 2
    compressor = Compressor()
    reports = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        report, out = study(text, compressor, args.reduction, args.budget, args.bytes_per_token)
        print(json.dumps({"file": str(path), **report}))
        reports.append(report)
        if args.output_dir:
            Path(args.output_dir).mkdir(parents=True, exist_ok=True)
            (Path(args.output_dir) / path.name).write_text(out, encoding="utf-8")
    done = [r for r in reports if r["status"] == "compressed"]
    if done:
        means = {
            k: round(sum(float(r[k]) for r in done) / len(done), 4)  # type: ignore[arg-type]
            for k in ("reduction", "rouge_l_recall", "tfidf_cosine")
        }
        print(
            f"compressed {len(done)} of {len(reports)} files: mean reduction "
            f"{means['reduction']:.3f}, ROUGE-L recall {means['rouge_l_recall']:.3f}, "
            f"TF-IDF cosine {means['tfidf_cosine']:.3f}",
            file=sys.stderr,
        )
    return 0
