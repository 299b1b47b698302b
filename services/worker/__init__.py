"""The worker service: a local scheduler in front of one engine backend (sim, hf, vllm)."""
