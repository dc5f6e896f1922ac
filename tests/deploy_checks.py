"""Checks of deploy/ shared by the offline tests (test_deploy.py) and the Docker ones."""

from __future__ import annotations

import subprocess
from collections.abc import Callable

PREFIX = "/inference/v1/{ns}/engines/"

# etcdctl as one user: run(user, *args); the caller supplies password, certificates, endpoints.
Etcdctl = Callable[..., subprocess.CompletedProcess[str]]


def denied(result: subprocess.CompletedProcess[str]) -> bool:
    """Whether etcd refused the command for lack of permission."""
    return result.returncode != 0 and "permission denied" in result.stderr


def roles_let_through(run: Etcdctl, ns: str, other_ns: str, lease: str) -> list[str]:
    """What the security model (docs/operations/tls-and-roles.md) forbids, yet etcd allowed.

    ``ns``'s engine and router users try: another namespace's records, keys outside their
    prefix, writes, deletes and lease revokes as the router, and changes to roles, users
    and auth. ``lease`` is a lease of an engine of ``ns``. Empty when all were refused.
    """
    key = PREFIX.format(ns=ns) + "engine-1"
    other = PREFIX.format(ns=other_ns) + "engine-1"
    engine, router = f"engine-{ns}", f"router-{ns}"
    attempts = [
        (engine, ("put", other, "v")),
        (engine, ("get", other)),
        (engine, ("put", f"/inference/v1/{ns}/other", "v")),
        (engine, ("put", "/elsewhere", "v")),
        (router, ("put", key, "forged")),
        (router, ("del", key)),
        (router, ("lease", "revoke", lease)),
        (router, ("get", other)),
    ]
    widen = ("role", "grant-permission", f"discovery-engine-{ns}", "readwrite", "/", "--prefix")
    for user in (engine, router):
        attempts += [
            (user, widen),
            (user, ("user", "grant-role", user, "root")),
            (user, ("user", "add", "intruder:pw")),
            (user, ("auth", "disable")),
        ]
    allowed = []
    for user, args in attempts:
        result = run(user, *args)
        if not denied(result):
            allowed.append(f"{user}: etcdctl {' '.join(args)}: {result.stdout}{result.stderr}")
    return allowed
