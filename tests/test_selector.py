"""Label selectors (issue 33): Kubernetes' syntax and meaning, and the refusals.

The cases are Kubernetes' own where it has one (k8s.io/apimachinery pkg/labels
selector_test.go at eed236ce: TestSelectorParse, TestSelectorMatches,
TestRequirementSelectorMatching, TestSetSelectorParser), with the results it documents.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Mapping

import pytest

from discovery import (
    EngineRecord,
    InvalidRecordError,
    InvalidSelectorError,
    Selector,
)
from discovery._records.selector import selector_of

from .helpers import make_endpoint

# (selector, labels, matches)
MATCHES = [
    # the empty selector selects everything
    ("", {}, True),
    ("", {"x": "y"}, True),
    # equality: the label is there, with that value
    ("x=y", {"x": "y"}, True),
    ("x==y", {"x": "y"}, True),
    ("x=y", {"x": "z"}, False),
    ("x=z", {}, False),
    ("x=y,z=w", {"x": "y", "z": "w"}, True),
    ("x=y,z=w", {"x": "w", "z": "w"}, False),
    ("foo=bar,foobar=bar,baz=blah", {"foo": "bar", "baz": "blah"}, False),
    ("notin=in", {"notin": "in"}, True),
    # inequality: another value, or no such label
    ("x!=y", {"x": "z"}, True),
    ("x!=y", {"x": "y"}, False),
    ("x!=y", {}, True),
    ("x!=y,z!=w", {"x": "z", "z": "a"}, True),
    ("x!=y,z!=w", {"x": "z", "z": "w"}, False),
    # in: the label is there, with one of the values
    ("x in (a,b)", {"x": "b"}, True),
    ("x in (a,b)", {"x": "c"}, False),
    ("x in (a,b)", {}, False),
    ("x in (foo),y notin (alpha)", {"x": "foo", "y": "baz"}, True),
    ("x in (foo),y in (alpha)", {"x": "foo", "y": "baz"}, False),
    ("x,y in (a)", {"x": "1", "y": "b"}, False),
    # notin: none of the values, or no such label
    ("x notin (a,b)", {"x": "c"}, True),
    ("x notin (a,b)", {"x": "a"}, False),
    ("x notin (a,b)", {}, True),
    # exists and does not exist: a label with the empty value is there
    ("x", {"x": "z"}, True),
    ("x", {"x": ""}, True),
    ("x", {"y": "z"}, False),
    ("!x", {"y": "z"}, True),
    ("!x", {"x": ""}, False),
    ("!x,y", {"y": ""}, True),
    # empty values
    ("x=", {"x": ""}, True),
    ("x=", {"x": "a"}, False),
    ("x=", {}, False),
    ("x!=", {}, True),
    ("x!=", {"x": ""}, False),
    ("x in ()", {"x": ""}, True),
    ("x in ()", {"y": "baz"}, False),
    ("x in (a,)", {"x": ""}, True),
    ("x notin (),y", {"y": ""}, True),
    ("x notin (),!y", {"y": ""}, False),
    # whitespace separates words, nothing more
    ("  env  in\t( prod ,dev )\n, tier ", {"env": "dev", "tier": "web"}, True),
    ("  env  in\t( prod ,dev )\n, tier ", {"env": "dev"}, False),
    ("! canary , zone != b", {"zone": "a"}, True),
]


@pytest.mark.parametrize(("text", "labels", "expected"), MATCHES, ids=repr)
def test_each_form_matches_as_kubernetes_does(
    text: str, labels: Mapping[str, str], expected: bool
) -> None:
    selector = Selector.parse(text)
    assert selector.matches(labels) is expected
    assert (selector.unmet(labels) is None) is expected
    record = EngineRecord(engine_id="e", endpoint=make_endpoint(), labels=labels)
    assert record.matches(text) is expected  # the text, the object: one meaning
    assert record.matches(selector) is expected


# (text, canonical text): requirements sorted by key, values sorted and once, '==' as '='
PARSES = [
    ("", ""),
    (" \t\r\n", ""),
    ("x=a,y=b,z=c", "x=a,y=b,z=c"),
    ("z=c,x=a,y=b", "x=a,y=b,z=c"),
    ("x!=a,y=b", "x!=a,y=b"),
    ("x==a", "x=a"),
    ("x=", "x="),
    ("x= ", "x="),
    ("x=,z= ", "x=,z="),
    ("x= ,z= ", "x=,z="),
    ("!x", "!x"),
    ("\rx", "x"),
    ("a ", "a"),
    ("this-is-a-dns.domain.com/key-with-dash", "this-is-a-dns.domain.com/key-with-dash"),
    (
        "0.1.2.domain/99 notin (10.10.100.1, tick.tack.clock)",
        "0.1.2.domain/99 notin (10.10.100.1,tick.tack.clock)",
    ),
    ("foo  in\t (abc)", "foo in (abc)"),
    ("x notin\n (abc)", "x notin (abc)"),
    ("x  notin\t\t(abc,def)", "x notin (abc,def)"),
    ("x in (abc,abc)", "x in (abc)"),
    ("x in (abc,)", "x in (,abc)"),
    ("x in ()", "x in ()"),
    ("x notin ( )", "x notin ()"),
    ("x notin (, a)", "x notin (,a)"),
    ("x in (a,,)", "x in (,a)"),
    ("x in (a,,,,,,)", "x in (,a)"),
    ("x in (a,,a,,a,,a,,)", "x in (,a)"),
    ("x notin (abc,,def),bar,z in (),w", "bar,w,x notin (,abc,def),z in ()"),
    ("a in (x,y,notin, z,in)", "a in (in,notin,x,y,z)"),
    ("in in (notin),notin", "in in (notin),notin"),
    ("a=b,a==b", "a=b"),
    ("zone=ünï", "zone=ünï"),  # our label values: any printable character
]


@pytest.mark.parametrize(("text", "canonical"), PARSES, ids=repr)
def test_every_form_parses_to_its_canonical_text(text: str, canonical: str) -> None:
    selector = Selector.parse(text)
    assert str(selector) == canonical
    assert Selector.parse(canonical) == selector  # the text gives the selector back
    assert hash(Selector.parse(canonical)) == hash(selector)
    assert eval(repr(selector), {"Selector": Selector}) == selector


# (text, the whole message): the column and, when the selector has several, the term
MALFORMED = [
    ("x=a||y=b", "column 7: found '=', expected ',' or the end"),
    ("x==a==b", "column 5: found '==', expected ',' or the end"),
    ("!x=a", "column 3: found '=', expected ',' or the end ('!key' takes no value)"),
    (
        "x<a",
        "column 2: '<' is not supported (Kubernetes' numeric Gt and Lt): "
        "use in, notin, =, == or !=",
    ),
    (
        "x>1",
        "column 2: '>' is not supported (Kubernetes' numeric Gt and Lt): "
        "use in, notin, =, == or !=",
    ),
    ("x,,y", "column 3: found ',', expected a label key or '!'"),
    (",x,y", "column 1: found ',', expected a label key or '!'"),
    ("a in (xyz),", "column 12: found the end, expected a label key or '!'"),
    ("x nott in (y)", "column 3: found 'nott', expected an operator: in, notin, =, == or !="),
    ("a in (xyz)b notin ()", "column 11: found 'b', expected ',' or the end"),
    ("a in (xyz abc)", "column 11: found 'abc', expected ',' or ')'"),
    ("a notin(", "column 9: found the end, expected a value, ',' or ')'"),
    ("a (", "column 3: found '(', expected an operator: in, notin, =, == or !="),
    ("(", "column 1: found '(', expected a label key or '!'"),
    ("a in b", "column 6: found 'b', expected '(' and the values"),
    ("a in (b", "column 8: found the end, expected ',' or ')'"),
    ("x in (a,=)", "column 9: found '=', expected a value, ',' or ')'"),
    ("x=(a)", "column 3: found '(', expected a value"),
    ("x!=!", "column 4: found '!', expected a value"),
    ("!", "column 2: found the end, expected a label key"),
    ("!!x", "column 2: found '!', expected a label key"),
    ("!=x", "column 1: found '!=', expected a label key or '!'"),
    (
        "tier notin (x),env in (a b),gpu",
        "column 26 (term 'env in (a b)'): found 'b', expected ',' or ')'",
    ),
    ("gpu,!=x", "column 5 (term '!=x'): found '!=', expected a label key or '!'"),
    (
        "a*=1",
        "column 1: label key 'a*' is not allowed: use 1-63 letters, digits, '.', '_', '/' or '-'",
    ),
    (
        "gpu,model=m,k" + "x" * 63,
        f"column 13 (term 'k{'x' * 63}'): label key 'k{'x' * 63}' is not allowed: use 1-63 "
        "letters, digits, '.', '_', '/' or '-'",
    ),
    ("k=v\x0b", "column 3: label value 'v\\x0b' must be printable and at most 256 characters"),
    (
        "k in (a,\x00)",
        "column 9: label value '\\x00' must be printable and at most 256 characters",
    ),
]


@pytest.mark.parametrize(("text", "message"), MALFORMED, ids=repr)
def test_each_malformed_selector_is_refused_naming_the_term_and_column(
    text: str, message: str
) -> None:
    with pytest.raises(InvalidSelectorError) as error:
        Selector.parse(text)
    assert str(error.value) == f"invalid selector {text!r}, {message}"
    assert isinstance(error.value, InvalidRecordError) and isinstance(error.value, ValueError)
    assert error.value.selector == text
    assert message.startswith(f"column {error.value.column}")
    assert str(error.value).endswith(error.value.problem)


def test_an_over_long_value_is_refused() -> None:
    with pytest.raises(InvalidSelectorError, match="at most 256 characters") as error:
        Selector.parse("a=1,k=" + "v" * 257)
    assert (error.value.column, error.value.term) == (7, "k=" + "v" * 257)
    assert Selector.parse("k=" + "v" * 256).matches({"k": "v" * 256})


def test_a_selector_keys_a_dict_and_compares_by_meaning() -> None:
    split = {Selector.parse("track=stable"): 95, Selector.parse("track==canary"): 5}
    assert split[Selector.parse(" track = canary ")] == 5
    assert Selector.parse("b=1,a in (y,x)") == Selector.parse("a in (x,y,x),b==1")
    assert Selector.parse("a in (x)") != Selector.parse("a=x")  # as Kubernetes keeps them
    assert Selector() == Selector.parse("") == selector_of(None) == selector_of({})
    assert not Selector() and Selector.parse("a")
    assert Selector.parse("x=y") is Selector.parse("x=y")  # parsed once
    with pytest.raises(AttributeError, match="immutable"):
        Selector.parse("x=y")._text = "z"  # type: ignore[misc]
    spaced = selector_of({"k": "a b"})  # its text would not parse: copied all the same
    for selector in (Selector.parse("a in (x,y),!b"), spaced, Selector()):
        assert pickle.loads(pickle.dumps(selector)) == selector == copy.deepcopy(selector)


def test_requirements_combine_and_the_unmet_one_is_named() -> None:
    both = Selector.parse("env in (a,b)") & Selector.parse("!canary")
    assert both == Selector.parse("!canary,env in (a,b)") and str(both) == "!canary,env in (a,b)"
    assert both.unmet({"env": "a", "canary": ""}) == "!canary"
    assert both.unmet({"env": "c"}) == "env in (a,b)"
    assert both.unmet({"env": "b"}) is None
    with pytest.raises(TypeError):
        both & "gpu"  # type: ignore[operator]


def test_a_mapping_is_its_equalities_checked_as_labels() -> None:
    selector = selector_of({"zone": "z", "model": "m"})
    assert selector == Selector.parse("model=m,zone=z")
    # A value the text cannot spell (a space) is still selected through a mapping.
    spaced = selector_of({"model": "llama 70b"})
    assert spaced.matches({"model": "llama 70b"}) and not spaced.matches({"model": "llama"})
    assert str(spaced) == "model=llama 70b"
    with pytest.raises(InvalidRecordError, match="label key 'a b' is not allowed"):
        selector_of({"a b": "v"})
    with pytest.raises(InvalidRecordError, match="label 'k' must be a string, not int"):
        selector_of({"k": 1})  # type: ignore[dict-item]
    with pytest.raises(InvalidRecordError, match="not int"):
        selector_of(42)  # type: ignore[arg-type]
    with pytest.raises(InvalidRecordError, match="text must be a string, not bytes"):
        Selector.parse(b"x=y")  # type: ignore[arg-type]
