"""Label selectors with Kubernetes' syntax and meaning (``Selector``), and the label rules.

Read from Kubernetes' own parser: k8s.io/apimachinery ``pkg/labels/selector.go`` at
eed236ceee2c19c2753a3d93ac0631dc20750454 (``Lexer``, ``Parser.parse``,
``Requirement.Matches``)::

    env=prod   env==prod   the label is there, with that value           (Equals, DoubleEquals)
    env!=prod              the label has another value, or is absent      (NotEquals)
    env in (a,b)           the label is there, with one of the values     (In)
    env notin (a,b)        the label has none of the values, or is absent (NotIn)
    gpu                    the label is there, whatever its value         (Exists)
    !gpu                   the label is absent                            (DoesNotExist)

Requirements are separated by commas and all must hold; the empty selector selects every
engine. Whitespace (space, tab, CR, LF) separates words and is otherwise ignored:
``env in ( a, b )`` is ``env in (a,b)``. As in Kubernetes, a value may be empty
(``env=`` is the label with the empty value, ``env in (a,)`` holds ``a`` and the empty
value, ``env in ()`` the empty value alone), ``in`` and ``notin`` are keys or values
wherever no operator can stand (``in in (notin)``), repeated values count once, and the
order of requirements and values does not matter (``str()`` sorts them).

Keys and values are checked as records' labels are (``validate_labels``): keys 1-63 of
``A-Za-z0-9._/-``, values printable and at most 256 characters, instead of Kubernetes'
DNS-style rules. But a value in the text cannot hold what the syntax reserves: whitespace
and ``, ( ) = ! < >``; select such a label with the mapping form (``{"k": "a b"}``).
Kubernetes' numeric ``>`` and ``<`` (Gt, Lt; its label docs leave them out, node affinity
uses them) are refused, with a message that says so.

Wherever the library takes a selector it takes a ``Selector``, its text, or a mapping of
labels (each ``key: value`` an equality, as before the text syntax existed).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple, final

from discovery._errors import InvalidRecordError, InvalidSelectorError

__all__ = ["Selector", "SelectorLike", "selector_of", "validate_labels"]

_LABEL_KEY = re.compile(r"[A-Za-z0-9._/-]{1,63}")
_KEY_RULE = "use 1-63 letters, digits, '.', '_', '/' or '-'"
_MAX_LABEL_VALUE = 256
_MAX_LABELS = 64
_NO_LABELS: Mapping[str, str] = MappingProxyType({})

# -- the label rules (records and selectors) ---------------------------------------------

LABELS_SCHEMA = {
    "type": "object",
    "maxProperties": _MAX_LABELS,
    "propertyNames": {"pattern": f"^{_LABEL_KEY.pattern}$"},
    "additionalProperties": {"type": "string", "maxLength": _MAX_LABEL_VALUE},
}
"""The JSON Schema of a record's labels (values must also be printable)."""


def _bad_value(value: str) -> bool:
    return len(value) > _MAX_LABEL_VALUE or not value.isprintable()


def validate_labels(labels: Mapping[str, str] | None) -> Mapping[str, str]:
    """Return a read-only copy of ``labels`` after checking keys, values and count."""
    if labels is None:
        return _NO_LABELS
    if not isinstance(labels, Mapping):
        raise InvalidRecordError(f"labels must be a mapping, not {type(labels).__name__}")
    if len(labels) > _MAX_LABELS:
        raise InvalidRecordError(f"at most {_MAX_LABELS} labels are allowed, got {len(labels)}")
    for key, value in labels.items():
        if not isinstance(key, str) or not _LABEL_KEY.fullmatch(key):
            raise InvalidRecordError(f"label key {key!r} is not allowed: {_KEY_RULE}")
        if not isinstance(value, str):
            raise InvalidRecordError(f"label {key!r} must be a string, not {type(value).__name__}")
        if _bad_value(value):
            raise InvalidRecordError(
                f"label {key!r} must be printable and at most {_MAX_LABEL_VALUE} characters"
            )
    return MappingProxyType(dict(labels))


