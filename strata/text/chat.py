"""Chat templates: a model's Jinja template rendered exactly as transformers' `apply_chat_template` renders it.

Models are trained on what transformers renders, so every detail that changes a byte is copied from
transformers/utils/chat_template_utils.py (5.x): the sandboxed environment with `trim_blocks` and `lstrip_blocks`,
the loop-control extension and a `{% generation %}` tag, the `raise_exception`, `strftime_now`, `dict` and
`namespace` helpers, a `tojson` that does not HTML-escape, the tokenizer's named special tokens as variables, message
keys whose value is None dropped, reasoning passed under `reasoning_content` (and `thinking`) whichever name the
caller used, and every input rebuilt from plain JSON types before the template sees it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

from strata.errors import StrataError

# Names a message's reasoning may come under; templates read the first (transformers' list, same order).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "chat_templates"


@lru_cache(maxsize=16)
def _compile(source: str) -> Any:
    """Compile `source` in transformers' environment (cached: a REPL renders the same template every turn)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for transformers' training masks; when
        rendering it only passes its body through, but templates that use it must still parse."""

        tags: ClassVar[set[str]] = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    class TemplateDict:
        """`dict(...)` without exposing the dict type itself to the sandbox."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """A namespace that refuses underscore-prefixed attributes (a route to CPython internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise StrataError(f"chat template has a syntax error at line {e.lineno}: {e.message}") from None


def plain_data(value: Any) -> Any:
    """`value` rebuilt from JSON types only, as transformers does before rendering: the sandbox does not know
    which methods of arbitrary objects are dangerous, and subclasses of str/int could change what renders."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    if type(value).__module__ == "numpy" and callable(getattr(value, "item", None)) and getattr(value, "ndim", 1) == 0:
        return plain_data(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain_data(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """Put a message's reasoning under `reasoning_content` (what Qwen templates read) and `thinking`, whichever
    of the known names the caller used."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _templates_from_config(value: Any, where: str) -> dict[str, str]:
    """tokenizer_config.json's `chat_template`: a string, a {name: template} dict, or the legacy
    [{"name": ..., "template": ...}] list."""
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: t["template"] for t in value}
    if isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return dict(value)
    raise StrataError(f"{where}: chat_template must be a string, a name -> template object or a list of "
                      "{name, template} objects")


GGUF_TEMPLATE_KEY = "tokenizer.chat_template"


def templates_from_gguf(metadata: Mapping[str, Any], where: str) -> dict[str, str]:
    """A GGUF's chat templates as {name: template}: `tokenizer.chat_template` is "default", and
    `tokenizer.chat_template.<name>` the named ones (gguf-py writes tokenizer_config.json's named templates there,
    listing the names in `tokenizer.chat_templates`)."""
    out: dict[str, str] = {}
    for key, value in metadata.items():
        if key == GGUF_TEMPLATE_KEY:
            name = "default"
        elif key.startswith(GGUF_TEMPLATE_KEY + ".") and len(key) > len(GGUF_TEMPLATE_KEY) + 1:
            name = key[len(GGUF_TEMPLATE_KEY) + 1:]
        else:
            continue
        if not isinstance(value, str):
            raise StrataError(f"{where}: {key} must be a string (a Jinja chat template)")
        out[name] = value
    return out


def _is_list_of_objects(value: Any) -> bool:
    return (isinstance(value, Sequence) and not isinstance(value, (str, bytes))
            and all(isinstance(v, Mapping) for v in value))


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise StrataError(f"cannot read chat template {path}: {e}") from None


