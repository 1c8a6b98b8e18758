"""Chat data: conversations (``messages``: ``[{role, content}, ...]``) rendered by the model's chat template, and
which of their tokens are the assistant's, the only ones in the loss.

The template is the tokenizer's own (``chat_template.jinja``, else tokenizer_config.json's ``chat_template``: a
string, or a list of named templates of which "default" is taken), or ``data.chat_template`` (a literal template,
or a file holding one). It is untrusted code: it is rendered only in jinja2's
:class:`~jinja2.sandbox.ImmutableSandboxedEnvironment`, with the globals and filters transformers gives chat
templates (``raise_exception``, ``strftime_now``, a ``tojson`` that does not escape HTML, the loop controls, the
tokenizer's special tokens as ``bos_token``, ``eos_token``, ...), and bounded: its size, the characters one
rendering yields, the ``range()`` iterations and the seconds one rendering may take.

Which characters are the assistant's: where the template marks them with ``{% generation %}...{%
endgeneration %}``, those (one rendering; the markers are an extension of ours, see :class:`_GenerationTag`);
otherwise each assistant turn is what rendering the conversation through that message adds to rendering it up
to the message with the generation prompt (so the assistant header stays out of the loss, its end-of-turn
token in). The characters then map to tokens through the tokenizer's offsets.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ipuft.data.bounds import DEFAULT_BOUNDS, Overrun, RenderBounds, deadline
from ipuft.data.tokenizer import token_name, tokenizer_source
from ipuft.errors import DataError, first_line

if TYPE_CHECKING:
    from omegaconf import DictConfig
    from tokenizers import Encoding

ROLES = ("system", "user", "assistant")
MAX_TEMPLATE_CHARS = 1 << 20  # real chat templates are a few kB; a tool-calling one some tens of kB
MAX_MESSAGES = 1024  # messages in one conversation
MAX_LOOP_STEPS = 1_000_000  # range() iterations of one rendering


def check_messages(value: Any, where: str, key: str = "messages") -> list[dict[str, str]]:
    """``value`` as a conversation: a non-empty list of at most :data:`MAX_MESSAGES` objects, each with a ``role``
    of :data:`ROLES` and a text ``content``; only those two keys are kept. One line starting with ``where``
    (FILE row N) naming the first thing wrong."""
    if not isinstance(value, list):
        got = "missing" if value is None else f"{type(value).__name__}, not a list"
        raise DataError(f"{where}: field {key!r} is {got}; expected a list of {{\"role\", \"content\"}} messages")
    if not value:
        raise DataError(f"{where}: field {key!r} is an empty list; a conversation has at least one message")
    if len(value) > MAX_MESSAGES:
        raise DataError(f"{where}: field {key!r} has {len(value)} messages, more than {MAX_MESSAGES}")
    messages = []
    for index, message in enumerate(value):
        what = f"{where}: {key}[{index}]"
        if not isinstance(message, dict):
            raise DataError(f"{what} is {type(message).__name__}, not an object with role and content")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str):
            raise DataError(f"{what}: role is {'missing' if role is None else type(role).__name__}, not text "
                            f"({', '.join(ROLES)})")
        if role not in ROLES:
            raise DataError(f"{what}: role {role[:40]!r} is not one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise DataError(f"{what}: content is {'missing' if content is None else type(content).__name__}, "
                            f"not text")
        messages.append({"role": role, "content": content})
    return messages


# -- The sandbox -----------------------------------------------------------------------------------------------


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """Chat templates' ``tojson``: plain :func:`json.dumps` (jinja's own escapes ``<``, ``>``, ``&`` and ``'`` for
    HTML, which would change the text a model was trained on), non-ASCII kept."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Refused(Exception):
    """``raise_exception(message)`` in a template: the template refuses the conversation."""


