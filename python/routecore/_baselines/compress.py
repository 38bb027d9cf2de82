"""Plain-Python twin of routecore's extractive compressor (rust/compress.rs),
for the benchmark: the same sentence splitting, scores (TextRank over the
cosine sentence graph, position, TF-IDF, novelty), lazy greedy selection and
budget check, written the way a Python gateway would write it."""

from __future__ import annotations

import heapq
import math

STOP_WORDS = frozenset(
    "a an and are as at be been but by can do does for from had has have he her his if in "
    "into is it its may no not of on or our she so such than that the their them then there "
    "these they this those to was we were what when which who will with would you your".split()
)
ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st vs etc e.g i.e cf al fig figs no nos vol pp ed eds inc ltd co "
    "corp approx u.s u.k a.m p.m ph.d sec art ch".split()
)
CLOSERS = frozenset("\"')]”’»」』）】〉》〕")
CJK_TERMINALS = frozenset("。！？．｡")
LATIN_TERMINALS = frozenset(".!?…")
DAMPING, ITERATIONS, TOLERANCE = 0.85, 50, 1e-6


def is_cjk(c: str) -> bool:
    o = ord(c)
    return (
        0x3000 <= o <= 0x303F
        or 0x3040 <= o <= 0x30FF
        or 0x3400 <= o <= 0x4DBF
        or 0x4E00 <= o <= 0x9FFF
        or 0xAC00 <= o <= 0xD7AF
        or 0x1100 <= o <= 0x11FF
        or 0xF900 <= o <= 0xFAFF
        or 0xFF00 <= o <= 0xFFEF
        or 0x20000 <= o <= 0x2FA1F
    )


def item_marker_at(t: str, k: int) -> bool:
    if k >= len(t):
        return False
    if t[k] in "-*+•#":
        return k + 1 < len(t) and t[k + 1] in " \t#"
    if t[k].isascii() and t[k].isdigit():
        j = k
        while j < len(t) and t[j].isascii() and t[j].isdigit():
            j += 1
        return j + 1 < len(t) and t[j] in ".)" and t[j + 1] in " \t"
    return False


def fence_end(t: str, k: int) -> int | None:
    j = k
    while j < len(t) and t[j] in " \t":
        j += 1
    if not t.startswith("```", j):
        return None
    line = t.find("\n", j + 3)
    while line != -1:
        s = line + 1
        while s < len(t) and t[s] in " \t":
            s += 1
        if t.startswith("```", s):
            end = t.find("\n", s)
            return len(t) if end == -1 else end + 1
        line = t.find("\n", line + 1)
    return len(t)


def period_ends_sentence(t: str, k: int) -> bool:
    s = k
    while s > 0 and not t[s - 1].isspace() and t[s - 1] not in CLOSERS:
        s -= 1
    word = t[s:k].lstrip("([\"'")
    if len(word) == 1 and word.isalpha():
        return False
    if word.lower() in ABBREVIATIONS:
        return False
    for c in t[k + 1 :]:
        if not c.isspace() and c not in CLOSERS:
            return not c.islower()
    return True


def split_sentences(t: str) -> list[tuple[int, int, bool]]:
    spans: list[list] = []
    start = 0

    def push(end: int, pinned: bool) -> None:
        nonlocal start
        if end <= start:
            return
        if not t[start:end].strip():
            if spans:
                spans[-1][1] = end
                start = end
            return
        spans.append([start, end, pinned])
        start = end

    n, k, line_start = len(t), 0, True
    while k < n:
        if line_start:
            end = fence_end(t, k)
            if end is not None:
                push(k, False)
                push(end, True)
                k = end
                continue
        line_start = False
        c = t[k]
        if c == "\n":
            j, last_nl = k + 1, k
            while j < n and t[j].isspace():
                if t[j] == "\n":
                    last_nl = j
                j += 1
            if (
                last_nl > k
                or j >= n
                or item_marker_at(t, j)
                or fence_end(t, last_nl + 1) is not None
            ):
                push(last_nl + 1, False)
                k, line_start = last_nl + 1, True
                continue
            k += 1
            continue
        latin = c in LATIN_TERMINALS
        if not (latin or c in CJK_TERMINALS):
            k += 1
            continue
        j = k + 1
        while j < n and (t[j] in CLOSERS or t[j] in LATIN_TERMINALS):
            j += 1
        if latin:
            spaced = j >= n or t[j].isspace() or is_cjk(t[j])
            ends = spaced and (c != "." or j > k + 1 or period_ends_sentence(t, k))
        else:
            ends = True
        if not ends:
            k = j
            continue
        last_nl = None
        while j < n and t[j].isspace():
            if t[j] == "\n":
                last_nl = j
            j += 1
        end = last_nl + 1 if last_nl is not None and j < n else j
        push(end, False)
        line_start = end > 0 and t[end - 1] == "\n"
        k = end
    push(n, False)
    if not spans and t:
        spans.append([0, n, False])
    return [(s, e, p) for s, e, p in spans]


