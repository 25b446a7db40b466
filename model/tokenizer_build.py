"""Tokenizers for the random-weight presets, built locally (nothing is downloaded).

- CLIP: a byte-level BPE vocabulary learned in code from a small fixed corpus (deterministic: ties between pair
  counts are broken by the pair itself), laid out like CLIP's own vocab (bytes, bytes + "</w>", merges, specials).
- T5: a unigram sentencepiece model trained in-process on the same corpus (one thread, fixed seed material), its
  pieces and scores handed to transformers' T5 tokenizer.

The point is not good tokenization; it is that FluxPipeline's real tokenizer classes run on real text, offline.
"""

from __future__ import annotations

import io
from collections import Counter

from transformers import CLIPTokenizer, T5TokenizerFast

_SUBJECTS = [
    "a red fox", "an astronaut", "a lighthouse", "a bowl of ramen", "a vintage car", "a cat", "a mountain lake",
    "a city street", "a robot", "a field of sunflowers", "an old library", "a sailing ship", "a dragon",
    "a cup of coffee", "a forest cabin", "a portrait of a woman", "a neon sign", "a snowy village",
]
_STYLES = [
    "at sunset", "in the rain", "watercolor painting", "photorealistic", "studio lighting", "oil on canvas",
    "cinematic", "35mm film", "highly detailed", "soft focus", "isometric", "pixel art", "golden hour",
    "under the stars", "digital illustration", "macro photograph",
]


def corpus() -> list[str]:
    """A fixed, in-code corpus of prompt-like sentences (the same on every machine)."""
    lines = []
    for i, subject in enumerate(_SUBJECTS):
        for j, style in enumerate(_STYLES):
            extra = _STYLES[(i * 7 + j * 3) % len(_STYLES)]
            lines.append(f"{subject}, {style}, {extra}, 4k, 1024 x 1024 #{i * len(_STYLES) + j}!")
    return lines


def build_clip_tokenizer(num_merges: int = 300, model_max_length: int = 77,
                         lines: list[str] | None = None) -> CLIPTokenizer:
    """A CLIPTokenizer with a byte-level BPE vocabulary learned in code from `lines` (default `corpus()`)."""
    probe = CLIPTokenizer()  # empty vocab: only borrowed for CLIP's own normalizer and pre-tokenizer
    backend = probe.backend_tokenizer
    words: Counter[tuple[str, ...]] = Counter()
    for line in lines if lines is not None else corpus():
        for piece, _ in backend.pre_tokenizer.pre_tokenize_str(backend.normalizer.normalize_str(line)):
            symbols = list(piece)
            symbols[-1] += "</w>"
            words[tuple(symbols)] += 1

    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    vocab: dict[str, int] = {}
    for sym in alphabet + [a + "</w>" for a in alphabet]:
        vocab[sym] = len(vocab)

    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, freq in words.items():
            for a, b in zip(word, word[1:]):
                pairs[(a, b)] += freq
        if not pairs:
            break
        # Highest count first; ties broken by the pair text so the result never depends on dict order.
        (a, b), _ = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        merges.append((a, b))
        vocab.setdefault(a + b, len(vocab))
        merged: Counter[tuple[str, ...]] = Counter()
        for word, freq in words.items():
            out: list[str] = []
            k = 0
            while k < len(word):
                if k + 1 < len(word) and word[k] == a and word[k + 1] == b:
                    out.append(a + b)
                    k += 2
                else:
                    out.append(word[k])
                    k += 1
            merged[tuple(out)] += freq
        words = merged
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    try:
        return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)
    except TypeError:  # transformers releases that take merges as "a b" strings
        return CLIPTokenizer(vocab=vocab, merges=[f"{a} {b}" for a, b in merges], model_max_length=model_max_length)


def build_t5_tokenizer(vocab_size: int = 400, model_max_length: int = 512,
                       lines: list[str] | None = None) -> T5TokenizerFast:
    """A T5 tokenizer whose unigram vocabulary is a sentencepiece model trained in-process on `lines` (default
    `corpus()`)."""
    import sentencepiece as spm

    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines if lines is not None else corpus()),
        model_writer=proto,
        model_type="unigram",
        vocab_size=vocab_size,
        hard_vocab_limit=False,
        # T5's special-token layout: <pad>=0, </s>=1, <unk>=2, no BOS.
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        pad_piece="<pad>",
        eos_piece="</s>",
        unk_piece="<unk>",
        normalization_rule_name="identity",
        num_threads=1,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    pieces = [(sp.id_to_piece(i), float(sp.get_score(i))) for i in range(sp.get_piece_size())]
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=model_max_length)