class _Budget:
    """One rendering's bounds: the ``range()`` steps left, its deadline (also enforced from outside, by
    :func:`ipuft.data.bounds.deadline`, wherever the rendering is), and the characters one value may hold."""

    def __init__(self, bounds: RenderBounds) -> None:
        self.bounds = bounds
        self.steps = MAX_LOOP_STEPS
        self.deadline = time.monotonic() + bounds.seconds

    def tick(self, steps: int = 1) -> None:
        self.steps -= steps
        if self.steps < 0:
            raise _Refused(f"it loops more than {MAX_LOOP_STEPS:,} range() steps in one conversation")
        if time.monotonic() > self.deadline:
            raise _Refused(self.overrun())

    def overrun(self) -> str:
        return f"it renders one conversation for more than {self.bounds.seconds:g} s (data.template_seconds)"

    def too_long(self, what: str) -> str:
        return f"{what}, more than data.template_max_chars={self.bounds.max_chars:,}"

    def check_size(self, count: Any, what: str) -> None:
        """Refuse making a value of ``count`` characters (or items), or a call given such a number."""
        if isinstance(count, int) and count > self.bounds.max_chars:
            raise _Refused(self.too_long(f"{what} {count:,}" if len(str(count)) < 40 else f"{what} a huge number"))


class _Range:
    """``range()`` in a template: a range whose every step is charged to the rendering's :class:`_Budget`. Its
    attributes are private, so that the sandbox (which refuses names starting with an underscore) lets no
    template reach the budget or the bare range."""

    def __init__(self, budget: _Budget, *args: int) -> None:
        self._budget, self._range = budget, range(*args)

    def __len__(self) -> int:
        return len(self._range)

    def __iter__(self):
        for value in self._range:
            self._budget.tick()
            yield value


def _digits_beyond(text: str, budget: _Budget, what: str) -> None:
    """Refuse a format string (``"%999999999d"``, ``"{:999999999}"``) whose width or precision is beyond the
    character bound: it is made in one C call."""
    for number in re.findall(r"\d+", text):
        if len(number) > 18 or int(number) > budget.bounds.max_chars:
            raise _Refused(budget.too_long(f"{what} is {number[:20]}"))


def _sized_filter(name: str, function: Callable, budget_of: Callable[[], _Budget]) -> Callable:
    """Filter ``name`` with its integer arguments bounded (``center(10**9)``, ``indent(10**9)``), and for
    ``format`` its format string too."""
    @functools.wraps(function)  # keeps jinja's pass_context and pass_eval_context marks
    def sized(*args, **kwargs):
        budget = budget_of()
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool):
                budget.check_size(value, f"its filter {name} is given")
        if name == "format" and args and isinstance(args[0], str):
            _digits_beyond(args[0], budget, "its format width")
        return function(*args, **kwargs)
    return sized


def _environment(budget_of: Callable[[], _Budget]):
    """The sandboxed environment chat templates render in: transformers' settings (trim_blocks, lstrip_blocks,
    loop controls, its globals and tojson), our generation tag, a ``range`` charged to ``budget_of()``, and every
    way one expression could make a huge value in one C call, which no deadline interrupts, bounded by the
    budget's characters: a string or list repeated (``*``), a power, any call or filter given an integer beyond
    the bound, a format string's width, ``lipsum``'s paragraphs."""
    from jinja2.ext import Extension
    from jinja2.nodes import CallBlock
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import generate_lorem_ipsum

    class _GenerationTag(Extension):
        """``{% generation %}BODY{% endgeneration %}``: BODY rendered between two markers no text can hold (a
        random nonce between NULs), found and removed after rendering, so that the assistant's characters are
        known wherever the body's output ends up."""

        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return CallBlock(self.call_method("_marked", []), [], [], body).set_lineno(lineno)

        def _marked(self, caller) -> str:
            return f"{OPEN}{caller()}{CLOSE}"

    class _SizedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%"})

        def call_binop(self, context, operator, left, right):
            budget = budget_of()
            if operator == "*":
                for seq, count in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(count, int):
                        budget.check_size(len(seq) * count, "it repeats a value to a length of")
            elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
                if right * abs(left).bit_length() > 4096:
                    raise _Refused(f"it raises {left} to the power {right}, a number of more than 4096 bits")
            elif operator == "%" and isinstance(left, str):
                _digits_beyond(left, budget, "its % format width")
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):
            budget = budget_of()
            for value in (*args, *kwargs.values()):
                if isinstance(value, int) and not isinstance(value, bool):
                    budget.check_size(value, "it passes a call the number")
            return super().call(__context, __obj, *args, **kwargs)

        def wrap_str_format(self, value):
            # "{:999999999}".format(...): the sandbox hands out its own str.format; its string is checked first.
            wrapped = super().wrap_str_format(value)
            if wrapped is not None:
                _digits_beyond(value.__self__, budget_of(), "its format width")
            return wrapped

    def raise_exception(message: Any) -> None:
        raise _Refused(str(message)[:200])

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    def lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
        # At most n × max words of at most 16 characters each (with a comma and a space): refused before
        # making what would be more.
        budget_of().check_size(n * max * 16 if isinstance(n, int) and isinstance(max, int) else 0,
                               "lipsum would make up to")
        return generate_lorem_ipsum(n, html, min, max)

    env = _SizedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.filters.update({name: _sized_filter(name, f, budget_of) for name, f in env.filters.items()})
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, lipsum=lipsum,
                       range=lambda *args: _Range(budget_of(), *args))
    return env


