"""Word timings for piper: which phonemes of an utterance belong to which word.

espeak phonemizes a whole segment at once (so function words are reduced and
numbers read in context), but its output does not say where each written word
went: it merges words ("of the" -> "ʌvðə"), expands others ("42" -> "fˈɔːɹɾi
tˈuː", "Dr." -> "dˈɑːktɚ") and drops unspeakable ones ("--"). So we phonemize
each written word alone as well, and align the two phoneme strings with an edit
distance (Levenshtein, 1966): the alignment is monotone by construction, survives
merges, expansions and context reductions ("a" alone is "ˈeɪ", in a sentence
"ɐ"), and gives each utterance phoneme the word it came from.

Timings then follow from the model's per-phoneme durations: a word ends where
its last phoneme (with its trailing pad) ends, and starts where the previous
word ended, so pauses belong to the word they precede and the words tile the
audio exactly. A listener cut off after `end_ms` of a word has heard all of it
(docs/protocol.md, "Barge-in": whole words where the engine gave timings).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.types import WordTiming

# Marks that carry no sound of their own: stress, length-neutral punctuation, spaces.
_SILENT_MARKS = frozenset(" \t\nˈˌ.,!?;:-—–…'\"()¡¿«»")


def is_sounding(phoneme: str) -> bool:
    """Whether a phoneme is a sound (not a space, stress mark or punctuation)."""
    return any(ch not in _SILENT_MARKS for ch in phoneme)


def _edit_alignment(a: Sequence[int], b: Sequence[int]) -> list[int]:
    """For each element of `a`, the index of the element of `b` it aligns with, or -1.

    Levenshtein distance with unit costs; rows are filled with numpy (the
    insertion term along a row is a running minimum), the backtrace in Python.
    """
    n, m = len(a), len(b)
    b_arr = np.asarray(b, dtype=np.int64)  # [m]
    cols = np.arange(m + 1, dtype=np.int64)  # [m + 1]
    dist = np.empty((n + 1, m + 1), dtype=np.int64)  # [n + 1, m + 1]
    dist[0] = cols
    for i in range(1, n + 1):
        prev = dist[i - 1]
        best = np.empty(m + 1, dtype=np.int64)
        best[0] = i
        best[1:] = np.minimum(prev[:-1] + (b_arr != a[i - 1]), prev[1:] + 1)
        # dist[i, j] = min over k <= j of best[k] + (j - k)
        dist[i] = np.minimum.accumulate(best - cols) + cols

    matched = [-1] * n
    i, j = n, m
    while i > 0 and j > 0:
        cost = 0 if a[i - 1] == b[j - 1] else 1
        if dist[i, j] == dist[i - 1, j - 1] + cost:
            matched[i - 1] = j - 1
            i, j = i - 1, j - 1
        elif dist[i, j] == dist[i - 1, j] + 1:
            i -= 1
        else:
            j -= 1
    return matched


def align_words(
    word_phonemes: Sequence[Sequence[str]], phonemes: Sequence[str]
) -> list[tuple[int, int]]:
    """Each word's half-open range of indices into `phonemes`, the utterance's phonemes.

    `word_phonemes[w]` is word w phonemized on its own. Ranges are monotone and
    disjoint; a word that produced no sound gets an empty range where it stands.
    """
    num_words = len(word_phonemes)
    sounding = [k for k, p in enumerate(phonemes) if is_sounding(p)]
    symbols: dict[str, int] = {}
    utterance = [symbols.setdefault(phonemes[k], len(symbols)) for k in sounding]
    reference: list[int] = []
    owner: list[int] = []  # owner[r]: the word reference[r] came from
    for w, word in enumerate(word_phonemes):
        for p in word:
            if is_sounding(p):
                reference.append(symbols.setdefault(p, len(symbols)))
                owner.append(w)

    labels: list[int]
    if not sounding or num_words == 0:
        labels = []
    elif not reference:
        # No word made a sound alone: share the phonemes out evenly.
        labels = [min(num_words - 1, r * num_words // len(sounding)) for r in range(len(sounding))]
    else:
        matched = _edit_alignment(utterance, reference)
        labels = [owner[r] if r >= 0 else -1 for r in matched]
        # Unmatched phonemes join the word before them (the first ones, the word after).
        first = next((w for w in labels if w >= 0), 0)
        current = first
        for r, w in enumerate(labels):
            current = w if w >= 0 else current
            labels[r] = current

    spans: list[tuple[int, int]] = []
    cursor = 0
    r = 0
    for w in range(num_words):
        while r < len(labels) and labels[r] < w:
            r += 1
        start_r = r
        while r < len(labels) and labels[r] == w:
            r += 1
        if r > start_r:
            begin, end = sounding[start_r], sounding[r - 1] + 1
            spans.append((begin, end))
            cursor = end
        else:
            spans.append((cursor, cursor))
    return spans


def word_timings(
    words: Sequence[str],
    spans: Sequence[tuple[int, int]],
    phoneme_ends: np.ndarray,
    total_samples: int,
    sample_rate: int,
) -> list[WordTiming]:
    """Timings that tile the audio: the first word starts at 0, the last ends at its end.

    `phoneme_ends[k]` is the sample where utterance phoneme k (with its pad) ends.
    """
    timings: list[WordTiming] = []
    ms_per_sample = 1000.0 / sample_rate
    start = 0
    for w, (word, (begin, end)) in enumerate(zip(words, spans, strict=True)):
        if w == len(words) - 1:
            stop = total_samples
        elif end > begin:
            stop = int(phoneme_ends[end - 1])
        else:
            stop = start
        stop = min(max(stop, start), total_samples)
        timings.append(WordTiming(word, start * ms_per_sample, stop * ms_per_sample))
        start = stop
    return timings
