"""Tokenizers for the tiny models, made on the spot from a small word list (nothing downloaded).

CLIP's byte-level BPE (optionally with merges that make every word of :data:`WORDS` one token)
and a T5/UMT5 sentencepiece-style unigram vocabulary of those words and single characters.
"""

from __future__ import annotations

# Words the tokenizers know whole; any other text falls back to single characters.
WORDS = (
    "a an the of on in with and or to is at by one two three small large big tiny "
    "red orange yellow green blue purple pink brown black white gray grey cyan magenta "
    "circle square triangle star ring cross heart diamond hexagon disk box "
    "background photo picture image painting drawing sketch of cat dog bird tree house "
    "sun moon sky sea mountain city car flower light dark bright night day"
).split()


def word_merges() -> list[tuple[str, str]]:
    """BPE merges learned (with the ``tokenizers`` library's trainer) on WORDS, so each of
    them becomes one CLIP token; other text still falls back to bytes."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(end_of_word_suffix="</w>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(sorted(set(WORDS)), trainers.BpeTrainer(
        vocab_size=5000, show_progress=False, end_of_word_suffix="</w>", initial_alphabet=[]))
    merges = json.loads(tok.to_str())["model"]["merges"]
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in merges]


def clip_tokenizer(word_tokens: bool = False):
    from transformers import CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    # Byte-level BPE vocabulary: every byte, alone and word-final, plus (word_tokens) merges
    # that make the known words whole tokens.
    byte_chars = list(bytes_to_unicode().values())
    vocab = {}
    for ch in byte_chars:
        vocab[ch] = len(vocab)
    for ch in byte_chars:
        vocab[ch + "</w>"] = len(vocab)
    merges = word_merges() if word_tokens else []
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    tok = CLIPTokenizer(vocab=vocab, merges=merges)
    tok.model_max_length = 77
    return tok


def t5_tokenizer(max_sequence_length: int):
    from transformers import T5TokenizerFast

    chars = sorted(set("".join(WORDS)) | set("abcdefghijklmnopqrstuvwxyz0123456789.,!?-'"))
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [("\u2581" + w, -1.0) for w in WORDS]
    vocab += [(c, -6.0) for c in chars]
    tok = T5TokenizerFast(vocab=vocab, extra_ids=0)
    tok.model_max_length = max_sequence_length
    return tok


def t5_config(config_class, tokenizer, text_dim: int):
    """A 2-layer, 4-head T5-family encoder config (FLUX's T5, Wan's UMT5) of width ``text_dim``."""
    return config_class(
        vocab_size=len(tokenizer),
        d_model=text_dim,
        d_kv=8,
        d_ff=2 * text_dim,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
