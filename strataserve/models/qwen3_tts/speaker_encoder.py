"""The Base variant's speaker encoder: 24 kHz audio -> log-mel frames -> ECAPA-TDNN -> one x-vector, which the
talker's prompt takes in place of a preset speaker's embedding (voice cloning).

ECAPA-TDNN (Desplanques et al., 2020, arXiv:2005.07143): a TDNN, SE-Res2Net blocks (1x1 conv, Res2Net: the
channels split into ``scale`` groups, group i convolved after adding group i-1's output; 1x1 conv; squeeze-and-
excitation), the concatenated block outputs through one more TDNN ("multi-layer feature aggregation"), attentive
statistics pooling (per-channel softmax weights over time from [x, mean, std]; weighted mean and std), and a 1x1
conv to the embedding size. Every conv pads "same" by reflection. Module names follow the checkpoint's
``speaker_encoder.*`` tensors so its state dict loads as is.

Mel features as the reference computes them: reflect-pad by (n_fft - hop) / 2, Hann-window STFT (no centring),
magnitude sqrt(re^2 + im^2 + 1e-9), slaney-normalised mel filters (transformers' ``mel_filter_bank``, equal to
librosa's), log of max(x, 1e-5).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strataserve.models.qwen3_tts.config import SpeakerEncoderConfig

#: the reference's STFT / mel settings for the speaker encoder (24 kHz input)
N_FFT, HOP, WIN, FMIN = 1024, 256, 1024, 0


def _conv(cin: int, cout: int, kernel: int, dilation: int = 1) -> nn.Conv1d:
    return nn.Conv1d(cin, cout, kernel, dilation=dilation, padding="same", padding_mode="reflect")


class TDNN(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int, dilation: int = 1) -> None:
        super().__init__()
        self.conv = _conv(cin, cout, kernel, dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x))


class Res2Net(nn.Module):
    def __init__(self, channels: int, scale: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.scale = scale
        width = channels // scale
        self.blocks = nn.ModuleList(TDNN(width, width, kernel, dilation) for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = list(torch.chunk(x, self.scale, dim=1))
        out, prev = [parts[0]], None
        for block, part in zip(self.blocks, parts[1:]):
            prev = block(part if prev is None else part + prev)
            out.append(prev)
        return torch.cat(out, dim=1)


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, se_channels: int) -> None:
        super().__init__()
        self.conv1 = _conv(channels, se_channels, 1)
        self.conv2 = _conv(se_channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * s


class SERes2NetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, scale: int, se_channels: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.tdnn1 = TDNN(cin, cout, 1)
        self.res2net_block = Res2Net(cout, scale, kernel, dilation)
        self.tdnn2 = TDNN(cout, cout, 1)
        self.se_block = SqueezeExcite(cout, se_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x))))


def _mean_std(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-12) -> tuple[torch.Tensor, torch.Tensor]:
    """weighted mean and std over time (``w`` sums to 1 along dim 2)."""
    mean = (w * x).sum(2)
    std = (w * (x - mean[..., None]).pow(2)).sum(2).clamp(min=eps).sqrt()
    return mean, std


class AttentivePooling(nn.Module):
    def __init__(self, channels: int, attention_channels: int) -> None:
        super().__init__()
        self.tdnn = TDNN(3 * channels, attention_channels, 1)
        self.conv = _conv(attention_channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T] -> [B, 2C, 1]
        t = x.shape[-1]
        mean, std = _mean_std(x, torch.full_like(x[:, :1], 1.0 / t))
        ctx = torch.cat([x, mean[..., None].expand(-1, -1, t), std[..., None].expand(-1, -1, t)], dim=1)
        w = torch.softmax(self.conv(torch.tanh(self.tdnn(ctx))), dim=2)
        mean, std = _mean_std(x, w)
        return torch.cat([mean, std], dim=1)[..., None]


class SpeakerEncoder(nn.Module):
    def __init__(self, cfg: SpeakerEncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        ch, ks, dil = cfg.enc_channels, cfg.enc_kernel_sizes, cfg.enc_dilations
        blocks: list[nn.Module] = [TDNN(cfg.mel_dim, ch[0], ks[0], dil[0])]
        for i in range(1, len(ch) - 1):
            blocks.append(SERes2NetBlock(ch[i - 1], ch[i], cfg.enc_res2net_scale, cfg.enc_se_channels, ks[i], dil[i]))
        self.blocks = nn.ModuleList(blocks)
        self.mfa = TDNN(ch[-1], ch[-1], ks[-1], dil[-1])
        self.asp = AttentivePooling(ch[-1], cfg.enc_attention_channels)
        self.fc = _conv(2 * ch[-1], cfg.enc_dim, 1)
        self._mel: torch.Tensor | None = None

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        """log-mels ``[B, T, mel_dim]`` -> x-vectors ``[B, enc_dim]``."""
        h = mels.transpose(1, 2)
        outs = []
        for block in self.blocks:
            h = block(h)
            outs.append(h)
        h = self.mfa(torch.cat(outs[1:], dim=1))
        return self.fc(self.asp(h))[..., 0]

    def mel_basis(self, device: torch.device) -> torch.Tensor:
        if self._mel is None:
            from transformers.audio_utils import mel_filter_bank

            sr = self.cfg.sample_rate
            fb = mel_filter_bank(num_frequency_bins=N_FFT // 2 + 1, num_mel_filters=self.cfg.mel_dim,
                                 min_frequency=FMIN, max_frequency=sr / 2, sampling_rate=sr, norm="slaney",
                                 mel_scale="slaney")
            self._mel = torch.from_numpy(fb.T).float()
        return self._mel.to(device)

    def log_mel(self, wav: torch.Tensor) -> torch.Tensor:
        """float32 mono ``[N]`` at ``cfg.sample_rate`` -> ``[1, frames, mel_dim]``."""
        pad = (N_FFT - HOP) // 2
        if wav.shape[-1] <= pad:
            raise ValueError(f"reference audio has {wav.shape[-1]} samples; the speaker encoder needs more than "
                             f"{N_FFT} at {self.cfg.sample_rate} Hz")
        y = F.pad(wav.float()[None, None], (pad, pad), mode="reflect")[:, 0]
        spec = torch.stft(y, N_FFT, hop_length=HOP, win_length=WIN, window=torch.hann_window(WIN, device=y.device),
                          center=False, return_complex=True)
        mag = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
        mel = torch.matmul(self.mel_basis(y.device), mag)
        return torch.log(mel.clamp(min=1e-5)).transpose(1, 2)

    @torch.inference_mode()
    def embed(self, wav: torch.Tensor) -> torch.Tensor:
        """One clip (float32 mono at ``cfg.sample_rate``) -> its x-vector ``[enc_dim]`` in the encoder's dtype."""
        p = next(self.parameters())
        return self(self.log_mel(wav.to(p.device)).to(p.dtype))[0]
