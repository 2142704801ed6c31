"""Text and voice in: tokenizers, prompt layout, text normalization, special tokens, voice
prompts."""
