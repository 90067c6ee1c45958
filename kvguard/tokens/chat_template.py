"""Chat templates rendered exactly as `transformers`' `apply_chat_template(tokenize=False)` does.

The jinja2 environment, globals and filters copy `transformers.utils.chat_template_utils`
(sandboxed, trim_blocks/lstrip_blocks, loopcontrols, the `{% generation %}` tag, `tojson`
without HTML escaping, `raise_exception`, `strftime_now`), and so do the message clean-up
(keys whose value is None dropped, reasoning fields aliased) and the `continue_final_message`
cut. The content format ("string" or "openai") is detected from the template's AST as vLLM's
`_detect_content_format` (vllm/renderers/hf.py) does.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.nodes as nodes
import jinja2.parser
import jinja2.runtime
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

ContentFormat = Literal["string", "openai"]

# transformers appends this to the final message, renders, then cuts at it.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Names render() passes itself; request variables may not shadow them.
RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


# The most text one render may produce. A template can amplify its input (say, the tool list
# printed again for every message); past this the request is refused instead of the process
# spending memory and CPU on it. Far above any prompt a context window holds.
MAX_RENDERED_CHARS = 32 * 1024 * 1024


def _bounded(chunks: Iterator[str]) -> str:
    """Join rendered chunks, refusing output beyond MAX_RENDERED_CHARS as it is produced."""
    out: list[str] = []
    size = 0
    for chunk in chunks:
        size += len(chunk)
        if size > MAX_RENDERED_CHARS:
            raise ChatTemplateError(
                f"the chat template renders more than {MAX_RENDERED_CHARS} characters"
            )
        out.append(chunk)
    return "".join(out)


class ChatTemplateError(ValueError):
    """The template cannot render these messages. The message never quotes prompt text."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` renders its body, in a macro scope as transformers."""

    tags = {"generation"}  # noqa: RUF012 (jinja2's declared type)

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: jinja2.runtime.Macro) -> str:
        return str(caller())


