"""Prompt templates: how a dataset row (a dict of fields) becomes the text a model trains on.

A template has a *prompt* and, optionally, a *target*. Both are ``str.format`` strings with ``{field}``
placeholders filled from the row. The two halves are rendered (and later tokenized) separately so that
the position where the target starts is exact; unpacked examples take their loss on the target only.
A literal template given in the config has no target, so its whole text is in the loss.

``data.format=instruction`` renders a prompt and a response (:func:`instruction_template`): the named ``alpaca``
template (Stanford Alpaca's two prompts, with and without an input) or a literal template whose target starts at
its ``{<data.response_field>}`` placeholder; only the target is in the loss.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ipuft.data.bounds import DEFAULT_BOUNDS, RenderBounds
from ipuft.errors import DataError


class _TooLong(Exception):
    """A format spec, or the text rendered so far, beyond the rendering's character bound."""


class _BoundedFormatter(string.Formatter):
    """``str.format_map`` with every field's format spec checked before formatting (a width or precision of
    ``{instruction:999999999}`` would ask for that many characters at once), and the text made counted: either
    beyond ``limit`` characters raises :class:`_TooLong`. The spec is checked as it is applied, after any
    nested ``{field}`` in it was filled in from the row."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit, self.made = limit, 0

    def format_field(self, value: Any, format_spec: str) -> str:
        for number in re.findall(r"\d+", format_spec):
            if len(number) > 18 or int(number) > self.limit:
                raise _TooLong(f"its format spec {format_spec[:40]!r} asks for {number[:20]} characters")
        text = super().format_field(value, format_spec)
        self.made += len(text)
        if self.made > self.limit:
            raise _TooLong("the text it renders is longer")
        return text


def bounded_format(template: str, values: dict[str, Any], bounds: RenderBounds) -> str:
    """``template.format_map(values)`` within ``bounds.max_chars`` characters (:class:`_BoundedFormatter`)."""
    formatter = _BoundedFormatter(bounds.max_chars)
    text = formatter.vformat(template, (), values)
    if len(text) > bounds.max_chars:
        raise _TooLong("the text it renders is longer")
    return text


@dataclass(frozen=True)
class Template:
    """A prompt, an optional target, and names for the integer values of the ``label`` field."""

    prompt: str
    target: str | None = None
    labels: dict[int, str] = field(default_factory=dict)
    key: str = "data.template"  # the config key that gave it, for error messages

    @cached_property
    def fields(self) -> list[str]:
        """The row fields the template reads, in order of first appearance."""
        names: list[str] = []
        for part in (self.prompt, self.target or ""):
            for _, name, _, _ in string.Formatter().parse(part):
                if name is not None and name != "" and name not in names:
                    names.append(name)
        return names

    def render(self, row: dict[str, Any], where: str, bounds: RenderBounds = DEFAULT_BOUNDS) -> tuple[str, str]:
        """``(prompt_text, target_text)`` for ``row``; the target text is ``""`` without a target.

        ``where`` ("FILE row N") starts every error message. An integer (or digit-string) ``label`` is
        mapped through :attr:`labels` when the template names its labels; other label values pass through.
        Neither text may exceed ``bounds.max_chars`` (``data.template_max_chars``), nor any format width.
        """
        values = {}
        for name in self.fields:
            value = row.get(name)
            # csv.DictReader fills the cells of a short row with None: treat them as missing too.
            if value is None:
                present = ", ".join(k for k, v in row.items() if v is not None) or "(no fields)"
                raise DataError(f"{where}: template field {name!r} is missing; the row has: {present}")
            if isinstance(value, bool) or not isinstance(value, (str, int)):
                # A dict, list or float would be stringified silently (a label 1.0 is no label).
                raise DataError(f"{where}: template field {name!r} is {type(value).__name__} "
                                f"({str(value)[:40]}), not text or an integer")
            if name == "label" and self.labels:
                value = self._label_name(value, where)
            values[name] = value
        try:
            prompt = bounded_format(self.prompt, values, bounds)
            target = bounded_format(self.target, values, bounds) if self.target is not None else ""
        except _TooLong as exc:
            raise DataError(f"{where}: {self.key} renders past data.template_max_chars={bounds.max_chars:,}: "
                            f"{exc}; shorten the template or raise data.template_max_chars") from None
        except (ValueError, IndexError, KeyError, AttributeError) as exc:
            # A malformed literal template (an unmatched brace, a positional "{}" or "{0}").
            raise DataError(f"{where}: cannot render {self.key}: {exc}") from None
        return prompt, target

    def _label_name(self, value: Any, where: str) -> Any:
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value.strip())
        if not isinstance(value, int):
            return value  # already a name, e.g. "entailment"
        if value not in self.labels:
            names = ", ".join(f"{k}={v}" for k, v in sorted(self.labels.items()))
            raise DataError(f"{where}: label {value} is not one of the template's labels ({names})")
        return self.labels[value]


# The reference's MNLI template: "mnli hypothesis: {hypothesis} premise: {premise} target: {label}<|endoftext|>".
TEMPLATES: dict[str, Template] = {
    "mnli": Template(
        prompt="mnli hypothesis: {hypothesis} premise: {premise} target:",
        target=" {label}<|endoftext|>",
        labels={0: "entailment", 1: "neutral", 2: "contradiction"},
    ),
}


def resolve_template(name_or_literal: str) -> Template:
    """The named template from :data:`TEMPLATES`, or else a literal one (all prompt, no target)."""
    if name_or_literal in TEMPLATES:
        return TEMPLATES[name_or_literal]
    return Template(prompt=name_or_literal)


# Stanford Alpaca's two prompts (its train.py's PROMPT_DICT), word for word; the response follows "### Response:"
# directly, as it did there.
ALPACA_WITH_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further "
                     "context. Write a response that appropriately completes the request.\n\n"
                     "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:")
ALPACA = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
          "request.\n\n### Instruction:\n{instruction}\n\n### Response:")
INSTRUCTION_TEMPLATES = ("alpaca",)


@dataclass(frozen=True)
class InstructionTemplate:
    """How an instruction row becomes ``(prompt_text, response_text)``: the named ``alpaca`` template reading the
    row's ``prompt_field``, ``input_field`` (optional; absent or blank: the prompt without an input) and
    ``response_field``, or a literal :class:`Template` whose target starts at the response's placeholder."""

    prompt_field: str
    input_field: str | None
    response_field: str
    literal: Template | None = None

    def render(self, row: dict[str, Any], where: str, bounds: RenderBounds = DEFAULT_BOUNDS) -> tuple[str, str]:
        """``(prompt, response)`` of ``row``; one :class:`DataError` line starting with ``where`` if a field the
        template reads is missing or not text, or a literal template renders past ``bounds``."""
        if self.literal is not None:
            return self.literal.render(row, where, bounds)
        instruction = _field_text(row, self.prompt_field, "data.prompt_field", where)
        response = _field_text(row, self.response_field, "data.response_field", where)
        given = None if self.input_field is None else row.get(self.input_field)
        if given is not None and not isinstance(given, str):
            raise DataError(f"{where}: field {self.input_field!r} (data.input_field) is {type(given).__name__}, "
                            f"not text")
        if given is None or not given.strip():
            return ALPACA.format_map({"instruction": instruction}), response
        return ALPACA_WITH_INPUT.format_map({"instruction": instruction, "input": given}), response