# -- requirements --------------------------------------------------------------------------

_EQUALS, _NOT_EQUALS, _IN, _NOT_IN, _EXISTS, _ABSENT = "=", "!=", "in", "notin", "", "!"


class _Requirement(NamedTuple):
    """One requirement: a key, an operator, its values (sorted, each once)."""

    key: str
    operator: str
    values: tuple[str, ...]

    def __str__(self) -> str:
        """Kubernetes' ``Requirement.String()`` (``==`` is written ``=``)."""
        if self.operator == _EXISTS:
            return self.key
        if self.operator == _ABSENT:
            return f"!{self.key}"
        if self.operator in (_IN, _NOT_IN):
            return f"{self.key} {self.operator} ({','.join(self.values)})"
        return f"{self.key}{self.operator}{self.values[0]}"

    def test(self) -> tuple[str, bool, frozenset[str] | None]:
        """(key, wanted, values): whether the label's value is in ``values`` must be ``wanted``.

        When ``values`` is None, whether the label is there. An absent label's value is in
        no set, so ``!=`` and ``notin`` hold for it (Kubernetes' ``Requirement.Matches``).
        """
        values = None if self.operator in (_EXISTS, _ABSENT) else frozenset(self.values)
        return self.key, self.operator in (_EQUALS, _IN, _EXISTS), values


# -- the selector --------------------------------------------------------------------------


@final
class Selector:
    """A label selector: requirements on an engine's labels, all of which must hold.

    ``Selector.parse("env in (a,b),gpu")`` reads Kubernetes' syntax (module docs);
    ``Selector()`` selects every engine. Immutable and hashable: two selectors are equal
    when they say the same requirements (``==`` and ``=`` are one operator, order and
    repeats do not matter), so a selector can key a dict. ``str()`` is the canonical text.
    """

    __slots__ = ("_hash", "_requirements", "_tests", "_text")

    _requirements: tuple[_Requirement, ...]
    _tests: tuple[tuple[str, bool, frozenset[str] | None], ...]
    _text: str
    _hash: int

    def __init__(self) -> None:
        self._set(())

    def _set(self, requirements: tuple[_Requirement, ...]) -> None:
        set_slot = object.__setattr__  # once, here: the object is immutable after
        set_slot(self, "_requirements", requirements)
        set_slot(self, "_tests", tuple(r.test() for r in requirements))
        set_slot(self, "_text", ",".join(map(str, requirements)))
        set_slot(self, "_hash", hash(requirements))

    @classmethod
    def _of(cls, requirements: list[_Requirement]) -> Selector:
        selector = object.__new__(cls)
        selector._set(tuple(sorted(set(requirements))))
        return selector

    @classmethod
    def parse(cls, text: str) -> Selector:
        """The selector ``text`` says (cached per text); InvalidSelectorError if malformed."""
        if not isinstance(text, str):
            raise InvalidRecordError(
                f"a selector's text must be a string, not {type(text).__name__}"
            )
        return _parse(text)

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether ``labels`` meet every requirement (Kubernetes' ``Selector.Matches``)."""
        for key, wanted, values in self._tests:
            if values is None:
                if (key in labels) is not wanted:
                    return False
            elif (labels.get(key) in values) is not wanted:
                return False
        return True

    def unmet(self, labels: Mapping[str, str]) -> str | None:
        """The first requirement ``labels`` do not meet, as text; None when they match."""
        for requirement, (key, wanted, values) in zip(self._requirements, self._tests, strict=True):
            met = (key in labels) if values is None else (labels.get(key) in values)
            if met is not wanted:
                return str(requirement)
        return None

    def __and__(self, other: Selector) -> Selector:
        """The selector of both one's and the other's requirements."""
        if not isinstance(other, Selector):
            return NotImplemented
        return Selector._of([*self._requirements, *other._requirements])

    def __bool__(self) -> bool:
        """False for the empty selector (it selects everything)."""
        return bool(self._requirements)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Selector):
            return NotImplemented
        return self._requirements == other._requirements

    def __hash__(self) -> int:
        return self._hash

    def __str__(self) -> str:
        return self._text

    def __repr__(self) -> str:
        return f"Selector.parse({self._text!r})"

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("a Selector is immutable")

    def __reduce__(self) -> tuple[object, ...]:
        return Selector._of, (list(self._requirements),)  # copy and pickle, past __setattr__


