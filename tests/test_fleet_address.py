"""The fleet string (issue 42): one string naming a fleet, and a clear error for a bad one."""

from __future__ import annotations

import pytest

from discovery import ConfigurationError, RoutingPolicy, Selector, Settings, parse_fleet


def test_a_fleet_string_names_endpoints_namespace_selector_and_options() -> None:
    address = parse_fleet(
        "etcd://10.0.0.5:2379,10.0.0.6:2379/prod?selector=model%3Dllama,zone+in+(a,b)"
        "&selector=!canary&policy=longest_prefix&hold=30&connect_timeout=2.5"
    )
    assert address.endpoints == ("http://10.0.0.5:2379", "http://10.0.0.6:2379")
    assert address.namespace == "prod"
    expected = Selector.parse("model=llama,zone in (a,b)") & Selector.parse("!canary")
    assert address.selector == expected
    assert address.policy is RoutingPolicy.LONGEST_PREFIX
    assert (address.hold, address.connect_timeout) == (30.0, 2.5)
    settings = address.settings(Settings(endpoints=["localhost:1"], namespace="other"))
    assert settings.endpoints == ("http://10.0.0.5:2379", "http://10.0.0.6:2379")
    assert settings.namespace == "prod"


def test_etcds_is_tls_and_no_hosts_or_namespace_leaves_them_to_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert parse_fleet("etcds://etcd.internal:2379/").endpoints == ("https://etcd.internal:2379",)
    monkeypatch.setenv("DISCOVERY_ETCD_ENDPOINTS", "http://127.0.0.9:2379")
    monkeypatch.setenv("DISCOVERY_NAMESPACE", "from-env")
    address = parse_fleet("etcd:///")
    assert (address.endpoints, address.namespace, address.selector) == (None, None, None)
    settings = address.settings()
    assert settings.endpoints == ("http://127.0.0.9:2379",)
    assert settings.namespace == "from-env"


@pytest.mark.parametrize(
    ("fleet", "problem"),
    [
        ("tcp://10.0.0.5:5555", r"the scheme must be etcd:// or etcds://, not 'tcp'"),
        ("10.0.0.5:2379", r"the scheme must be etcd:// or etcds://"),
        ("etcd://10.0.0.5/prod", r"'10\.0\.0\.5' is not HOST:PORT"),
        ("etcd://10.0.0.5:99999/prod", r"is not HOST:PORT"),
        ("etcd://a:1,,b:2/prod", r"'' is not HOST:PORT"),
        ("etcd://root:secret@10.0.0.5:2379/prod", r"credentials do not go in the fleet string"),
        ("etcd://h:1/a/b", r"the namespace 'a/b' has a '/'"),
        ("etcd://h:1/p?model=llama", r"unknown option model \(known: selector, policy"),
        ("etcd://h:1/p?policy=fastest", r"unknown policy 'fastest' \(known: round_robin"),
        ("etcd://h:1/p?selector=model%3D%3D%3D", r"selector 'model==='"),
        ("etcd://h:1/p?hold=soon", r"hold='soon' is not a number of seconds"),
        ("etcd://h:1/p?hold=-1", r"hold='-1' must be 0 or more seconds"),
        ("etcd://h:1/p?connect_timeout=0", r"connect_timeout='0' must be more than 0"),
        ("etcd://h:1/p?hold=1&hold=2", r"hold is given 2 times"),
        ("etcd://h:1/p#x", r"a fragment"),
    ],
)
def test_a_bad_fleet_string_is_refused_naming_the_problem(fleet: str, problem: str) -> None:
    with pytest.raises(ConfigurationError, match=problem) as raised:
        parse_fleet(fleet)
    assert "secret" not in str(raised.value)  # never a password in a message
    assert "etcd[s]://HOST:PORT" in str(raised.value)  # and the form expected
