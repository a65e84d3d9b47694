"""The 12 Hz speech tokenizer's decoder: codec frames [B, K, T] -> 24 kHz waveform [B, T * upsample].

Pipeline (module names follow the checkpoint's ``speech_tokenizer/model.safetensors`` so its state dict loads
as is): split residual VQ (codebook 0 "semantic", the rest "acoustic"; each codebook's vectors are
``embedding_sum / cluster_usage``) -> causal conv -> a small causal transformer (sliding window, layer scale,
rotary) -> 2 x (causal transposed conv + ConvNeXt) upsampling -> causal conv stack with SnakeBeta activations
-> clamp to [-1, 1]. Every layer is causal, so a chunk decoded with enough left context reproduces the same
samples; ``decode_window`` is what streaming uses (the reference decodes long clips the same way, 300-frame
chunks with 25 frames of left context).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from strataserve.models.qwen3_tts.config import CodecDecoderConfig
from strataserve.models.rope import build_cos_sin_cache
from strataserve.models.hf_config import RopeScaling
from strataserve.runner.ops import _rms_norm

#: the reference's chunked decode: frames per chunk, and frames of left context re-decoded before each chunk
CHUNK_FRAMES = 300
LEFT_CONTEXT_FRAMES = 25


class CausalConv(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int, dilation: int = 1, stride: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, stride=stride, dilation=dilation, groups=groups)
        self.stride = stride
        self.span = (kernel - 1) * dilation + 1
        self.pad = self.span - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-1]
        frames = (n - self.span + self.pad) / self.stride + 1
        extra = (math.ceil(frames) - 1) * self.stride + (self.span - self.pad) - n  # pad right to a whole frame
        return self.conv(F.pad(x, (self.pad, extra)))


class CausalTransConv(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int, stride: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(cin, cout, kernel, stride=stride)
        self.trim = kernel - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return y[..., : y.shape[-1] - self.trim] if self.trim else y


class ConvNeXt(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.dwconv(x).permute(0, 2, 1))
        h = self.gamma * self.pwconv2(F.gelu(self.pwconv1(h)))
        return x + h.permute(0, 2, 1)


class SnakeBeta(nn.Module):
    """x + sin^2(x * e^alpha) / e^beta, per channel (alpha, beta stored as logs)."""

    def __init__(self, dim: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(dim))
        self.beta = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.alpha.exp()[None, :, None]
        b = self.beta.exp()[None, :, None]
        return x + (1.0 / (b + 1e-9)) * torch.sin(x * a).pow(2)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))


class DecoderBlock(nn.Module):
    def __init__(self, cin: int, cout: int, rate: int):
        super().__init__()
        self.block = nn.ModuleList([SnakeBeta(cin), CausalTransConv(cin, cout, 2 * rate, rate)]
                                   + [ResidualUnit(cout, d) for d in (1, 3, 9)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.block:
            x = m(x)
        return x


class _Codebook(nn.Module):
    def __init__(self, size: int, dim: int):
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))

    def decode(self, codes: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, dim, T]
        table = self.embedding_sum / self.cluster_usage.clamp(min=1e-5)[:, None]
        return F.embedding(codes, table).transpose(1, 2)


class _VQ(nn.Module):
    def __init__(self, size: int, dim: int):
        super().__init__()
        self._codebook = _Codebook(size, dim)


class _VQList(nn.Module):
    def __init__(self, n: int, size: int, dim: int):
        super().__init__()
        self.layers = nn.ModuleList(_VQ(size, dim) for _ in range(n))


class ResidualVQ(nn.Module):
    def __init__(self, n: int, size: int, codebook_dim: int):
        super().__init__()
        dim = codebook_dim // 2
        self.vq = _VQList(n, size, dim)
        self.input_proj = nn.Conv1d(codebook_dim, dim, 1, bias=False)  # encoder side; kept so weights load
        self.output_proj = nn.Conv1d(dim, codebook_dim, 1, bias=False)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:  # [B, n, T] -> [B, codebook_dim, T]
        q = torch.zeros((), device=codes.device)
        for i, layer in enumerate(self.vq.layers):
            q = q + layer._codebook.decode(codes[:, i])
        return self.output_proj(q)


class SplitRVQ(nn.Module):
    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        self.rvq_first = ResidualVQ(1, cfg.codebook_size, cfg.codebook_dim)
        self.rvq_rest = ResidualVQ(cfg.num_quantizers - 1, cfg.codebook_size, cfg.codebook_dim)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        q = self.rvq_first.decode(codes[:, :1])
        return q + self.rvq_rest.decode(codes[:, 1:]) if codes.shape[1] > 1 else q


class _Scale(nn.Module):
    def __init__(self, dim: int, init: float):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init))


class _Norm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.weight, self.eps)


class _Attention(nn.Module):
    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.heads, self.kv_heads, self.d = cfg.num_heads, cfg.num_kv_heads, d

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.d).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


class _MLP(nn.Module):
    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        self.self_attn = _Attention(cfg)
        self.mlp = _MLP(cfg)
        self.input_layernorm = _Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = _Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn_layer_scale = _Scale(cfg.hidden_size, cfg.layer_scale_initial_scale)
        self.mlp_layer_scale = _Scale(cfg.hidden_size, cfg.layer_scale_initial_scale)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn_layer_scale.scale * self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp_layer_scale.scale * self.mlp(self.post_attention_layernorm(x))


class CodecTransformer(nn.Module):
    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = _Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_proj = nn.Linear(cfg.latent_dim, cfg.hidden_size)
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.latent_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, latent]
        t = x.shape[1]
        h = self.input_proj(x)
        cs = build_cos_sin_cache(self.cfg.head_dim, t, self.cfg.rope_theta, RopeScaling(), x.device)
        half = self.cfg.head_dim // 2
        cos = torch.cat([cs[:, :half]] * 2, -1).to(h.dtype)
        sin = torch.cat([cs[:, half:]] * 2, -1).to(h.dtype)
        i = torch.arange(t, device=x.device)
        mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < self.cfg.sliding_window)
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        return self.output_proj(self.norm(h))


class CodecDecoder(nn.Module):
    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.quantizer = SplitRVQ(cfg)
        self.pre_conv = CausalConv(cfg.codebook_dim, cfg.latent_dim, 3)
        self.pre_transformer = CodecTransformer(cfg)
        self.upsample = nn.ModuleList(nn.ModuleList([CausalTransConv(cfg.latent_dim, cfg.latent_dim, r, r),
                                                     ConvNeXt(cfg.latent_dim)]) for r in cfg.upsampling_ratios)
        dec: list[nn.Module] = [CausalConv(cfg.latent_dim, cfg.decoder_dim, 7)]
        for i, rate in enumerate(cfg.upsample_rates):
            dec.append(DecoderBlock(cfg.decoder_dim // 2 ** i, cfg.decoder_dim // 2 ** (i + 1), rate))
        out_dim = cfg.decoder_dim // 2 ** len(cfg.upsample_rates)
        dec += [SnakeBeta(out_dim), CausalConv(out_dim, 1, 7)]
        self.decoder = nn.ModuleList(dec)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """codes long [B, K, T] -> waveform [B, 1, T * total_upsample] in [-1, 1]."""
        if codes.shape[1] != self.cfg.num_quantizers:
            raise ValueError(f"codec expects {self.cfg.num_quantizers} codebooks per frame, got {codes.shape[1]}")
        h = self.pre_conv(self.quantizer.decode(codes)).transpose(1, 2)
        h = self.pre_transformer(h).permute(0, 2, 1)
        for blocks in self.upsample:
            for m in blocks:
                h = m(h)
        for m in self.decoder:
            h = m(h)
        return h.clamp(-1.0, 1.0)

    @torch.inference_mode()
    def decode_window(self, codes: torch.Tensor, start: int, end: int,
                      left_context: int = LEFT_CONTEXT_FRAMES) -> torch.Tensor:
        """Samples of frames [start, end) of ``codes`` [B, K, T], decoded with up to ``left_context`` earlier
        frames in front (their samples are dropped) -> float32 [B, (end - start) * total_upsample]."""
        ctx = min(left_context, start)
        wav = self(codes[..., start - ctx:end].clamp(min=0))[:, 0]
        return wav[:, ctx * self.cfg.total_upsample:].float()

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Whole clips [B, K, T] -> [B, T * decode_upsample_rate], chunked exactly as the reference decodes."""
        t = codes.shape[-1]
        parts = [self.decode_window(codes, s, min(s + CHUNK_FRAMES, t)) for s in range(0, t, CHUNK_FRAMES)]
        wav = torch.cat(parts, dim=-1) if parts else codes.new_zeros(codes.shape[0], 0, dtype=torch.float32)
        return wav[:, : t * self.cfg.decode_upsample_rate]