def _field_text(row: dict[str, Any], name: str, key: str, where: str) -> str:
    value = row.get(name)
    if value is None:
        present = ", ".join(k for k, v in row.items() if v is not None) or "(no fields)"
        raise DataError(f"{where}: field {name!r} ({key}) is missing; the row has: {present}")
    if not isinstance(value, str):
        raise DataError(f"{where}: field {name!r} ({key}) is {type(value).__name__}, not text")
    return value


def instruction_template(name_or_literal: str, prompt_field: str, input_field: str | None,
                         response_field: str) -> InstructionTemplate:
    """``data.instruction_template``: ``alpaca``, or a literal template split where ``{<response_field>}`` first
    appears (the prompt before it, the target from it on); one :class:`DataError` line if a literal one has no
    such placeholder."""
    if name_or_literal in INSTRUCTION_TEMPLATES:
        return InstructionTemplate(prompt_field, input_field, response_field)
    marker = "{" + response_field + "}"
    start = name_or_literal.find(marker)
    if start < 0:
        raise DataError(f"data.instruction_template: a literal template must hold {marker} (data.response_field) "
                        f"where the response, the text in the loss, starts; or name one of: "
                        f"{', '.join(INSTRUCTION_TEMPLATES)}")
    literal = Template(prompt=name_or_literal[:start], target=name_or_literal[start:], key="data.instruction_template")
    return InstructionTemplate(prompt_field, input_field, response_field, literal)