_NONCE = secrets.token_hex(8)
OPEN, CLOSE = f"\x00<generation {_NONCE}>\x00", f"\x00</generation {_NONCE}>\x00"


# -- The template ----------------------------------------------------------------------------------------------


@dataclass
class ChatTemplate:
    """A chat template, compiled in the sandbox, with the special tokens it is rendered with (``bos_token``,
    ``eos_token``, ... from tokenizer_config.json); ``source`` names where it came from in error messages."""

    text: str
    source: str
    specials: dict[str, Any] = field(default_factory=dict)
    bounds: RenderBounds = field(default_factory=RenderBounds)  # data.template_max_chars, data.template_seconds

    def __post_init__(self) -> None:
        from jinja2 import TemplateError, nodes

        if len(self.text) > MAX_TEMPLATE_CHARS:
            raise DataError(f"{self.source}: the chat template has {len(self.text):,} characters, more than "
                            f"{MAX_TEMPLATE_CHARS:,}; a chat template is a few kB")
        self._budget = _Budget(self.bounds)
        env = _environment(lambda: self._budget)
        try:
            self._template = env.from_string(self.text)
        except TemplateError as exc:
            line = f" (line {exc.lineno})" if getattr(exc, "lineno", None) else ""
            raise DataError(f"{self.source}: not a valid Jinja chat template{line}: "
                            f"{first_line(exc, type(exc).__name__)[:200]}") from None
        # Whether it marks the assistant's text: a {% generation %} tag, not merely the word.
        self.marked = any(isinstance(getattr(block.call, "node", None), nodes.ExtensionAttribute)
                          for block in env.parse(self.text).find_all(nodes.CallBlock))

    def render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool, where: str
               ) -> tuple[str, list[tuple[int, int]]]:
        """``(text, spans)``: ``messages`` rendered, and the ``[start, end)`` characters of its generation blocks
        (none without markers). One line starting with ``where`` if the template fails, refuses the
        conversation, breaks a bound, or renders no text for a conversation of at least one message."""
        from jinja2 import TemplateError

        self._budget = budget = _Budget(self.bounds)
        context = {**self.specials, "messages": list(messages), "add_generation_prompt": add_generation_prompt}
        parts, size = [], 0
        try:
            try:
                with deadline(self.bounds.seconds):  # interrupts loops that print nothing, wherever they are
                    for chunk in self._template.generate(**context):
                        if not isinstance(chunk, str):
                            raise _Refused(f"it renders {type(chunk).__name__}, not text")
                        size += len(chunk)
                        if size > self.bounds.max_chars:
                            raise _Refused(f"it renders more than {self.bounds.max_chars:,} characters of one "
                                          f"conversation (data.template_max_chars)")
                        budget.tick(0)
                        parts.append(chunk)
            except Overrun:
                raise _Refused(budget.overrun()) from None
        except _Refused as exc:
            raise DataError(f"{where}: the chat template ({self.source}) refuses it: {exc}") from None
        except Exception as exc:  # noqa: BLE001 (a template is code: whatever it raises is one line)
            kind = "" if isinstance(exc, TemplateError) else f"{type(exc).__name__}: "
            raise DataError(f"{where}: the chat template ({self.source}) fails: {kind}"
                            f"{first_line(exc, type(exc).__name__)[:200]}") from None
        text = "".join(parts)
        if not text.strip() and messages:
            raise DataError(f"{where}: the chat template ({self.source}) renders no text for it")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise DataError(f"{where}: the chat template ({self.source}) renders a lone UTF-16 surrogate, "
                            f"which is not text") from None
        return _unmarked(text, where, self.source)

    def assistant_spans(self, messages: Sequence[dict[str, str]], where: str) -> tuple[str, list[tuple[int, int]]]:
        """``(text, spans)``: the conversation rendered for training (no generation prompt) and the characters of
        its assistant turns: the template's generation blocks where it has them, else each assistant message's
        addition to the rendering of the conversation before it (see the module's docstring)."""
        text, spans = self.render(messages, False, where)
        if self.marked:
            return text, spans
        spans = []
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            through = self.render(messages[:index + 1], False, where)[0]
            prompt = self.render(messages[:index], True, where)[0]
            if not through.startswith(prompt):  # a template whose generation prompt is no prefix of the turn
                prompt = self.render(messages[:index], False, where)[0]
            if not (through.startswith(prompt) and text.startswith(through)):
                raise DataError(f"{where}: the chat template ({self.source}) does not render the conversation up to "
                                f"message {index} as the start of the whole, so its assistant turns cannot be "
                                f"found; give the template {{% generation %}} markers (data.chat_template)")
            spans.append((len(prompt), len(through)))
        return text, spans


