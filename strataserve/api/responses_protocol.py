"""Pydantic request model of ``POST /v1/responses`` (OpenAI's Responses API), with the fields the official client
sends and a few of vLLM's sampling extras. ``input`` items are checked one by one in ``api/responses_input.py``, so
a bad item is a 400 naming ``input[i]...`` rather than a union's wall of alternatives.

Stateless, as vLLM without a store: ``store`` is accepted (nothing is kept); what needs a stored response or
conversation (``previous_response_id``, ``conversation``, ``background``, ``item_reference`` items) is a 400.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, ValidatorFunctionWrapHandler, field_validator
from pydantic_core import PydanticCustomError

from strataserve.api.protocol import Int64, _Base

#: OpenAI's bounds on ``metadata``: 16 pairs, keys up to 64 characters, values up to 512
MAX_METADATA, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


class FunctionToolIn(_Base):
    """A Responses function tool: flat (``name`` next to ``type``), unlike chat's ``{"function": {...}}``."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolChoiceFunctionIn(_Base):
    type: Literal["function"]
    name: str


class TextFormatIn(_Base):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfigIn(_Base):
    format: TextFormatIn | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningIn(_Base):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(_Base):
    model: str | None = None
    input: str | list[Any]  # each item is checked in ``responses_input`` (a 400 naming ``input[i]``)
    instructions: str | None = None
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[FunctionToolIn] | None = None
    tool_choice: Literal["auto", "none", "required"] | ToolChoiceFunctionIn | None = None
    parallel_tool_calls: bool = True
    text: TextConfigIn | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool = True
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool = False
    reasoning: ReasoningIn | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    top_logprobs: Int64 | None = None
    service_tier: str | None = None
    max_tool_calls: Int64 | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    prompt: Any = None  # a stored prompt template: refused (nothing is stored here)
    # vLLM extras, as on the chat route
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    priority: Int64 = 0
    ignore_eos: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    structured_outputs: dict | None = None

    # A bad value is one short error naming the field, not pydantic's list of every union branch it missed
    # (``input.str``, ``tool_choice.literal[...]``): the client sees the field and what it accepts.
    @field_validator("input", mode="wrap")
    @classmethod
    def _input_shape(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("input_type", "must be a string or a list of input items (messages, "
                                      "function_call and function_call_output items)") from None

    @field_validator("tool_choice", mode="wrap")
    @classmethod
    def _tool_choice_shape(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("tool_choice_type", "must be 'auto', 'none', 'required' or "
                                      "{\"type\": \"function\", \"name\": ...} (allowed_tools and hosted tool "
                                      "choices are not supported)") from None

    # What the shared admission (``serving.admit`` and ``RequestLimits.check``) reads of a generation request:
    # one sequence, no logit_bias, no stream_options (the Responses API has none of them).
    @property
    def n(self) -> int:
        return 1

    @property
    def logit_bias(self) -> None:
        return None

    @property
    def stream_options(self) -> None:
        return None
