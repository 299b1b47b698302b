"""Text to token ids and back: the default tokenizer (SmolLM2's vocabulary, built from its
GGUF file), chat templates and incremental detokenization."""