def sentence_terms(t: str, spans) -> list[dict[str, int]]:
    out = []
    for s, e, _ in spans:
        counts: dict[str, int] = {}
        word: list[str] = []
        prev = None

        def flush(word=word, counts=counts) -> None:
            w = "".join(word)
            if len(w) > 1 and w not in STOP_WORDS:
                counts[w] = counts.get(w, 0) + 1
            word.clear()

        for c in t[s:e]:
            if c.isascii():
                prev = None
                if c.isalnum():
                    word.append(c.lower())
                else:
                    flush()
            elif c.isalpha() and is_cjk(c):
                flush()
                if prev is not None:
                    counts[prev + c] = counts.get(prev + c, 0) + 1
                prev = c
            elif c.isalnum():
                prev = None
                word.append(c.lower())
            else:
                prev = None
                flush()
        flush()
        out.append(counts)
    return out


def scale(xs: list[float]) -> list[float]:
    m = max(xs, default=0.0)
    return [x / m for x in xs] if m > 0 else xs


def textrank(terms: list[dict[str, int]]) -> list[float]:
    n = len(terms)
    inv = [1 / math.sqrt(len(s)) if s else 0.0 for s in terms]

    def product(y: list[float]) -> list[float]:
        by_term: dict[str, float] = {}
        for i, s in enumerate(terms):
            v = y[i] * inv[i]
            for term in s:
                by_term[term] = by_term.get(term, 0.0) + v
        return [
            max(sum(by_term[term] for term in s) * inv[i] - (y[i] if s else 0.0), 0.0)
            for i, s in enumerate(terms)
        ]

    degree = product([1.0] * n)
    rank = [1.0] * n
    for _ in range(ITERATIONS):
        inflow = product([r / d if d > 0 else 0.0 for r, d in zip(rank, degree)])
        nxt = [(1 - DAMPING) + DAMPING * x for x in inflow]
        delta = sum(abs(a - b) for a, b in zip(nxt, rank))
        rank = nxt
        if delta < TOLERANCE * n:
            break
    return scale(rank)


def compress(
    text: str,
    token_budget: int,
    bytes_per_token: float = 4.0,
    weights: tuple[float, float, float, float] = (0.20, 0.40, 0.35, 0.05),
    keep_first: int = 3,
    keep_last: int = 2,
) -> tuple[str, list[int]]:
    """The kept text and sentence indices within ``token_budget`` tokens by
    ``ceil(bytes / bytes_per_token)``; the text unchanged when it fits or the
    first and last sentences alone do not."""
    spans = split_sentences(text)
    sizes = [len(text[s:e].encode()) for s, e, _ in spans]
    n = len(spans)
    if math.ceil(sum(sizes) / bytes_per_token) <= token_budget:
        return text, list(range(n))
    max_bytes = math.floor(token_budget * bytes_per_token)
    while max_bytes > 0 and math.ceil(max_bytes / bytes_per_token) > token_budget:
        max_bytes -= 1
    while math.ceil((max_bytes + 1) / bytes_per_token) <= token_budget:
        max_bytes += 1
    kept = [i < keep_first or i + keep_last >= n or spans[i][2] for i in range(n)]
    used = sum(size for size, k in zip(sizes, kept) if k)
    if used > max_bytes:
        return text, list(range(n))
    terms = sentence_terms(text, spans)
    df: dict[str, int] = {}
    tf_doc: dict[str, int] = {}
    for s in terms:
        for term, count in s.items():
            df[term] = df.get(term, 0) + 1
            tf_doc[term] = tf_doc.get(term, 0) + count
    idf = {term: math.log((1 + n) / (1 + d)) + 1 for term, d in df.items()}
    tfidf = scale(
        [sum(c * tf_doc[t] * idf[t] for t, c in s.items()) / (1 + sum(s.values())) for s in terms]
    )
    tr = textrank(terms)
    position = scale([1 / math.sqrt(1 + min(i, n - 1 - i)) for i in range(n)])
    w_tr, w_pos, w_tfidf, w_nov = weights
    base = [w_tr * tr[i] + w_pos * position[i] + w_tfidf * tfidf[i] for i in range(n)]
    covered: set[str] = set()
    for i in range(n):
        if kept[i]:
            covered.update(terms[i])

    def novelty(i: int) -> float:
        s = terms[i]
        return sum(t not in covered for t in s) / len(s) if s else 0.0

    heap = [(-(base[i] + w_nov * novelty(i)), i) for i in range(n) if not kept[i]]
    heapq.heapify(heap)
    smallest = min((sizes[i] for i in range(n) if not kept[i]), default=0)
    while heap:
        _, i = heapq.heappop(heap)
        if used + smallest > max_bytes:
            break
        if sizes[i] + used > max_bytes:
            continue
        score = base[i] + w_nov * novelty(i)
        if heap and (-heap[0][0], -heap[0][1]) > (score, -i):
            heapq.heappush(heap, (-score, i))
            continue
        kept[i] = True
        used += sizes[i]
        covered.update(terms[i])
    indices = [i for i in range(n) if kept[i]]
    return "".join(text[spans[i][0] : spans[i][1]] for i in indices), indices