def _unmarked(text: str, where: str, source: str) -> tuple[str, list[tuple[int, int]]]:
    """``text`` without its generation markers, and the spans they enclosed."""
    if OPEN not in text and CLOSE not in text:
        return text, []
    out, spans, at = [], [], 0
    length = 0
    while True:
        start = text.find(OPEN, at)
        if start < 0:
            rest = text[at:]
            if CLOSE in rest:
                raise DataError(f"{where}: the chat template ({source}) closes a generation block it never opened")
            out.append(rest)
            break
        end = text.find(CLOSE, start + len(OPEN))
        if end < 0:
            raise DataError(f"{where}: the chat template ({source}) leaves a generation block open")
        before, body = text[at:start], text[start + len(OPEN):end]
        if OPEN in body:
            raise DataError(f"{where}: the chat template ({source}) nests generation blocks")
        out += [before, body]
        length += len(before)
        spans.append((length, length + len(body)))
        length += len(body)
        at = end + len(CLOSE)
    return "".join(out), spans


def token_mask(encoding: Encoding, spans: Sequence[tuple[int, int]]) -> list[int]:
    """1 for each token of ``encoding`` whose characters (its offsets) overlap one of ``spans``, else 0."""
    import torch

    if not spans or not encoding.ids:
        return [0] * len(encoding.ids)
    offsets = torch.tensor(encoding.offsets, dtype=torch.long).reshape(-1, 2)
    mask = torch.zeros(len(offsets), dtype=torch.bool)
    for start, end in spans:
        if end > start:
            mask |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
    return mask.to(torch.uint8).tolist()


# -- Where the template comes from --------------------------------------------------------------------------------


def _special_tokens(settings: dict) -> dict[str, Any]:
    """tokenizer_config.json's special tokens, as a chat template sees them: ``bos_token`` and the like as text (a
    string, or an added token's ``content``), ``additional_special_tokens`` as a list of text."""
    found: dict[str, Any] = {}
    for key, value in settings.items():
        if key.endswith("_token") and (text := token_name(value)) is not None:
            found[key] = text
    extra = settings.get("additional_special_tokens")
    if isinstance(extra, list):
        found["additional_special_tokens"] = [text for t in extra if (text := token_name(t)) is not None]
    return found


