"""Text normalization before tokenizing: digits, dates, units and symbols spelled out as words.

CosyVoice's LM was trained on normalized text: "$12.50" or "2024年3月5日" as
written are read badly or skipped. Upstream normalizes with WeTextProcessing's
runtime (`wetext`, finite-state grammars for English and Chinese) where it is
installed, and so do we (`text_frontend` option):

- "auto": wetext where importable, else the text as it is (logged once);
- "wetext": wetext, and a clear error at load when it is missing;
- "none": the text as it is.

Choices kept from upstream (cli/frontend.py `text_normalize`): the Chinese
grammar for any text holding a CJK ideograph, else the English one; text
carrying CosyVoice's inline markup (`<|...|>`, e.g. `<|breath|>`) is left
alone, since the grammars would spell the markup out; for Chinese, blanks
between non-ASCII characters are dropped. Not kept: upstream's own sentence
splitting (the gateway's segmenter already cut the text) and its extra
`inflect` pass over English digits (wetext already spells them).

Normalization happens in the engine only: the gateway's `segment` and
`spoken_text` keep the text as the LLM wrote it.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from typing import Any, Protocol

from engine.backends.cosyvoice.config import TEXT_FRONTENDS
from engine.errors import ModelLoadError

log = logging.getLogger("voxgate.engine")

_CJK = re.compile(r"[\u4e00-\u9fff]")
_MARKUP = re.compile(r"<\|[^|<>]*\|>")
# A blank with a non-ASCII character on either side (Chinese text keeps spaces only inside ASCII
# runs).
_BLANK_BESIDE_NON_ASCII = re.compile(r"(?<=[^\x00-\x7f])\s+|\s+(?=[^\x00-\x7f])")


class TextNormalizer(Protocol):
    def normalize(self, text: str) -> str: ...


class PlainText:
    """No normalization: the text as it is."""

    name = "none"

    def normalize(self, text: str) -> str:
        return text


class WeTextNormalizer:
    """WeTextProcessing's English and Chinese text normalization grammars (the `wetext` package)."""

    name = "wetext"

    def __init__(self, wetext: Any) -> None:
        self._en = wetext.Normalizer(lang="en", operator="tn")
        self._zh = wetext.Normalizer(lang="zh", operator="tn", remove_erhua=False)

    def normalize(self, text: str) -> str:
        if not text.strip() or _MARKUP.search(text):
            return text
        if _CJK.search(text):
            return _BLANK_BESIDE_NON_ASCII.sub("", _robust(self._zh, text))
        return _robust(self._en, text)


# wetext's grammars fail on some inputs (an AssertionError on "offset of +1 hours"):
# the failing text is retried clause by clause, then word by word, and what still
# fails is kept as written. Normalization never fails a request.
_SPLITS = (re.compile(r"((?<=[,;:])\s+|(?<=[，；：、])\s*)"), re.compile(r"(\s+)"))


def _robust(grammar: Any, text: str, level: int = 0) -> str:
    try:
        return str(grammar.normalize(text))
    except Exception:  # noqa: BLE001 (any failure of the grammar library)
        if level == len(_SPLITS):
            log.debug("wetext could not normalize %r; kept as written", text)
            return text
    pieces = _SPLITS[level].split(text)  # text, separator, text, ...
    if len(pieces) == 1:
        return _robust(grammar, text, level + 1)
    return "".join(piece if i % 2 or not piece else _robust(grammar, piece, level + 1)
                   for i, piece in enumerate(pieces))


def resolve_text_frontend(mode: str) -> str:
    """`text_frontend` as it will run: "auto" becomes "wetext" where it is installed, else
    "none"."""
    if mode not in TEXT_FRONTENDS:
        raise ValueError(f"text_frontend must be one of {TEXT_FRONTENDS}, got {mode!r}")
    if mode == "auto":
        return "wetext" if importlib.util.find_spec("wetext") is not None else "none"
    return mode


def load_text_normalizer(mode: str = "auto") -> TextNormalizer:
    """The normalizer for `text_frontend` (see the module docstring)."""
    resolved = resolve_text_frontend(mode)
    if resolved == "none":
        if mode == "auto":
            log.warning("wetext is not installed: cosyvoice speaks digits and symbols as written "
                        "(pip install wetext)")
        return PlainText()
    try:
        import wetext  # optional dependency: pip install 'voxgate[cosyvoice]'
    except ImportError as exc:
        raise ModelLoadError(
            "text_frontend 'wetext' expects the wetext package, got none installed "
            "(pip install wetext, or text_frontend=none)"
        ) from exc
    return WeTextNormalizer(wetext)