SelectorLike = Selector | str | Mapping[str, str]
"""What the library takes as a selector: a ``Selector``, its text, or labels to equal."""

_EVERYTHING = Selector()


def selector_of(selector: SelectorLike | None) -> Selector:
    """``selector`` as a Selector: None is the empty one, a mapping its equalities."""
    if selector is None:
        return _EVERYTHING
    if type(selector) is Selector:  # final: no subclass to miss
        return selector
    if isinstance(selector, str):
        return _parse(selector)
    if type(selector) is dict or isinstance(selector, Mapping):  # the ABC check is slower
        return _from_labels(selector)
    raise InvalidRecordError(
        f"a selector is a Selector, its text or a mapping of labels, not {type(selector).__name__}"
    )


_MAX_CACHED = 1024  # selectors kept per form: a router's per-pick selectors are few
_BY_LABELS: dict[tuple[tuple[str, str], ...], Selector] = {}


def _from_labels(labels: Mapping[str, str]) -> Selector:
    """The equalities of ``labels``, checked once per distinct mapping (cached)."""
    try:
        return _BY_LABELS[tuple(labels.items())]
    except (KeyError, TypeError):  # new, or unhashable: checked below
        pass
    checked = validate_labels(labels)
    selector = Selector._of([_Requirement(k, _EQUALS, (v,)) for k, v in checked.items()])
    if len(_BY_LABELS) >= _MAX_CACHED:
        _BY_LABELS.clear()
    _BY_LABELS[tuple(checked.items())] = selector
    return selector


# -- the text: Kubernetes' lexer and parser --------------------------------------------------

_END, _WORD = "end", "word"  # token kinds besides the symbols, which are their own kind
# Kubernetes' lexer: whitespace is ' \t\r\n'; '=!(),<>' are symbols, read longest first
# ('==', '!='); any other run of characters is a word (a key, a value, in, notin).
_TOKEN = re.compile(r"[ \t\r\n]*(?:(==|!=|[=!(),<>])|([^ \t\r\n=!(),<>]+)|$)")


class _Token(NamedTuple):
    kind: str
    text: str
    at: int  # index in the selector's text


def _lex(text: str) -> list[_Token]:
    tokens = []
    at = 0
    while True:
        match = _TOKEN.match(text, at)
        assert match is not None  # every character is whitespace, a symbol or a word's
        symbol, word = match.groups()
        if symbol is None and word is None:
            tokens.append(_Token(_END, "", len(text)))
            return tokens
        start = match.start(1 if symbol is not None else 2)
        tokens.append(
            _Token(_WORD, word, start) if word is not None else _Token(symbol, symbol, start)
        )
        at = match.end()


@functools.lru_cache(maxsize=_MAX_CACHED)
def _parse(text: str) -> Selector:
    return Selector._of(_Parser(text).parse())