def _from_config(settings: dict, where: str) -> str | None:
    """tokenizer_config.json's ``chat_template``: a string, or ``[{"name", "template"}, ...]`` whose "default" is
    taken; None where it has none."""
    value = settings.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        named = {t["name"]: t["template"] for t in value}
        if "default" in named:
            return named["default"]
        names = ", ".join(sorted(named))[:200]
        raise DataError(f"{where}: chat_template names templates ({names}) but no \"default\"; set "
                        f"data.chat_template to the one to use")
    raise DataError(f"{where}: chat_template is {type(value).__name__}, neither a template nor a list of "
                    f"{{\"name\", \"template\"}} objects")


def load_chat_template(override: str | None, home: Path | None, where: str, need: str = "data.format=chat",
                       bounds: RenderBounds = DEFAULT_BOUNDS) -> ChatTemplate:
    """The chat template: ``override`` (``data.chat_template``: a literal Jinja template, told by its ``{{`` or
    ``{%``, else a file holding one, read bounded), else ``home``'s (a tokenizer's or model's directory, or an
    ipuft checkpoint: chat_template.jinja, else tokenizer_config.json's chat_template). The special tokens come
    from ``home``'s tokenizer_config.json either way. ``where`` names the key that gave ``home``, ``need`` what
    asked for a template; ``bounds``: how far one rendering may go. One line saying what to set where there is
    none."""
    from ipuft.io.model_files import home_files

    found = home_files(home, ("tokenizer_config.json", "chat_template.jinja"), f"{where}: ") \
        if home is not None and home.is_dir() else {}
    settings = json.loads(found["tokenizer_config.json"]) if "tokenizer_config.json" in found else {}
    specials = _special_tokens(settings)
    if override is not None:
        if "{{" in override or "{%" in override:
            return ChatTemplate(override, "data.chat_template", specials, bounds)
        from ipuft.io.files import read_bounded

        path = Path(override)
        if not path.exists():
            raise DataError(f"data.chat_template: {override[:200]!r} is neither a Jinja template (it holds no {{{{ "
                            f"or {{%) nor an existing file")
        data = read_bounded(path, 4 * MAX_TEMPLATE_CHARS, f"data.chat_template: {path}", DataError,
                            "; a chat template is a few kB")
        try:
            return ChatTemplate(data.decode("utf-8"), f"data.chat_template {path}", specials, bounds)
        except UnicodeDecodeError:
            raise DataError(f"data.chat_template: {path} is not UTF-8 text") from None
    if "chat_template.jinja" in found:
        return ChatTemplate(found["chat_template.jinja"].decode("utf-8"), f"{home / 'chat_template.jinja'}",
                            specials, bounds)
    text = _from_config(settings, f"{where}: {home and home / 'tokenizer_config.json'}")
    if text is not None:
        return ChatTemplate(text, f"{home / 'tokenizer_config.json'}'s chat_template", specials, bounds)
    place = f"{where} ({home})" if home is not None else "the run's tokenizer"
    raise DataError(f"{need}: {place} has no chat template (no chat_template.jinja, no chat_template in "
                    f"tokenizer_config.json); set data.chat_template to a Jinja template or a file holding one")


def chat_template_of(cfg: DictConfig) -> ChatTemplate:
    """The run's chat template (:func:`ipuft.data.chat.load_chat_template`): ``data.chat_template``, else the
    tokenizer's directory's (or checkpoint's)."""
    source = tokenizer_source(cfg)
    home = Path(source[0]) if source is not None and Path(source[0]).is_dir() else None
    return load_chat_template(cfg.data.chat_template, home, source[1] if source is not None else "data.tokenizer",
                              bounds=RenderBounds.of(cfg.data))