class ChatTemplate:
    """A model's chat template(s) with the special tokens the templates may refer to.

    A model may carry several named templates (e.g. "default" and "tool_use"); `render` picks one as transformers
    does: the `name` asked for, else "tool_use" when tools are given and it exists, else "default".
    """

    def __init__(self, templates: Mapping[str, str], special_tokens: Mapping[str, str] | None = None,
                 origin: str = "chat template"):
        if not templates:
            raise StrataError(f"{origin}: no chat template")
        self.templates = dict(templates)
        self.special_tokens = dict(special_tokens or {})
        self.origin = origin

    @classmethod
    def from_dir(cls, folder: str | Path, special_tokens: Mapping[str, str] | None = None,
                 tokenizer_config: Mapping[str, Any] | None = None) -> ChatTemplate | None:
        """The template of a model folder, or None when it has none. `chat_template.jinja` (and named templates
        in `chat_templates/*.jinja`) take priority over `chat_template` in tokenizer_config.json, as in
        transformers."""
        folder = Path(folder)
        files: dict[str, str] = {}
        if (folder / TEMPLATE_FILE).is_file():
            files["default"] = _read_text(folder / TEMPLATE_FILE)
        if (folder / TEMPLATE_DIR).is_dir():
            for p in sorted((folder / TEMPLATE_DIR).glob("*.jinja")):
                files[p.stem] = _read_text(p)
        if files:
            return cls(files, special_tokens, str(folder / TEMPLATE_FILE))
        if tokenizer_config is None:
            path = folder / "tokenizer_config.json"
            try:
                tokenizer_config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise StrataError(f"cannot read {path}: {e}") from None
        where = str(folder / "tokenizer_config.json")
        templates = _templates_from_config((tokenizer_config or {}).get("chat_template"), where)
        return cls(templates, special_tokens, where) if templates else None

    @classmethod
    def from_config(cls, config: Mapping[str, Any], special_tokens: Mapping[str, str] | None = None,
                    origin: str = "tokenizer_config.json") -> ChatTemplate | None:
        """The template(s) under `chat_template` in a tokenizer_config.json-shaped mapping, or None when it has
        none. For tokenizers that carry their template inside the model file (a GGUF's `Tokenizer.config`), where
        no template file beside the model may override it."""
        templates = _templates_from_config(config.get("chat_template"), origin)
        return cls(templates, special_tokens, origin) if templates else None

    @classmethod
    def from_file(cls, path: str | Path, special_tokens: Mapping[str, str] | None = None) -> ChatTemplate:
        """A template from a .jinja file (or a tokenizer_config.json-style JSON file with `chat_template`)."""
        path = Path(path)
        if not path.exists() or path.is_dir():
            raise StrataError(f"chat template file {path} does not exist")
        text = _read_text(path)
        if path.suffix == ".json":
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise StrataError(f"{path} is not valid JSON ({e})") from None
            templates = _templates_from_config(data.get("chat_template") if isinstance(data, dict) else None,
                                               str(path))
            return cls(templates, special_tokens, str(path))
        return cls({"default": text}, special_tokens, str(path))

    def source(self, tools: Sequence[Any] | None = None, name: str | None = None) -> str:
        """The template text `render` would use for these arguments."""
        if name is not None:
            if name not in self.templates:
                raise StrataError(f"{self.origin} has no template named {name!r}; it has "
                                  f"{', '.join(sorted(self.templates))}")
            return self.templates[name]
        if len(self.templates) == 1:
            return next(iter(self.templates.values()))
        if tools is not None and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        raise StrataError(f"{self.origin} has several templates and no default: pick one of "
                          f"{', '.join(sorted(self.templates))}")

    def variables(self, tools: Sequence[Any] | None = None, name: str | None = None) -> frozenset[str]:
        """Names the template reads from its inputs, e.g. to tell whether it honours `enable_thinking`."""
        import jinja2.meta

        source = self.source(tools, name)
        env = _compile(source).environment
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
               documents: Sequence[Mapping[str, Any]] | None = None, add_generation_prompt: bool = False,
               name: str | None = None, **template_kwargs: Any) -> str:
        """The prompt text for `messages`, identical to transformers'
        `apply_chat_template(messages, tools=..., documents=..., add_generation_prompt=..., tokenize=False,
        **template_kwargs)`. Extra keyword arguments (enable_thinking, reasoning_effort, ...) reach the template as
        variables and override special tokens of the same name. A template that fails -> StrataError saying why."""
        import jinja2

        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise StrataError("messages must be a list of {role, content} objects")
        if not messages:
            raise StrataError("cannot apply the chat template to an empty conversation")
        chat = []
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping):
                raise StrataError(f"message {i} must be an object with 'role' and 'content', got {m!r}")
            chat.append(_alias_reasoning(plain_data({k: v for k, v in m.items() if v is not None})))
        if tools is not None and not _is_list_of_objects(tools):
            raise StrataError("tools must be a list of JSON-schema objects")
        if documents is not None and not _is_list_of_objects(documents):
            raise StrataError("documents must be a list of objects with 'title' and 'text'")
        kwargs = {**self.special_tokens, **template_kwargs}
        template = _compile(self.source(tools, name))
        try:
            return template.render(messages=chat, tools=plain_data(None if tools is None else list(tools)),
                                   documents=plain_data(None if documents is None else list(documents)),
                                   add_generation_prompt=add_generation_prompt, **plain_data(kwargs))
        except jinja2.exceptions.TemplateError as e:
            raise StrataError(f"chat template failed to render: {e}") from None
        except Exception as e:  # noqa: BLE001  (a template is code: its TypeErrors etc. are input/template faults)
            raise StrataError(f"chat template failed to render: {type(e).__name__}: {e}") from None
