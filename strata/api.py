"""The Python API: `LLM` loads a model with its tokenizer and chat template; `generate`, `stream` and `chat` turn
text (or token ids) into text.

    from strata import LLM, SamplingParams
    llm = LLM()                                   # the bundled model; LLM("path/to/model") for another
    out = llm.generate("def fib(n):", SamplingParams(max_tokens=32, greedy=True))
    print(out.text, out.finish_reason, out.timings.decode_tokens_per_s)
    for piece in llm.stream("Once upon a time", SamplingParams(temperature=0.8, seed=1)):
        print(piece, end="", flush=True)
    llm.chat([{"role": "user", "content": "Hi"}], enable_thinking=False)   # models with a chat template
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from strata.errors import StrataError
from strata.model.model import SequenceState
from strata.runtime.engine import Engine
from strata.text.chat import ChatTemplate
from strata.text.generate import Generation, Timings
from strata.text.sampling import SamplingParams
from strata.text.tokenizer import Tokenizer

Prompt = str | Sequence[int]
Message = Mapping[str, Any]


@dataclass(frozen=True)
class Usage:
    """Token counts, as OpenAI-style APIs report them."""

    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Completion:
    """The result of one generation. `token_ids` includes the token that ended it (an EOS id, or the token that
    completed a stop string); `text` excludes EOS, special tokens (unless asked for) and the stop string.
    `finish_reason` is "stop" (EOS or stop string, see `stop_reason`) or "length" (max_tokens / context)."""

    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    finish_reason: str
    stop_reason: int | str | None
    usage: Usage
    timings: Timings
    seed: int


class LLM:
    """A model ready for text: the engine, its tokenizer, and its chat template (None when it has none).

    path: HF model folder or GGUF file (None: the bundled default model). dtype: "float32", "bfloat16" or
    "float16". device: a torch device. A GGUF file brings its own tokenizer, EOS ids and chat template (its
    `tokenizer.ggml.*` / `tokenizer.chat_template` metadata). tokenizer: a folder with tokenizer.json (and the config
    files naming EOS ids), or a GGUF file, whose tokenizer to use instead of the model's own. chat_template: a
    .jinja file to use instead of the model's own template. progress: show a loading progress bar on stderr.
    activations: "float" or "q8" (`strata.model.ops.ACTIVATIONS`). ple_table: "auto", "resident", "mapped", "device"
    or "pinned" (`strata.runtime.host_memory`).
    """

    def __init__(self, path: str | Path | None = None, dtype: str = "float32", device: str = "cpu", *,
                 tokenizer: str | Path | None = None, chat_template: str | Path | None = None,
                 progress: bool = False, context: int | None = None, activations: str = "float",
                 ple_table: str = "auto"):
        from tqdm import tqdm

        steps = ["weights", "tokenizer", "chat template"]
        with tqdm(total=len(steps), desc="loading", unit="step", disable=not progress, leave=False) as bar:
            bar.set_postfix_str(steps[0])
            self.engine = Engine.load(path, dtype, device, context=context, activations=activations,
                                      ple_table=ple_table, progress=progress)
            bar.update()
            bar.set_postfix_str(steps[1])
            self.tokenizer = Tokenizer.from_model(tokenizer if tokenizer is not None else self.engine.path)
            bar.update()
            bar.set_postfix_str(steps[2])
            specials = self.tokenizer.special_tokens_map
            self.chat_template: ChatTemplate | None
            if chat_template is not None:
                self.chat_template = ChatTemplate.from_file(chat_template, specials)
            elif self.tokenizer.gguf is not None:  # the GGUF's own template, as it carries its own tokenizer
                self.chat_template = ChatTemplate.from_config(self.tokenizer.config, specials,
                                                              f"{self.tokenizer.gguf} (tokenizer.chat_template)")
            else:
                self.chat_template = ChatTemplate.from_dir(self.tokenizer.folder, specials, self.tokenizer.config)
            bar.update()

    @property
    def path(self) -> Path:
        return Path(self.engine.path)

    # --- text <-> ids -------------------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens)

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt given as text or ids; empty prompts and ids outside the vocabulary are refused."""
        if isinstance(prompt, str):
            if prompt == "":
                raise StrataError("empty prompt: give some text or token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise StrataError("a token-id prompt must be a list of integers")
        if not ids:
            raise StrataError("empty prompt: give some text or token ids")
        self.engine.check_ids(ids)
        return ids

    # --- generation ---------------------------------------------------------------------------------------------

    def start(self, prompt: Prompt, params: SamplingParams | None = None,
              state: SequenceState | None = None) -> Generation:
        """A generation not yet run: iterate it for text pieces, then read its results. `state` (from an earlier
        Generation) is continued when it holds a prefix of the prompt, e.g. the previous turns of a chat."""
        return Generation(self.engine, self.tokenizer, self.prompt_ids(prompt), params or SamplingParams(), state)

    def generate(self, prompt: Prompt, params: SamplingParams | None = None) -> Completion:
        """Complete `prompt` (text or token ids)."""
        return self._completion(self.start(prompt, params).run())

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Complete `prompt`, yielding text pieces as they become final (never half a character, never part of a
        stop string)."""
        yield from self.start(prompt, params)

    # --- chat ---------------------------------------------------------------------------------------------------

    def chat_prompt(self, messages: Sequence[Message], *, tools: Sequence[Mapping[str, Any]] | None = None,
                    add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
        """The prompt text the chat template makes of `messages` (what transformers' apply_chat_template gives)."""
        if self.chat_template is None:
            raise StrataError(f"the model at {self.path} has no chat template (no chat_template.jinja, no "
                              "chat_template in tokenizer_config.json or in the GGUF metadata); give one with "
                              "chat_template=...")
        return self.chat_template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                         **template_kwargs)

    def chat_ids(self, messages: Sequence[Message], *, tools: Sequence[Mapping[str, Any]] | None = None,
                 add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]:
        """Token ids of the rendered chat, encoded without adding special tokens (the template writes them)."""
        text = self.chat_prompt(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                **template_kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def chat(self, messages: Sequence[Message], params: SamplingParams | None = None, *,
             tools: Sequence[Mapping[str, Any]] | None = None, **template_kwargs: Any) -> Completion:
        """The assistant's reply to `messages`. Keyword arguments (enable_thinking=False, reasoning_effort=...) go
        to the chat template."""
        ids = self.chat_ids(messages, tools=tools, **template_kwargs)
        return self._completion(self.start(ids, params).run())

    @staticmethod
    def _completion(g: Generation) -> Completion:
        return Completion(text=g.text, token_ids=list(g.token_ids), prompt_ids=list(g.prompt_ids),
                          finish_reason=g.finish_reason or "length", stop_reason=g.stop_reason,
                          usage=Usage(len(g.prompt_ids), len(g.token_ids)), timings=g.timings, seed=g.seed)
