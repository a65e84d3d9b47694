"""Token sampling over a batch of logits (interface; implementation to follow)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from strataserve.engine.outputs import TokenLogprobs
from strataserve.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingRequest:
    """What the sampler needs to know about one request. The runner owns it and appends each sampled token."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_id: int | None = None


class Sampler:
    def __call__(self, logits: torch.Tensor, reqs: Sequence[SamplingRequest]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [len(reqs), vocab] float. Returns one token id per row and its logprobs (None if not asked)."""
        raise NotImplementedError
