"""Pydantic request models of the OpenAI routes, with the fields the official client sends plus vLLM's extras.

Unknown fields are ignored (as vLLM does) so newer clients keep working. Responses are built as plain dicts and
encoded with msgspec on the hot path; their shapes follow the OpenAI API reference.
"""
from __future__ import annotations

import types
from functools import cache
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_N = 128  # completions per request; more is almost certainly a mistake and would hog the batch
# Integers cross the process boundary as msgpack int64: bound them here so a huge value is a 400, not a 500.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """An explicit ``null`` for an optional field means its default (OpenAI's spec marks ``n``, ``logprobs``,
        ``parallel_tool_calls``... nullable; vLLM declares them Optional). Only for fields whose type has no None
        of its own: where None means something (``max_tokens: null``, as many as fit) it is kept."""
        if isinstance(data, dict):
            drop = _null_means_default(cls)
            if any(data.get(k, 0) is None for k in drop):
                data = {k: v for k, v in data.items() if not (v is None and k in drop)}
        return data


@cache
def _null_means_default(cls: type[BaseModel]) -> frozenset[str]:
    """Input names (aliases too) of ``cls``'s fields that have a default but take no None."""
    names = set()
    for name, f in cls.model_fields.items():
        if not f.is_required() and not _allows_none(f.annotation):
            names.update({name, f.alias or name})
    return frozenset(names)


def _allows_none(annotation: Any) -> bool:
    if annotation is None or annotation is type(None) or annotation is Any:
        return True
    if get_origin(annotation) in (Union, types.UnionType):
        return any(_allows_none(a) for a in get_args(annotation))
    if get_origin(annotation) is Annotated:
        return _allows_none(get_args(annotation)[0])
    return False


class StreamOptions(_Base):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Base):
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Base):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Base):
    """Fields shared by completions and chat; names and defaults as OpenAI / vLLM."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: Int64 | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extras
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    stop_token_ids: list[Int64] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Int64 = 0
    allowed_token_ids: list[Int64] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: Int64 | None = None  # keep the last k prompt tokens (-1: max_model_len)
    prompt_logprobs: Int64 | None = None  # each prompt token's logprob and the top N (not streamed)
    # structured outputs (vLLM extras; ``api/guided.py`` turns them into one GuidedDecodingParams)
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    structured_outputs: dict | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Int64 | None = 16
    logprobs: Int64 | None = None
    echo: bool = False
    return_token_ids: bool = False  # vLLM extra: prompt_token_ids + token_ids in each choice (streamed: per chunk)
    suffix: str | None = None
    best_of: Int64 | None = None
    add_special_tokens: bool = True  # vLLM extra: False leaves out what the tokenizer adds (BOS) to text prompts


class TextPart(_Base):
    type: Literal["text"]
    text: str


class FunctionCall(_Base):
    name: str
    arguments: str | dict = "{}"


class ToolCallIn(_Base):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(_Base):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolDef(_Base):
    type: Literal["function"] = "function"
    function: FunctionDef


class ChatMessage(_Base):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool result: which call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)  # vLLM's join of a message's text parts




class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    tools: list[ToolDef] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM / transformers: the prompt ends inside the last message (prefill)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM: extra template variables (enable_thinking, ...)
    return_token_ids: bool = False  # vLLM extra: prompt_token_ids (response) + token_ids per choice / chunk
    # OpenAI's deprecated function calling, declared so that it is refused (api/chat.py), not silently dropped
    functions: list[Any] | None = None
    function_call: str | dict | None = None


class TokenizeRequest(_Base):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDef] | None = None  # rendered as the chat route renders them, so the counts agree
    return_token_strs: bool = False  # vLLM: also answer each token id's token string (``token_strs``)


class DetokenizeRequest(_Base):
    model: str | None = None
    tokens: list[int]
