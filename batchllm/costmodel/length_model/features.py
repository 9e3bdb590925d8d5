"""What the length model reads of a request, as one sparse row: hashed word and character
n-grams of the last user turn, hashed words of the system text, the template as a token of
its own, the prompt's size and settings, the size of the conversation before the last turn,
and explicit cues ("in one sentence", "a 300-word essay", "list 10 ...", "step by step", code
words).

Stateless (every text feature is hashed), so a saved model is its coefficients alone. A
change here changes the columns: bump FEATURES_VERSION, and models saved with another are
refused on load.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import scipy.sparse as sp

from batchllm.core.length_prompt import LengthPrompt

FEATURES_VERSION = 2
WORD_BITS, CHAR_BITS, SYSTEM_BITS, TEMPLATE_BITS = 18, 18, 14, 10
# Of the last user turn, its first and last characters (the instruction usually opens or
# closes a prompt; a long pasted text between says little and costs time):
WORD_CHARS = 400  # word 1-2 grams
CHAR_CHARS = 120  # char 3-5 grams

CHAR_NGRAMS = (3, 4, 5)


@functools.cache
def _vectorizers() -> tuple[Any, Any, Any]:
    """The hashed word n-grams of the last user turn, of the system message, and the template's
    name. sklearn is imported here, when the first prompt is featurised (it brings scipy.stats:
    about 3 s of a command's start that predicts no lengths)."""
    from sklearn.feature_extraction.text import HashingVectorizer

    return (HashingVectorizer(analyzer="word", ngram_range=(1, 2), n_features=2**WORD_BITS, alternate_sign=False,
                              token_pattern=r"(?u)\b\w+\b", dtype=np.float32),
            HashingVectorizer(analyzer="word", ngram_range=(1, 1), n_features=2**SYSTEM_BITS, alternate_sign=False,
                              dtype=np.float32),
            HashingVectorizer(analyzer=_template_name, n_features=2**TEMPLATE_BITS, alternate_sign=False, norm=None,
                              dtype=np.float32))


def _template_name(name: str) -> list[str]:
    return [name]

# A cue that is there or not: any of its words or word pairs among the text's (lower-cased
# [a-z0-9] runs, so "step-by-step" is "step by step"). Set look-ups: a regex of many
# alternatives per cue was 50x slower.
FLAGS = {
    "one_word": ("one word", "single word", "1 word"),
    "one_sentence": ("one sentence", "a sentence", "single sentence", "1 sentence", "two sentences", "2 sentences",
                     "two sentence"),
    "yes_no": ("yes or", "or no", "true or", "or false"),
    "only": ("number only", "code only", "answer only", "only the", "just the", "nothing else", "no explanation"),
    "brief": ("brief", "briefly", "short", "shortly", "concise", "concisely", "summary", "summarize", "summarise",
              "tl", "tldr", "quick", "quickly", "a few"),
    "detail": ("in detail", "detailed", "elaborate", "comprehensive", "thorough", "thoroughly", "in depth", "expand"),
    "explain": ("step by", "explain", "explanation", "why", "how do", "how does", "how can", "how to"),
    "essay": ("essay", "article", "blog", "report", "speech", "letter", "proposal"),
    "story": ("story", "narrative", "chapter", "scene", "fiction"),
    "poem": ("poem", "haiku", "limerick", "sonnet", "lyrics", "rap", "verse"),
    "list": ("list", "bullet", "bullets", "enumerate", "outline", "table", "examples", "ideas"),
    "code": ("python", "javascript", "java", "sql", "function", "code", "class", "script", "implement", "bash",
             "regex", "typescript", "api", "bug", "def", "return", "html", "css", "query", "program"),
    "one_liner": ("one liner", "one line", "single line"),
    "translate": ("translate", "translation", "in french", "in spanish", "in german", "in english", "in chinese", "into"),
    "rewrite": ("rewrite", "re write", "paraphrase", "proofread", "correct", "improve", "edit"),
    "write": ("write", "create", "generate", "compose", "draft", "describe"),
}
_FLAG_SETS = [frozenset(phrases) for phrases in FLAGS.values()]
_CODE_SIGNS = ("{", "`", "c++", "();", "=>")  # "code" also when any of these is in the text
_STARTS = {"continue": ("continue", "go on", "more", "keep going", "next", "and "),
           "what_is": ("what is", "what are", "who is", "who was", "when ", "where ", "which ", "what's")}
# A cue that carries a number: log1p(the number) before one of these words (within two
# words), 0 when there is none.
_NUMBER_WORDS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9,
                 "ten": 10, "twelve": 12, "fifteen": 15, "twenty": 20, "fifty": 50, "hundred": 100}
