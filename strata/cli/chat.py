"""`strata chat`: an interactive conversation with a model through its chat template.

Every turn renders the whole history through the template (so the model sees exactly what transformers would give
it) and continues the sequence state of the previous turn when the new prompt extends it, so only the new tokens are
prefilled. Ctrl-C while an answer streams stops that answer and returns to the prompt; Ctrl-D (EOF) or /exit quits.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from strata.cli.common import add_model_args
from strata.cli.generate import (
    add_progress_arg,
    add_sampling_args,
    add_template_args,
    add_tokenizer_arg,
    load_llm,
    require_thinking_switch,
    sampling_params,
    template_kwargs,
    write_text,
)
from strata.errors import StrataError

HELP = """commands:
  /reset          forget the conversation (the system message stays)
  /think on|off   switch the model's thinking on or off (templates with enable_thinking)
  /exit           quit (Ctrl-D too)
  /help           this text
Ctrl-C stops an answer that is being written."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="talk to a model in an interactive session",
                       description="Interactive chat through the model's chat template. " + HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    add_tokenizer_arg(p)
    add_sampling_args(p, max_tokens=512)
    add_template_args(p)
    add_progress_arg(p)
    p.set_defaults(run=run)


class ChatSession:
    """The conversation: messages, template variables, and the sequence state the last answer left behind."""

    def __init__(self, llm: Any, params: Any, system: str | None, kwargs: dict[str, Any]):
        self.llm = llm
        self.params = params
        self.system = system
        self.kwargs = kwargs
        self.messages: list[dict[str, str]] = []
        self.state: Any = None
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system is not None else []
        self.state = None

    def command(self, line: str) -> bool:
        """Handle a /command; False means quit."""
        cmd, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        if cmd in ("/exit", "/quit"):
            return False
        if cmd == "/reset":
            self.reset()
            print("(conversation cleared)")
        elif cmd == "/think":
            try:
                require_thinking_switch(self.llm)
            except StrataError as e:
                print(f"({e})")
                return True
            if arg not in ("on", "off"):
                now = self.kwargs.get("enable_thinking")
                print(f"(usage: /think on|off; now {'the template default' if now is None else ('on' if now else 'off')})")
                return True
            self.kwargs["enable_thinking"] = arg == "on"
            print(f"(thinking {arg})")
        elif cmd == "/help":
            print(HELP)
        else:
            print(f"(unknown command {cmd}; /help lists them)")
        return True

    def answer(self, text: str) -> None:
        """Stream the assistant's answer to `text`. Ctrl-C keeps what was written so far as the answer."""
        self.messages.append({"role": "user", "content": text})
        try:
            ids = self.llm.chat_ids(self.messages, **self.kwargs)
            gen = self.llm.start(ids, self.params, self.state)
        except StrataError:
            self.messages.pop()
            raise
        try:
            for piece in gen:
                write_text(piece)
        except KeyboardInterrupt:
            # The state may be mid-update: drop it, the next turn prefills from scratch.
            self.state = None
            write_text("\n(stopped)\n")
            if gen.text:
                self.messages.append({"role": "assistant", "content": gen.text})
            else:
                self.messages.pop()
            return
        write_text("\n")
        self.state = gen.state
        self.messages.append({"role": "assistant", "content": gen.text})


def run(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    llm = load_llm(args)
    if llm.chat_template is None:
        raise StrataError(f"the model at {llm.path} has no chat template; give one with --chat-template FILE")
    session = ChatSession(llm, params, args.system, template_kwargs(args, llm))
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        print(f"strata chat with {llm.path}. /help for commands, Ctrl-D to quit.")
    while True:
        try:
            line = input(">>> " if interactive else "")
        except EOFError:
            if interactive:
                print()
            return 0
        except KeyboardInterrupt:
            print()
            continue
        if not line.strip():
            continue
        if line.startswith("/"):
            if not session.command(line):
                return 0
            continue
        try:
            session.answer(line)
        except StrataError as e:
            print(f"error: {e}", file=sys.stderr)
