"""OmniVoice: a non-autoregressive TTS model (Qwen3 backbone, bidirectional, iterative unmasking of 8 codebooks)."""
