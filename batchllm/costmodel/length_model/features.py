"""What the length model reads of a request, as one sparse row: hashed word and character
n-grams of the last user turn, hashed words of the system text, the template as a token of
its own, the prompt's size and settings, and explicit cues ("in one sentence", "a 300-word
essay", "list 10 ...", "step by step", code words).

Stateless (every text feature is hashed), so a saved model is its coefficients alone. A
change here changes the columns: bump FEATURES_VERSION, and models saved with another are
refused on load.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np
import scipy.sparse as sp
from sklearn.feature_extraction.text import HashingVectorizer

from batchllm.costmodel.request_lengths import LengthPrompt

FEATURES_VERSION = 1
WORD_BITS, CHAR_BITS, SYSTEM_BITS, TEMPLATE_BITS = 18, 18, 14, 10
# Of the last user turn, its first and last characters (the instruction usually opens or
# closes a prompt; a long pasted text between says little and costs time):
WORD_CHARS = 400  # word 1-2 grams
CHAR_CHARS = 120  # char 3-5 grams

_WORDS = HashingVectorizer(analyzer="word", ngram_range=(1, 2), n_features=2**WORD_BITS, alternate_sign=False,
                           token_pattern=r"(?u)\b\w+\b", dtype=np.float32)
_CHARS = HashingVectorizer(analyzer="char", ngram_range=(3, 5), n_features=2**CHAR_BITS, alternate_sign=False,
                           dtype=np.float32)
_SYSTEM = HashingVectorizer(analyzer="word", ngram_range=(1, 1), n_features=2**SYSTEM_BITS, alternate_sign=False,
                            dtype=np.float32)
_TEMPLATE = HashingVectorizer(analyzer=lambda name: [name], n_features=2**TEMPLATE_BITS, alternate_sign=False, norm=None,
                              dtype=np.float32)

# A cue that is there or not: any of its phrases in the lower-cased text (plain substring
# tests: a regex of many alternatives per cue was 50x slower).
FLAGS = {
    "one_word": ("one word", "one-word", "single word", "1 word"),
    "one_sentence": ("one sentence", "a sentence", "single sentence", "1 sentence", "two sentences", "2 sentences",
                     "one-sentence", "two-sentence"),
    "yes_no": ("yes or no", "true or false"),
    "only": ("number only", "code only", "answer only", "only the", "just the", "nothing else", "no explanation"),
    "brief": ("brief", "short", "concise", "summar", "tl;dr", "tldr", "quick", "in a few"),
    "detail": ("in detail", "detailed", "elaborate", "comprehensive", "thorough", "in depth", "in-depth", "expand"),
    "explain": ("step by step", "step-by-step", "explain", "why ", "how do", "how does", "how can", "how to"),
    "essay": ("essay", "article", "blog", "report", "speech", "letter", "proposal"),
    "story": ("story", "narrative", "chapter", "scene", "fiction"),
    "poem": ("poem", "haiku", "limerick", "sonnet", "lyrics", "rap ", "verse"),
    "list": ("list", "bullet", "enumerate", "outline", "table", "examples", "ideas"),
    "code": ("python", "javascript", "java", "sql", "function", "code", "class ", "script", "implement", "bash",
             "regex", "c++", "typescript", "api", "bug", "def ", "return", "{", "`", "html", "css"),
    "one_liner": ("one-liner", "one liner", "one line", "single line"),
    "translate": ("translat", "in french", "in spanish", "in german", "in english", "in chinese", "into "),
    "rewrite": ("rewrite", "re-write", "paraphrase", "proofread", "correct", "improve", "edit"),
    "write": ("write", "create", "generate", "compose", "draft", "describe"),
}
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
CUE_CHARS = 600  # cues are read in the first and the last this many characters
DENSE = ["log_prompt_tokens", "log_max_tokens", "temperature", "log_chars", "log_lines", "log_system_chars", "question",
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
           1.0 if user.rstrip().endswith("?") else 0.0]
    row += [1.0 if any(phrase in text for phrase in phrases) else 0.0 for phrases in FLAGS.values()]
    row += [1.0 if head.startswith(phrases) else 0.0 for phrases in _STARTS.values()]
    return row + _counts(_TOKEN.findall(text))


def _ends(text: str, chars: int) -> str:
    """The text's first and last `chars` characters."""
    return text if len(text) <= 2 * chars else text[:chars] + " " + text[-chars:]


def features(prompts: Sequence[LengthPrompt]) -> sp.csr_matrix:
    """One row per prompt: [word n-grams | char n-grams | system words | template | dense]."""
    blocks = [_WORDS.transform([_ends(p.last_user, WORD_CHARS) for p in prompts]),
              _CHARS.transform([_ends(p.last_user, CHAR_CHARS) for p in prompts]),
              _SYSTEM.transform([_ends(p.system, WORD_CHARS) for p in prompts]),
              _TEMPLATE.transform([p.template or "-" for p in prompts]),
              sp.csr_matrix(np.array([dense_row(p) for p in prompts], np.float32).reshape(len(prompts), len(DENSE)))]
    return sp.hstack(blocks, format="csr", dtype=np.float32)


def width() -> int:
    return 2**WORD_BITS + 2**CHAR_BITS + 2**SYSTEM_BITS + 2**TEMPLATE_BITS + len(DENSE)