class _Namespace(jinja2.utils.Namespace):
    """A namespace that refuses underscore attributes, which could reach CPython internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _Dict:
    """`dict(...)` and `dict.fromkeys(...)` without exposing the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Not jinja2's own filter: that one escapes HTML characters and would change the prompt.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Sandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, with its verdict on each (type, attribute name) remembered.

    The verdict depends on nothing else (`is_internal_attribute` and `modifies_known_mutable`
    test the object's type and the name), and one render asks it for every attribute access,
    a good part of rendering a chat. Only attributes that exist are asked about, so the table
    stays as small as the types and names templates use.
    """

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._verdicts: dict[tuple[type, str], bool] = {}

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        verdict = self._verdicts.get(key)
        if verdict is None:
            verdict = self._verdicts[key] = super().is_safe_attribute(obj, attr, value)
        return verdict


def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env


_ENV = _environment()


class ChatTemplate:
    """One compiled chat template and the content format vLLM detects for it."""

    def __init__(self, source: str, origin: str) -> None:
        """Compile `source`; `origin` names it in errors. Raises ValueError if it does not parse."""
        try:
            self._template = _ENV.from_string(source)
            ast = _ENV.parse(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"{origin}: chat template does not compile: {exc}") from None
        self.source = source
        self.content_format: ContentFormat = detect_content_format(ast)
        # vLLM turns developer messages into system ones for a template that never names the
        # role (vllm/renderers/hf.py `_detect_developer_role_support`).
        self.names_developer = '"developer"' in source or "'developer'" in source

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: list[Any] | None,
        documents: list[Any] | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        variables: Mapping[str, Any],
    ) -> str:
        """The prompt text. Raises ChatTemplateError; never mutates its arguments."""
        if clash := RESERVED_VARIABLES & variables.keys():
            raise ChatTemplateError(f"chat_template_kwargs may not set {sorted(clash)}")
        if tools is not None and not all(isinstance(t, dict) for t in tools):
            raise ChatTemplateError("tools must be JSON objects")
        if documents is not None and not all(isinstance(d, dict) for d in documents):
            raise ChatTemplateError("documents must be JSON objects")
        chat = [_alias_reasoning({k: v for k, v in m.items() if v is not None}) for m in messages]
        final_text = self._tag_final_message(chat) if continue_final_message else ""
        context = {
            **variables,
            "messages": chat,
            "tools": tools,
            "documents": documents,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            rendered = _bounded(self._template.generate(context))
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:  # raise_exception, undefined names, sandbox refusals
            raise ChatTemplateError(f"chat template failed to render: {_short(str(exc))}") from None
        except (TypeError, AttributeError) as exc:  # their messages name types, not values
            raise ChatTemplateError(
                f"chat template failed to render: {type(exc).__name__}: {_short(str(exc))}"
            ) from None
        except Exception as exc:  # e.g. ValueError('…<prompt text>…'): name the type only
            name = type(exc).__name__
            raise ChatTemplateError(f"chat template failed to render: {name}") from None
        return _cut_at_tag(rendered, final_text) if continue_final_message else rendered

    def _tag_final_message(self, chat: list[dict[str, Any]]) -> str:
        """Tag the final message's last text as transformers does; return that text."""
        if not chat or chat[-1].get("content") is None:
            raise ChatTemplateError("continue_final_message: the final message has no content")
        if "content" not in self.source:
            raise ChatTemplateError("continue_final_message: the template never renders content")
        content = chat[-1]["content"]
        if isinstance(content, list):
            blocks = [dict(b) if isinstance(b, dict) else b for b in content]
            for block in reversed(blocks):
                if isinstance(block, dict) and isinstance(block.get("text"), str):
                    text: str = block["text"]
                    block["text"] = text + _CONTINUE_TAG
                    chat[-1]["content"] = blocks
                    return text
            raise ChatTemplateError("continue_final_message: the final message has no text")
        if not isinstance(content, str):
            raise ChatTemplateError("continue_final_message needs text content")
        chat[-1]["content"] = content + _CONTINUE_TAG
        return content


def _cut_at_tag(rendered: str, final_text: str) -> str:
    if final_text.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
        raise ChatTemplateError(
            "continue_final_message: the template does not render the final message intact"
        )
    at = rendered.rindex(_CONTINUE_TAG.strip())
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message's trailing whitespace


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    # transformers: templates read `reasoning_content`, gpt-oss ones read `thinking`.
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


# --- content format detection, after vLLM's vllm/renderers/hf.py --------------------------


class _Undetectable(Exception):
    """vLLM asserts on these shapes and falls back to its default, "string"."""


def _is_var(node: nodes.Node, name: str) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, nodes.Getitem):
        arg = node.arg
        return _is_var(node.node, name) and isinstance(arg, nodes.Const) and arg.value == key
    if isinstance(node, nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _is_var_or_elems(node: nodes.Node, name: str, key: str | None = None) -> bool:
    if isinstance(node, nodes.Filter):
        return node.node is not None and _is_var_or_elems(node.node, name, key)
    if isinstance(node, nodes.Test):
        return _is_var_or_elems(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _is_var_or_elems(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _aliases(root: nodes.Template, name: str) -> Iterator[str]:
    """`name` and every variable `{% set %}` from it (or from its elements), transitively."""
    seen, queue = {name}, deque([name])
    yield name
    while queue:
        current = queue.popleft()
        for assign in root.find_all(nodes.Assign):
            if _is_var_or_elems(assign.node, current):
                if not isinstance(assign.target, nodes.Name):
                    raise _Undetectable
                # vLLM only skips self-assignment; `seen` also ends cycles, where it would hang.
                if assign.target.name not in seen:
                    seen.add(assign.target.name)
                    queue.append(assign.target.name)
                    yield assign.target.name


def _loop_targets(root: nodes.Template, names: list[str], key: str | None) -> Iterator[str]:
    for loop in root.find_all(nodes.For):
        if any(_is_var_or_elems(loop.iter, name, key) for name in names):
            if not isinstance(loop.target, nodes.Name):
                raise _Undetectable
            yield loop.target.name


def detect_content_format(ast: nodes.Template) -> ContentFormat:
    """ "openai" if the template loops over a message's `content`, else "string"."""
    try:
        message_names = list(_loop_targets(ast, list(_aliases(ast, "messages")), None))
        found = next(_loop_targets(ast, message_names, "content"), None)
    except _Undetectable:
        return "string"
    return "string" if found is None else "openai"
