"""Qwen3-TTS (12 Hz): config, talker + code predictor on the shared decoder, prompt building, codec, loader."""
