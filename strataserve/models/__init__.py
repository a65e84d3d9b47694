"""Layer 4 models: one decoder for Llama/Mistral/Qwen2/Qwen3, HF config parsing, checkpoint loader, tokenizer."""
from strataserve.models.decoder import DecoderModel
from strataserve.models.hf_config import SUPPORTED_ARCHITECTURES, DecoderConfig, load_decoder_config
from strataserve.models.loader import build_random_model, load_model
from strataserve.models.tokenizer import Tokenizer

__all__ = ["DecoderConfig", "DecoderModel", "SUPPORTED_ARCHITECTURES", "Tokenizer", "build_random_model",
           "load_decoder_config", "load_model"]