class _Parser:
    """Kubernetes' ``Parser``: recursive descent over the tokens; errors name term and column."""

    def __init__(self, text: str) -> None:
        self._text = text
        self._tokens = _lex(text)
        self._next = 0
        self._term = 0  # the token the current requirement starts at

    def parse(self) -> list[_Requirement]:
        requirements: list[_Requirement] = []
        if self._peek().kind == _END:
            return requirements
        while True:
            self._term = self._next
            requirements.append(self._requirement())
            token = self._take()
            if token.kind == _END:
                return requirements
            if token.kind != ",":
                raise self._error(token, "expected ',' or the end")

    def _requirement(self) -> _Requirement:
        token = self._take()
        absent = token.kind == _ABSENT
        if absent:
            token = self._take()
        if token.kind != _WORD:
            raise self._error(
                token, "expected a label key" if absent else "expected a label key or '!'"
            )
        key = self._key(token)
        after = self._peek()
        if after.kind in (",", _END):
            return _Requirement(key, _ABSENT if absent else _EXISTS, ())
        if absent:
            raise self._error(after, "expected ',' or the end ('!key' takes no value)")
        operator = self._take()
        if operator.kind == _WORD and operator.text in (_IN, _NOT_IN):
            return _Requirement(key, operator.text, self._value_set())
        if operator.kind in ("=", "==", "!="):
            return _Requirement(key, "!=" if operator.kind == "!=" else "=", (self._value(),))
        if operator.kind in ("<", ">"):
            raise self._error(
                operator,
                f"{operator.text!r} is not supported (Kubernetes' numeric Gt and Lt): "
                "use in, notin, =, == or !=",
                found=False,
            )
        raise self._error(operator, "expected an operator: in, notin, =, == or !=")

    def _value(self) -> str:
        """The value of ``=``, ``==`` or ``!=``; nothing there is the empty value."""
        if self._peek().kind in (",", _END):
            return ""
        token = self._take()
        if token.kind != _WORD:
            raise self._error(token, "expected a value")
        return self._checked_value(token)

    def _value_set(self) -> tuple[str, ...]:
        """``( v, ... )``: a place left empty (``(a,)``, ``()``) is the empty value."""
        token = self._take()
        if token.kind != "(":
            raise self._error(token, "expected '(' and the values")
        values: set[str] = set()
        want_value = True
        while True:
            token = self._take()
            if token.kind == _WORD and want_value:
                values.add(self._checked_value(token))
                want_value = False
            elif token.kind in (",", ")"):
                if want_value:
                    values.add("")
                if token.kind == ")":
                    return tuple(sorted(values))
                want_value = True
            else:
                raise self._error(
                    token, "expected a value, ',' or ')'" if want_value else "expected ',' or ')'"
                )

    def _key(self, token: _Token) -> str:
        if not _LABEL_KEY.fullmatch(token.text):
            raise self._error(
                token, f"label key {token.text!r} is not allowed: {_KEY_RULE}", found=False
            )
        return token.text

    def _checked_value(self, token: _Token) -> str:
        if _bad_value(token.text):
            raise self._error(
                token,
                f"label value {token.text!r} must be printable and at most "
                f"{_MAX_LABEL_VALUE} characters",
                found=False,
            )
        return token.text

    def _peek(self) -> _Token:
        return self._tokens[self._next]

    def _take(self) -> _Token:
        token = self._tokens[self._next]
        self._next = min(self._next + 1, len(self._tokens) - 1)  # the end stays the end
        return token

    def _error(self, token: _Token, problem: str, *, found: bool = True) -> InvalidSelectorError:
        if found:
            what = "the end" if token.kind == _END else repr(token.text)
            problem = f"found {what}, {problem}"
        return InvalidSelectorError(self._text, token.at + 1, self._term_text(token), problem)

    def _term_text(self, failing: _Token) -> str:
        """The requirement ``failing`` is in: up to the next top-level ',' or the end."""
        start = self._tokens[self._term].at
        depth = 0
        for token in self._tokens[self._term :]:
            if token.kind == "(":
                depth += 1
            elif token.kind == ")":
                depth = max(0, depth - 1)
            elif token.kind == _END or (token.kind == "," and not depth and token.at >= failing.at):
                return self._text[start : token.at].strip()
        raise AssertionError("the tokens end with the end")
