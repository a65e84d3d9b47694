"""Offline batch inference with vLLM's names: ``LLM(model=...)``, ``llm.generate(...)``, ``llm.chat(...)``.

    from strataserve import LLM, SamplingParams
    llm = LLM(model="path/to/hf-checkpoint")
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].outputs[0].text)
"""
from __future__ import annotations

import itertools
import warnings
import weakref
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from strataserve.engine.engine_args import EngineArgs
from strataserve.engine.input_processor import PromptType
from strataserve.engine.llm_engine import LLMEngine
from strataserve.models.chat_messages import plain_message
from strataserve.models.generation_defaults import sampling_defaults
from strataserve.types.outputs import RequestOutput
from strataserve.types.sampling import SamplingParams
from strataserve.runner.base import ModelRunnerBase
from strataserve.startup import heap_set_aside

# vLLM arguments that mean nothing here; accepted (with a warning when they ask for something we lack).
_IGNORED = {"trust_remote_code": None, "pipeline_parallel_size": 1,
            "disable_log_stats": None, "enforce_eager": None, "swap_space": None, "download_dir": None,
            "tokenizer_mode": None, "max_seq_len_to_capture": None, "disable_custom_all_reduce": None}
_PROGRESS_MIN_PROMPTS = 16


class LLM:
    def __init__(self, model: str | Path, *, tokenizer: str | None = None, dtype: str = "auto", device: str = "auto",
                 max_model_len: int | None = None, max_num_seqs: int = 256, max_num_batched_tokens: int = 4096,
                 enable_chunked_prefill: bool = True, kv_cache_memory_gib: float = 1.0,
                 gpu_memory_utilization: float = 0.90, num_blocks: int | None = None, block_size: int = 16,
                 enable_prefix_caching: bool = True, seed: int = 0, mode: str = "auto", cuda_graph_max_bs: int = 256,
                 served_model_name: str | None = None, runner: ModelRunnerBase | None = None,
                 tokenizer_obj: Any = None, skip_tokenizer_init: bool = False, tensor_parallel_size: int = 1,
                 load_format: str = "auto", kv_cache_dtype: str = "auto", target_step_ms: float | None = 0.0,
                 generation_config: str = "auto", **kwargs: Any) -> None:
        """``generation_config``: as vLLM's, where ``generate(prompts)`` without SamplingParams takes its sampling
        defaults (``get_default_sampling_params``): auto = the checkpoint's generation_config.json, vllm = none,
        or a folder holding one."""
        for k, v in kwargs.items():
            if k not in _IGNORED:
                raise TypeError(f"LLM() got an unexpected argument {k!r}")
            if _IGNORED[k] is not None and v != _IGNORED[k]:
                warnings.warn(f"LLM({k}={v!r}) is not supported by strataserve and is ignored", stacklevel=2)
        if runner is None and not Path(model).is_dir():
            raise ValueError(f"model={str(model)!r} is not a directory: give the path of an HF checkpoint folder "
                             "(config.json + *.safetensors + tokenizer files, or skip_tokenizer_init=True)")
        self.config = EngineArgs(
            str(model), tokenizer=tokenizer, dtype=dtype, device=device, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill, kv_cache_memory_gib=kv_cache_memory_gib,
            gpu_memory_utilization=gpu_memory_utilization, num_gpu_blocks_override=num_blocks, block_size=block_size,
            enable_prefix_caching=enable_prefix_caching, seed=seed, enforce_eager=bool(kwargs.get("enforce_eager")),
            served_model_name=served_model_name, skip_tokenizer_init=skip_tokenizer_init,
            tensor_parallel_size=tensor_parallel_size, load_format=load_format, kv_cache_dtype=kv_cache_dtype,
            mode=mode, cuda_graph_max_bs=cuda_graph_max_bs, target_step_ms=target_step_ms).create_engine_config()
        self.engine = LLMEngine(self.config, runner=runner, tokenizer=tokenizer_obj)
        # The largest prompt-step CUDA graph now: a server captures it while idle, an offline LLM never idles, and
        # its first capture compiles the kernel variants of large steps (2-3 s on an empty Triton cache), which
        # would otherwise fall on the first big generate() (docs/gpu_notes.md, run 12). No-op without such graphs.
        self.engine.core.idle_work()
        self._ids = itertools.count()
        self._defaults = sampling_defaults(model, generation_config) if runner is None else {}
        # an LLM dropped without shutdown() still stops its engine (a tensor-parallel one has worker processes,
        # and only one may run per process); shutdown() runs this once
        self._stop = weakref.finalize(self, self.engine.shutdown)

    # ------------------------------------------------------------------ vLLM-style API
    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name for the underlying engine."""
        return self.engine

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: what ``generate`` / ``chat`` use when given no SamplingParams (the checkpoint's
        generation_config.json, under ``generation_config="auto"``)."""
        return SamplingParams(**self._defaults)

    def get_tokenizer(self) -> Any:
        """The underlying HF tokenizer (as vLLM returns)."""
        return self.engine.tokenizer.hf if self.engine.tokenizer is not None else None

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def generate(self, prompts: PromptType | Sequence[PromptType] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
                 *, prompt_token_ids: Sequence[Sequence[int]] | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate completions for every prompt; results come back in input order.

        ``prompts``: a string, a list of strings, one token-id list, a list of token-id lists, or dicts with
        ``prompt_token_ids`` (or ``prompt``). ``sampling_params``: one for all or one per prompt.
        """
        items = _normalise_prompts(prompts, prompt_token_ids)
        params = _per_prompt(sampling_params if sampling_params is not None else self.get_default_sampling_params(),
                             len(items))
        prio = list(priority) if priority is not None else [0] * len(items)
        if len(prio) != len(items):
            raise ValueError(f"priority has {len(prio)} entries for {len(items)} prompts: give one per prompt")
        return self._run(items, params, prio, use_tqdm)

    def chat(self, messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: Sequence[Mapping[str, Any]] | None = None,
             chat_template_kwargs: Mapping[str, Any] | None = None) -> list[RequestOutput]:
        """Chat completions: one conversation (list of {"role", "content"}) or a list of conversations, as vLLM's
        ``LLM.chat``: ``content`` may be OpenAI text parts; ``continue_final_message`` leaves the last message
        open for the model to continue (with ``add_generation_prompt=False``); ``chat_template_kwargs`` override
        the other template arguments."""
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("chat needs a tokenizer with a chat template")
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise ValueError("messages: give a conversation (a list of {'role', 'content'} dicts) or a list of them")
        kwargs: dict[str, Any] = {"add_generation_prompt": add_generation_prompt,
                                  "continue_final_message": continue_final_message}
        if tools:
            kwargs["tools"] = [dict(t) for t in tools]
        if chat_template is not None:
            kwargs["chat_template"] = chat_template
        kwargs.update(chat_template_kwargs or {})
        add_prompt = bool(kwargs.pop("add_generation_prompt"))
        if kwargs.get("continue_final_message") and add_prompt:
            raise ValueError("continue_final_message=True needs add_generation_prompt=False")
        if not kwargs.get("continue_final_message"):
            kwargs.pop("continue_final_message", None)
        convs = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        items: list[PromptType] = []
        for conv in convs:
            text = tok.render_chat([plain_message(m) for m in conv], add_prompt, **kwargs)
            items.append({"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        params = _per_prompt(sampling_params if sampling_params is not None else self.get_default_sampling_params(),
                             len(items))
        return self._run(items, params, [0] * len(items), use_tqdm)

    def shutdown(self) -> None:
        self._stop()

    # ------------------------------------------------------------------ internals
    def _run(self, items: list[PromptType], params: list[SamplingParams], prio: list[int],
             use_tqdm: bool) -> list[RequestOutput]:
        if not self._stop.alive:
            raise RuntimeError("this LLM has been shut down: create a new one")
        engine = self.engine
        ids: list[str] = []
        try:
            for i, (p, sp) in enumerate(zip(items, params)):
                rid = str(next(self._ids))
                try:
                    engine.add_request(rid, p, sp, priority=prio[i])
                except ValueError as exc:
                    raise ValueError(f"prompt {i}: {exc}") from None
                ids.append(rid)
            results: dict[str, RequestOutput] = {}
            with _Progress(len(ids), enabled=use_tqdm and len(ids) >= _PROGRESS_MIN_PROMPTS) as bar, \
                    heap_set_aside():  # full collections walk only what the loop allocates
                while engine.has_unfinished_requests():
                    for ro in engine.step():
                        if ro.finished:
                            results[ro.request_id] = ro
                            bar.advance(sum(len(c.token_ids) for c in ro.outputs))
        except BaseException:
            engine.abort_request([r for r in ids])  # leave nothing behind (KeyboardInterrupt included)
            raise
        return [results[r] for r in ids]


def _normalise_prompts(prompts: Any, prompt_token_ids: Any) -> list[PromptType]:
    if prompts is None:
        if prompt_token_ids is None:
            raise ValueError("give prompts (or prompt_token_ids)")
        return [list(p) for p in prompt_token_ids]
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    try:
        seq = list(prompts)
    except TypeError:
        raise ValueError(f"prompts must be a string, token ids, a prompt dict, or a list of those; not "
                         f"{type(prompts).__name__}") from None
    if seq and all(isinstance(t, int) for t in seq):
        return [seq]  # one prompt given as token ids
    return seq


def _per_prompt(sp: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if sp is None:
        return [SamplingParams()] * n
    if isinstance(sp, SamplingParams):
        return [sp] * n
    if isinstance(sp, (Mapping, str)) or not isinstance(sp, Sequence):
        raise ValueError(f"sampling_params must be a SamplingParams (or a list, one per prompt), not "
                         f"{type(sp).__name__}: write SamplingParams(**...)")
    sps = list(sp)
    if len(sps) != n:
        raise ValueError(f"got {len(sps)} sampling_params for {n} prompts: give one, or one per prompt")
    return sps


class _Progress:
    """A rich progress bar over finished requests with the output token rate; a no-op when disabled."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self._p: Any = None

    def __enter__(self) -> "_Progress":
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._p = Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                               TextColumn("{task.fields[toks]} output tok/s"), console=Console(stderr=True),
                               transient=False)
            self._p.start()
            self._task = self._p.add_task("gen", total=self.total, toks="-")
            self._tokens = 0
        return self

    def advance(self, num_tokens: int) -> None:
        if self._p is not None:
            self._tokens += num_tokens
            task = self._p.tasks[0]
            rate = self._tokens / task.elapsed if task.elapsed else 0.0
            self._p.update(self._task, advance=1, toks=f"{rate:,.0f}")

    def __exit__(self, *exc: Iterable[Any]) -> None:
        if self._p is not None:
            self._p.stop()
