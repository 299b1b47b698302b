"""Tokenizer service: text or chat messages to token ids and back (SmolLM2's BPE by default)."""
