"""Special text tokens CosyVoice adds to the Qwen2 tokenizer, in upstream's order.

Upstream (cosyvoice/tokenizer/tokenizer.py) adds these after Qwen2's own
`<|endoftext|>` (151643), `<|im_start|>` (151644) and `<|im_end|>` (151645),
so new ones take ids from 151646 in list order: `<|endofprompt|>` is 151646
in both versions. The order is part of the checkpoint: do not sort.
"""

from __future__ import annotations

END_OF_PROMPT = "<|endofprompt|>"
FIRST_ADDED_ID = 151646  # the first id the added tokens take

SPECIAL_TOKENS_V2: tuple[str, ...] = (
    "<|im_start|>",
    "<|im_end|>",
    END_OF_PROMPT,
    "[breath]",
    "<strong>",
    "</strong>",
    "[noise]",
    "[laughter]",
    "[cough]",
    "[clucking]",
    "[accent]",
    "[quick_breath]",
    "<laughter>",
    "</laughter>",
    "[hissing]",
    "[sigh]",
    "[vocalized-noise]",
    "[lipsmack]",
    "[mn]",
)

# CosyVoice 3 adds <|endofsystem|>, then ARPAbet phones (with stress digits)
# and pinyin initials/finals (with tone marks), each in square brackets.
_ARPABET = (
    "AA AA0 AA1 AA2 AE AE0 AE1 AE2 AH AH0 AH1 AH2 AO AO0 AO1 AO2 AW AW0 AW1 AW2 AY AY0 AY1 AY2 "
    "B CH D DH EH EH0 EH1 EH2 ER ER0 ER1 ER2 EY EY0 EY1 EY2 F G HH IH IH0 IH1 IH2 IY IY0 IY1 IY2 "
    "JH K L M N NG OW OW0 OW1 OW2 OY OY0 OY1 OY2 P R S SH T TH UH UH0 UH1 UH2 UW UW0 UW1 UW2 "
    "V W Y Z ZH"
)
_PINYIN = (
    "a ai an ang ao b c ch d e ei en eng f g h i ian in ing iu ià iàn iàng iào iá ián iáng iáo iè "
    "ié iòng ióng iù iú iā iān iāng iāo iē iě iōng iū iǎ iǎn iǎng iǎo iǒng iǔ j k l m n o ong ou "
    "p q r s sh t u uang ue un uo uà uài uàn uàng uá uái uán uáng uè ué uì uí uò uó uā uāi uān "
    "uāng uē uě uī uō uǎ uǎi uǎn uǎng uǐ uǒ vè w x y z zh à ài àn àng ào á ái án áng áo è èi èn "
    "èng èr é éi én éng ér ì ìn ìng í ín íng ò òng òu ó óng óu ù ùn ú ún ā āi ān āng āo ē ēi ēn "
    "ēng ě ěi ěn ěng ěr ī īn īng ō ōng ōu ū ūn ǎ ǎi ǎn ǎng ǎo ǐ ǐn ǐng ǒ ǒng ǒu ǔ ǔn ǘ ǚ ǜ"
)
SPECIAL_TOKENS_V3: tuple[str, ...] = (
    *SPECIAL_TOKENS_V2,
    "<|endofsystem|>",
    *(f"[{p}]" for p in _ARPABET.split()),
    *(f"[{p}]" for p in _PINYIN.split()),
)


def added_token_id(token: str, version: int) -> int:
    """The id a special token gets in a CosyVoice tokenizer (no tokenizer files needed)."""
    added = [
        t
        for t in (SPECIAL_TOKENS_V2 if version == 2 else SPECIAL_TOKENS_V3)
        if t not in ("<|im_start|>", "<|im_end|>")
    ]
    try:
        return FIRST_ADDED_ID + added.index(token)
    except ValueError:
        raise KeyError(f"expected a CosyVoice {version} special token, got {token!r}") from None
