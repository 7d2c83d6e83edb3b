"""The session a workflow drives: `chat` for the next assistant turn, `call_tools` for tool results, `finish`
for the episode.

A session records every turn's exact token ids (`trinity.workflows.transcript`) and enforces the episode's
limits: asking for a turn past `max_turns`, or with a prompt that fills `context_tokens`, raises
`EpisodeLimit` (a workflow may catch it to score the episode; otherwise the runner scores it 0); a turn
that waits longer than `turn_timeout_s` raises `TurnTimeout` (the error policy's).
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence

from trinity.config.schema.workflow import Limits
from trinity.rollout.types import SamplingParams
from trinity.workflows.tool_calls import (
    ToolCallParser,
    check_tools_supported,
    parser_for,
)
from trinity.workflows.transcript import Transcript
from trinity.workflows.types import (
    JSON,
    ChatTokenizer,
    EndReason,
    Episode,
    Finish,
    Message,
    Task,
    TokenRequest,
    TokenResult,
    ToolCall,
    Turn,
)


class EpisodeLimit(Exception):
    def __init__(self, reason: EndReason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason: EndReason = reason


class TurnTimeout(Exception):
    pass


class Engine(Protocol):
    async def generate(self, request: TokenRequest) -> TokenResult: ...


@dataclass(frozen=True)
class Reply:
    """The assistant's turn: `message` (role assistant, the sampled text as content) and the tool calls
    parsed from it (when the turn was given tools)."""

    message: Message
    finish: Finish
    tool_calls: tuple[ToolCall, ...] = ()
    tool_errors: tuple[str, ...] = ()

    @property
    def text(self) -> str:
        return self.message["content"]


def chat_stop_ids(tokenizer: ChatTokenizer) -> tuple[int, ...]:
    """The id that ends an assistant turn: `<|im_end|>` where the vocabulary has it (ChatML templates),
    else EOS. A turn stopped by an id the template does not render after it would not extend."""
    vocab = tokenizer.get_vocab()
    if "<|im_end|>" in vocab:
        return (vocab["<|im_end|>"],)
    return (tokenizer.eos_token_id,)


class Session:
    def __init__(self, task: Task, tokenizer: ChatTokenizer, engine: Engine, *, limits: Limits = Limits(),
                 sampling: SamplingParams = SamplingParams(), stop_ids: Sequence[int] | None = None,
                 tool_format: str | None = None, template_args: Mapping[str, JSON] | None = None,
                 episode: int = 0) -> None:
        self.task = task
        self.episode = episode  # its number in the run: names its turns' draws (`TokenRequest`)
        self.tokenizer = tokenizer
        self.engine = engine
        self.limits = limits
        stops = tuple(stop_ids) if stop_ids is not None else chat_stop_ids(tokenizer)
        self.sampling = dataclasses.replace(sampling, eos_token_ids=stops)
        self.tool_format = tool_format
        self.transcript = Transcript(tokenizer, limits.template_mismatch, template_args)
        self.messages: list[Message] = []
        self.turns: list[Turn] = []
        self._in_turn = False

    async def chat(self, messages: Sequence[Message], tools: Sequence[dict[str, JSON]] | None = None, *,
                   temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                   max_new_tokens: int | None = None) -> Reply:
        """The next assistant turn after `messages` (the whole conversation so far, as a chat API takes it);
        `tools`: function specs the template shows the model (OpenAI's JSON schema form)."""
        if self._in_turn:  # two turns at once would each extend the same conversation
            raise RuntimeError("a session runs one chat turn at a time: await each session.chat before the next")
        self._in_turn = True
        try:
            return await self._chat(messages, tools, temperature, top_p, top_k, max_new_tokens)
        finally:
            self._in_turn = False

    async def _chat(self, messages: Sequence[Message], tools: Sequence[dict[str, JSON]] | None,
                    temperature: float | None, top_p: float | None, top_k: int | None,
                    max_new_tokens: int | None) -> Reply:
        parser: ToolCallParser | None = None
        if tools:
            check_tools_supported(self.tokenizer)
            parser = parser_for(self.tokenizer, self.tool_format)
        if len(self.turns) >= self.limits.max_turns:
            raise EpisodeLimit("max_turns", f"{self.limits.max_turns} turns taken")
        prompt = self.transcript.prompt(messages, tools)
        room = self.limits.context_tokens - len(prompt.ids)
        if room <= 0:
            raise EpisodeLimit("context_limit", f"the prompt has {len(prompt.ids)} tokens, the limit is "
                                                f"{self.limits.context_tokens}")
        base = self.sampling
        params = dataclasses.replace(
            base, temperature=base.temperature if temperature is None else temperature,
            top_p=base.top_p if top_p is None else top_p, top_k=base.top_k if top_k is None else top_k,
            max_new_tokens=min(room, base.max_new_tokens if max_new_tokens is None else max_new_tokens))
        try:
            request = TokenRequest(prompt.ids, params, self.episode, len(self.turns))
            result = await asyncio.wait_for(self.engine.generate(request), self.limits.turn_timeout_s)
        except TimeoutError:
            raise TurnTimeout(f"turn {len(self.turns) + 1} waited over {self.limits.turn_timeout_s} s") from None
        ids = result.token_ids
        body = ids[:-1] if result.finish == "stop" else ids
        text = self.tokenizer.decode(list(body), skip_special_tokens=False)
        stop_text = self.tokenizer.decode(list(ids[-1:]), skip_special_tokens=False) if result.finish == "stop" else ""
        self.transcript.record(prompt, ids, result.logprobs, text + stop_text)
        parsed = parser.parse(text) if parser is not None else None
        reply = Reply({"role": "assistant", "content": text}, result.finish,
                      parsed.calls if parsed else (), parsed.errors if parsed else ())
        self.turns.append(Turn(prompt.ids, ids, result.logprobs, result.finish, text, reply.tool_calls,
                               reply.tool_errors))
        self.messages = [*messages, reply.message]
        return reply

    async def call_tools(self, reply: Reply, tools: Mapping[str, Callable[..., JSON]]) -> list[Message]:
        """Run the reply's tool calls (each in a worker thread, within `turn_timeout_s`); one `tool` message
        per call in order, then one per malformed call. A tool's exception, an unknown tool or bad
        arguments become an error message for the model; a tool past the timeout raises `TurnTimeout`."""
        out: list[Message] = []
        for call in reply.tool_calls:
            fn = tools.get(call.name)
            if fn is None:
                out.append(_tool(f"error: unknown tool {call.name!r}; tools: {', '.join(sorted(tools))}"))
                continue
            try:
                value = await asyncio.wait_for(asyncio.to_thread(fn, **call.arguments), self.limits.turn_timeout_s)
            except TimeoutError:
                raise TurnTimeout(f"tool {call.name!r} ran over {self.limits.turn_timeout_s} s") from None
            except Exception as e:  # the model is told, as a tool would answer
                out.append(_tool(f"error: {e}"))
                continue
            out.append(_tool(value if isinstance(value, str) else _json(value)))
        out += [_tool(e) for e in reply.tool_errors]
        return out

    def finish(self, *, reward: float | None = None, turn_rewards: Sequence[float] | None = None,
               end: EndReason = "finished", error: str | None = None) -> Episode:
        """The episode as it stands: the conversation, its training sequences and the score."""
        return Episode(task=self.task, messages=tuple(self.messages), turns=tuple(self.turns),
                       sequences=self.transcript.sequences(), end=end, reward=reward,
                       turn_rewards=None if turn_rewards is None else tuple(float(r) for r in turn_rewards),
                       error=error)


def _tool(content: str) -> Message:
    return {"role": "tool", "content": content}


def _json(value: JSON) -> str:
    import json

    return json.dumps(value)
