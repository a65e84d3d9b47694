"""Synchronous engine: tokenizer + ``EngineCore`` + ``OutputProcessor`` in one thread (used by the offline ``LLM``)."""
from __future__ import annotations

from typing import Any

from strataserve.config import EngineConfig
from strataserve.engine.engine_core import EngineCore
from strataserve.engine.input_processor import (InputProcessor, PromptType, as_tokenizer, load_tokenizer,
                                                model_config_or_none)
from strataserve.engine.output_processor import OutputProcessor, RequestOutputKind
from strataserve.types.outputs import RequestOutput
from strataserve.types.protocol import SchedulerStats
from strataserve.types.sampling import SamplingParams
from strataserve.runner.base import ModelRunnerBase


class LLMEngine:
    def __init__(self, config: EngineConfig, runner: ModelRunnerBase | None = None, tokenizer: Any = None) -> None:
        self.config = config
        if tokenizer is None:
            tokenizer = load_tokenizer(config.model.tokenizer or config.model.model, config.model.skip_tokenizer_init)
        self.tokenizer = as_tokenizer(tokenizer)
        self.core = EngineCore(config, runner)
        self.inputs = InputProcessor(self.tokenizer, self.core.max_model_len, self.core.scheduler.max_pool_tokens,
                                     model_config_or_none(config.model.model))
        self.outputs = OutputProcessor(self.tokenizer.hf if self.tokenizer is not None else None)
        self.stats: SchedulerStats | None = None

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def vocab_size(self) -> int | None:
        """Token ids a prompt may use: the model's vocabulary (padded beyond the tokenizer's ids or not)."""
        return self.inputs.vocab_size

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, *, priority: int = 0,
                    kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY, arrival_time: float | None = None) -> None:
        """Validate, tokenise and queue one request. Raises ValueError (nothing queued) on bad input."""
        text, ids, params = self.inputs.process(prompt, params)
        core_reqs = self.outputs.add_request(request_id, text, ids, params, eos_token_id=self.inputs.eos_token_id,
                                             priority=priority, arrival_time=arrival_time, kind=kind)
        try:
            for r in core_reqs:
                self.core.add_request(r)
        except ValueError:
            self.abort_request([request_id])
            raise

    def abort_request(self, request_ids: list[str]) -> None:
        self.core.abort_requests(self.outputs.abort_requests(list(request_ids)))

    def step(self) -> list[RequestOutput]:
        out = self.core.step()
        self.stats = out.stats
        processed = self.outputs.process_outputs(out)
        if processed.reqs_to_abort:
            self.core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def reset_prefix_cache(self) -> None:
        self.core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.core.shutdown()
