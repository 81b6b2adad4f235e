"""`strata serve`: the OpenAI- and Anthropic-compatible HTTP server with its web chat page (docs/serve.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from strata.cli.common import add_model_args
from strata.errors import StrataError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the model over HTTP (OpenAI and Anthropic APIs, web chat)",
                       description="Serve the model over HTTP: /v1/chat/completions, /v1/completions, /v1/models, "
                                   "/v1/messages, /v1/status, /metrics, /health and a web chat page at /.")
    add_model_args(p)
    p.add_argument("--tokenizer", metavar="DIR", default=None,
                   help="folder with tokenizer.json when it is not beside the model (e.g. for a GGUF file)")
    p.add_argument("--chat-template", metavar="FILE", default=None,
                   help="a .jinja chat template to use instead of the model's own")
    p.add_argument("--model-name", default=None,
                   help="the model id clients send (default: the model folder's name)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: 127.0.0.1, this machine only; any other address needs an API key)")
    p.add_argument("--port", type=int, default=8080, help="port (default: 8080)")
    key = p.add_mutually_exclusive_group()
    key.add_argument("--api-key", metavar="KEY", default=None,
                     help="require this key ('Authorization: Bearer KEY' or 'x-api-key: KEY') on every API route")
    key.add_argument("--api-key-file", metavar="FILE", default=None,
                     help="read the key from FILE (keeps it out of the process list)")
    p.add_argument("--max-concurrency", type=int, default=1, metavar="N",
                   help="sequences generated at the same time (default: 1)")
    p.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="requests that may wait for a free sequence slot; more get 503 (default: 64)")
    p.add_argument("--max-prompt-tokens", type=int, default=None, metavar="N",
                   help="longest prompt accepted (default: the model's context - 1)")
    p.add_argument("--max-tokens-limit", type=int, default=None, metavar="N",
                   help="largest max_tokens a request may ask for (default: the model's context)")
    p.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024, metavar="N",
                   help="largest request body (default: 8 MiB)")
    p.add_argument("--cache-mib", type=int, default=1024, metavar="MIB",
                   help="memory for saved conversation states (prompt reuse); 0 turns reuse off (default: 1024)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn log level (default: info)")
    p.set_defaults(run=run)


def read_api_key(args: argparse.Namespace) -> str | None:
    if args.api_key_file is None:
        return args.api_key or None
    try:
        key = Path(args.api_key_file).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise StrataError(f"cannot read the API key file {args.api_key_file}: {e}") from None
    if not key:
        raise StrataError(f"the API key file {args.api_key_file} is empty")
    return key


def check_bind(host: str, api_key: str | None) -> None:
    """Refuse to listen beyond this machine without an API key: anyone who can reach the port could otherwise
    run the model (and read the conversation-state cache's effects through timing)."""
    from strata.serve.app import is_loopback_host

    if not is_loopback_host(host) and not api_key:
        raise StrataError(f"refusing to listen on {host} without an API key: anyone on the network could use the "
                          "server. Give --api-key KEY (or --api-key-file FILE), or bind 127.0.0.1")


def check_limits(args: argparse.Namespace) -> None:
    for name in ("max_concurrency", "max_body_bytes"):
        if getattr(args, name) < 1:
            raise StrataError(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("max_prompt_tokens", "max_tokens_limit"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise StrataError(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_queue < 0 or args.cache_mib < 0:
        raise StrataError("--max-queue and --cache-mib must be >= 0")
    if not 0 < args.port < 65536:
        raise StrataError(f"--port must be in 1..65535, got {args.port}")


def run(args: argparse.Namespace) -> int:
    api_key = read_api_key(args)
    check_bind(args.host, api_key)
    check_limits(args)
    try:
        import uvicorn

        from strata.serve.app import create_app, is_loopback_host
        from strata.serve.context import ServeOptions
    except ImportError as e:
        raise StrataError(f"the server needs its extra packages ({e.name} is missing): "
                          "pip install 'strata[serve]'") from None
    from strata.api import LLM

    llm = LLM(args.model, args.dtype, args.device, tokenizer=args.tokenizer, chat_template=args.chat_template,
              progress=sys.stderr.isatty(), context=args.context, activations=args.activations,
              ple_table=args.ple_table)
    # Bound to loopback without a key, only loopback Host names are answered: a web page elsewhere could
    # otherwise reach the server through DNS rebinding.
    options = ServeOptions(model_name=args.model_name, api_key=api_key, max_concurrency=args.max_concurrency,
                           max_queue=args.max_queue, max_prompt_tokens=args.max_prompt_tokens,
                           max_tokens_limit=args.max_tokens_limit, max_body_bytes=args.max_body_bytes,
                           cache_bytes=args.cache_mib * 1024 * 1024,
                           loopback_hosts_only=is_loopback_host(args.host) and not api_key)
    app = create_app(llm, options)
    shown = f"[{args.host}]" if ":" in args.host else args.host
    print(f"strata serve: {app.state.ctx.model_name} on http://{shown}:{args.port}/ "
          f"({'API key required' if api_key else 'no API key'})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