COUNTS = {
    "words_n": ("word", "words"),
    "sentences_n": ("sentence", "sentences", "line", "lines"),
    "paragraphs_n": ("paragraph", "paragraphs", "page", "pages"),
    "items_n": ("examples", "ideas", "ways", "tips", "facts", "reasons", "items", "questions", "points", "bullets", "steps",
                "names", "things", "titles", "options", "suggestions", "bullet", "strategies", "benefits", "features",
                "examples", "words", "topics", "products", "quotes", "jokes", "taglines", "slogans", "headlines"),
}
_UNIT = {unit: k for k, (name, units) in enumerate(COUNTS.items()) for unit in units if not (name == "items_n" and unit == "words")}
_TOKEN = re.compile(r"[a-z0-9]+")
_CODE = list(FLAGS).index("code")
CUE_CHARS = 600  # cues are read in the first and the last this many characters
DENSE = ["log_prompt_tokens", "log_max_tokens", "temperature", "log_chars", "log_lines", "log_system_chars",
         "log_history_chars", "question",
         *FLAGS, *_STARTS, *COUNTS]


def _counts(tokens: list[str]) -> list[float]:
    found = [0.0] * len(COUNTS)
    for i, token in enumerate(tokens):
        number = float(token) if token.isdigit() else _NUMBER_WORDS.get(token)
        if number is None or not 0 < number <= 5000:
            continue
        for unit in tokens[i + 1:i + 4]:
            k = _UNIT.get(unit)
            if k is not None:
                found[k] = max(found[k], math.log1p(number))
                break
    return found


def dense_row(prompt: LengthPrompt) -> list[float]:
    user = prompt.last_user
    text = _ends(user, CUE_CHARS).lower()
    head = text.lstrip()[:40]
    row = [math.log1p(max(prompt.prompt_tokens, 0)), math.log(max(prompt.max_tokens, 1)), float(prompt.temperature),
           math.log1p(len(user)), math.log1p(user.count("\n")), math.log1p(len(prompt.system)),
           math.log1p(max(prompt.history_chars or 0, 0)), 1.0 if user.rstrip().endswith("?") else 0.0]
    tokens = _TOKEN.findall(text)
    seen = set(tokens)
    seen.update(map(" ".join, zip(tokens, tokens[1:])))
    flags = [0.0 if seen.isdisjoint(phrases) else 1.0 for phrases in _FLAG_SETS]
    if not flags[_CODE] and any(sign in text for sign in _CODE_SIGNS):
        flags[_CODE] = 1.0
    row += flags
    row += [1.0 if head.startswith(phrases) else 0.0 for phrases in _STARTS.values()]
    return row + _counts(tokens)


def _ends(text: str, chars: int) -> str:
    """The text's first and last `chars` characters."""
    return text if len(text) <= 2 * chars else text[:chars] + " " + text[-chars:]


def char_grams(texts: Sequence[str]) -> sp.csr_matrix:
    """Hashed character 3-5 grams (of the UTF-8 bytes, lower-cased, runs of white space as
    one), counts l2-normalised per row: every text's n-grams at once, in numpy (sklearn's
    char analyzer builds a Python string per n-gram, 10x slower)."""
    encoded = [" ".join(text.lower().split()).encode("utf-8", "replace") for text in texts]
    sizes = np.fromiter(map(len, encoded), np.int64, len(encoded))
    data = np.frombuffer(b"".join(encoded), np.uint8).astype(np.uint64)
    row_of = np.repeat(np.arange(len(encoded)), sizes)
    rows, columns = [], []
    for n in CHAR_NGRAMS:
        count = data.size - n + 1
        if count <= 0:
            continue
        hashed = np.full(count, 0xCBF29CE484222325 ^ n, np.uint64)  # FNV-1a over the n bytes
        for k in range(n):
            hashed = (hashed ^ data[k:k + count]) * np.uint64(0x100000001B3)
        inside = row_of[:count] == row_of[n - 1:n - 1 + count]  # not across two texts
        rows.append(row_of[:count][inside])
        columns.append(((hashed[inside] * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(64 - CHAR_BITS)).astype(np.int64))
    row_index = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    matrix = sp.csr_matrix((np.ones(row_index.size, np.float32), (row_index, np.concatenate(columns) if columns else row_index)),
                           shape=(len(encoded), 2**CHAR_BITS))
    from sklearn.preprocessing import normalize

    return normalize(matrix, copy=False)


def features(prompts: Sequence[LengthPrompt]) -> sp.csr_matrix:
    """One row per prompt: [word n-grams | char n-grams | system words | template | dense]."""
    words, system, template = _vectorizers()
    blocks = [words.transform([_ends(p.last_user, WORD_CHARS) for p in prompts]),
              char_grams([_ends(p.last_user, CHAR_CHARS) for p in prompts]),
              system.transform([_ends(p.system, WORD_CHARS) for p in prompts]),
              template.transform([p.template or "-" for p in prompts]),
              sp.csr_matrix(np.array([dense_row(p) for p in prompts], np.float32).reshape(len(prompts), len(DENSE)))]
    return sp.hstack(blocks, format="csr", dtype=np.float32)


def width() -> int:
    return 2**WORD_BITS + 2**CHAR_BITS + 2**SYSTEM_BITS + 2**TEMPLATE_BITS + len(DENSE)
