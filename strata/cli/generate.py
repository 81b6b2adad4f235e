"""`strata generate`: complete a prompt (text or token ids), streaming the text to stdout or printing one JSON
object. Also home of the sampling and chat-template flags that `strata chat` shares."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from strata.cli.common import add_model_args, parse_ids, read_ids_file
from strata.errors import StrataError


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling (definitions: docs/usage.md, strata/text/sampling.py)")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help=f"most tokens to generate (default: {max_tokens})")
    g.add_argument("--greedy", action="store_true", help="always take the most likely token")
    g.add_argument("--temperature", type=float, default=1.0, help="softmax temperature; 0 = greedy (default: 1)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off (default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1 = off (default)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability; 0 = off")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="CTRL-style penalty; 1 = off (default)")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI presence penalty in [-2, 2]")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI frequency penalty in [-2, 2]")
    g.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS (in [-100, 100]) to token ID's logit; repeatable")
    g.add_argument("--seed", type=int, default=None, help="seed for the random draws (default: a fresh one)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop before this text; repeatable")


def add_tokenizer_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", metavar="PATH", default=None,
                   help="use this tokenizer instead of the model's own: a folder with tokenizer.json, or a GGUF "
                        "file (a GGUF model brings its own tokenizer from its metadata)")


def add_template_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("chat template")
    g.add_argument("--chat-template", metavar="FILE", default=None,
                   help="a .jinja chat template to use instead of the model's own")
    g.add_argument("--system", metavar="TEXT", default=None, help="a system message to start the conversation")
    g.add_argument("--think", choices=["on", "off"], default=None,
                   help="pass enable_thinking to templates that support it (default: the template's own default)")
    g.add_argument("--template-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="a variable for the chat template (VALUE is read as JSON, else as a string), e.g. "
                        "reasoning_effort=high; repeatable")


def add_progress_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--progress", choices=["auto", "always", "never"], default="auto",
                   help="loading progress bar on stderr (default auto: when stderr is a terminal)")


def show_progress(args: argparse.Namespace) -> bool:
    return args.progress == "always" or (args.progress == "auto" and sys.stderr.isatty())


def sampling_params(args: argparse.Namespace) -> Any:
    """SamplingParams from the flags; checked here, so bad values fail before the model loads."""
    from strata.text.sampling import SamplingParams

    bias: dict[int, float] = {}
    for item in args.logit_bias:
        key, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError
            bias[int(key)] = float(value)
        except ValueError:
            raise StrataError(f"--logit-bias wants ID=BIAS, e.g. 42=-100, got {item!r}") from None
    try:
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                              presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                              logit_bias=bias, seed=args.seed, stop=tuple(args.stop), greedy=args.greedy,
                              skip_special_tokens=not getattr(args, "show_special", False))
    except StrataError as e:  # name the flag, not the field: "--max-tokens must be ..."
        field, _, rest = str(e).partition(" ")
        if field.isidentifier() and rest.startswith("must"):
            raise StrataError(f"--{field.replace('_', '-')} {rest}") from None
        raise


def template_kwargs(args: argparse.Namespace, llm: Any) -> dict[str, Any]:
    """Variables for the chat template from --think and --template-arg."""
    out: dict[str, Any] = {}
    for item in args.template_arg:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise StrataError(f"--template-arg wants KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    if args.think is not None:
        require_thinking_switch(llm)
        out["enable_thinking"] = args.think == "on"
    return out


def require_thinking_switch(llm: Any) -> None:
    if llm.chat_template is None or "enable_thinking" not in llm.chat_template.variables():
        raise StrataError("this model's chat template has no enable_thinking switch")


def load_llm(args: argparse.Namespace) -> Any:
    from strata.api import LLM

    return LLM(args.model, args.dtype, args.device, tokenizer=args.tokenizer, chat_template=args.chat_template,
               progress=show_progress(args), context=args.context, activations=args.activations,
               ple_table=args.ple_table)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="complete a prompt and stream the text",
                       description="Complete a prompt given as text or token ids. Streams the text to stdout, or "
                                   "with --json prints one JSON object with ids, text, finish reason and timings.")
    add_model_args(p)
    add_tokenizer_arg(p)
    p.add_argument("prompt", nargs="?", default=None, help="prompt text ('-' reads it from stdin)")
    p.add_argument("--ids", default=None, help="the prompt as comma-separated token ids")
    p.add_argument("--ids-file", default=None, help="JSON file: a list of ids, or an object with an 'ids' list")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument("--show-special", action="store_true", help="keep special tokens in the text")
    p.add_argument("-v", "--verbose", action="store_true", help="print timings to stderr after the text")
    add_sampling_args(p, max_tokens=64)
    add_template_args(p)
    add_progress_arg(p)
    p.set_defaults(run=run)


def _check_args(args: argparse.Namespace) -> str | list[int]:
    """The prompt (text or ids) after checking the flags fit together; runs before the model loads."""
    given = [x for x in (args.prompt, args.ids, args.ids_file) if x is not None]
    if len(given) != 1:
        raise StrataError("give exactly one of: a prompt, --ids, --ids-file")
    if not args.chat and (args.system is not None or args.think is not None or args.template_arg):
        raise StrataError("--system, --think and --template-arg need --chat")
    if args.prompt is None:
        if args.chat:
            raise StrataError("--chat needs a text prompt, not token ids")
        return parse_ids(args.ids) if args.ids is not None else read_ids_file(args.ids_file)
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if text == "":
        raise StrataError("empty prompt: give some text or token ids")
    return text


def _prompt(args: argparse.Namespace, llm: Any, prompt: str | list[int]) -> list[int]:
    if not args.chat:
        return llm.prompt_ids(prompt)
    messages = ([{"role": "system", "content": args.system}] if args.system is not None else [])
    messages.append({"role": "user", "content": prompt})
    return llm.prompt_ids(llm.chat_ids(messages, **template_kwargs(args, llm)))


def write_text(text: str) -> None:
    """Write streamed text now (flushed), even to a terminal whose encoding lacks some of its characters."""
    try:
        sys.stdout.write(text)
    except UnicodeEncodeError:  # a terminal that cannot show some character must not end the generation
        enc = sys.stdout.encoding or "ascii"
        sys.stdout.write(text.encode(enc, errors="replace").decode(enc))
    sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    prompt = _check_args(args)
    llm = load_llm(args)
    ids = _prompt(args, llm, prompt)
    gen = llm.start(ids, params)
    if args.json:
        gen.run()
        t = gen.timings
        print(json.dumps({
            "prompt_ids": gen.prompt_ids, "generated_ids": gen.token_ids, "text": gen.text,
            "finish_reason": gen.finish_reason, "stop_reason": gen.stop_reason, "seed": gen.seed,
            "usage": {"prompt_tokens": len(gen.prompt_ids), "completion_tokens": len(gen.token_ids),
                      "total_tokens": len(gen.prompt_ids) + len(gen.token_ids)},
            "timings": t.as_dict()}, ensure_ascii=False))
        return 0
    for piece in gen:
        write_text(piece)
    write_text("\n")
    if args.verbose:
        t = gen.timings
        rate = (lambda r: f"{r:.1f} tok/s" if r is not None else "n/a")
        print(f"[{gen.finish_reason}] prompt: {t.prompt_tokens} tokens, {rate(t.prompt_tokens_per_s)}; "
              f"decode: {len(gen.token_ids)} tokens, {rate(t.decode_tokens_per_s)}; seed {gen.seed}",
              file=sys.stderr)
    return 0
