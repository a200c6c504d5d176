"""One reason-error base: every exception carrying a snake_case ``reason`` derives from
``mst.errors.ReasonError`` instead of repeating its ``__init__``."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import pytest

from mst.errors import ReasonError

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["mst", "firehose", "backfill", "relay", "spark"]
#: Files exempt from the check (none).
NOT_YET: set[str] = set()


def _base_name(node: ast.expr) -> str:
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def _is_builtin_exception(name: str) -> bool:
    obj = getattr(builtins, name, None)
    return isinstance(obj, type) and issubclass(obj, BaseException)


def reason_init_copies() -> list[str]:
    """``file:line Class`` for every exception class whose own method assigns ``self.reason``
    (the duplicated ``__init__``), outside ``ReasonError`` itself."""
    classes: list[tuple[str, ast.ClassDef]] = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel not in NOT_YET:
                tree = ast.parse(path.read_text(), filename=rel)
                classes += [(rel, node) for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    exceptions = {"ReasonError"}
    grew = True
    while grew:  # exception classes: a builtin exception or one of these among the bases
        before = len(exceptions)
        exceptions |= {node.name for _, node in classes
                       if any(_is_builtin_exception(b) or b in exceptions for b in map(_base_name, node.bases))}
        grew = len(exceptions) > before
    found = []
    for rel, node in classes:
        if node.name not in exceptions or (rel, node.name) == ("mst/errors.py", "ReasonError"):
            continue
        for sub in ast.walk(node):
            if (isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) and sub.attr == "reason"
                    and isinstance(sub.value, ast.Name) and sub.value.id == "self"):
                found.append(f"{rel}:{sub.lineno} {node.name}")
    return found


def test_no_copies_of_the_reason_init() -> None:
    assert reason_init_copies() == []


def test_str_forms() -> None:
    class Plain(ReasonError):
        pass

    class Sentence(ReasonError):
        show_reason = False

    assert str(Plain("bad_thing")) == "bad_thing" and str(Plain("bad_thing", "details")) == "bad_thing: details"
    assert str(Sentence("bad_thing")) == "bad_thing" and str(Sentence("bad_thing", "details")) == "details"
    err = Plain("bad_thing", "details")
    assert (err.reason, err.message) == ("bad_thing", "details")


@pytest.mark.parametrize("module,name", [
    ("mst.errors", "RepoError"), ("firehose.framing", "FramingError"), ("firehose.frames", "FrameError"),
    ("firehose.messages", "MessageError"), ("firehose.subscriber", "_Reset"),
    ("backfill.errors", "BackfillError"), ("relay.config", "ConfigError"), ("relay.ssrf", "SSRFError"),
    ("relay.hosts", "CrawlRefused"), ("relay.identity", "IdentityError"), ("spark.repo_check", "CheckError"),
    ("spark.ssrf", "SsrfError"), ("spark.identity", "IdentityError"), ("spark.fetch", "FetchError"),
])
def test_reason_errors_share_the_base(module: str, name: str) -> None:
    cls = getattr(__import__(module, fromlist=[name]), name)
    assert issubclass(cls, ReasonError)


def test_enum_reasons_become_plain_strings() -> None:
    from firehose.frames import FrameError
    from firehose.reasons import Reason

    err = FrameError(Reason.FRAME_TOO_LARGE, "6 MB")
    assert type(err.reason) is str and err.reason == "frame_too_large" and str(err) == "frame_too_large: 6 MB"


def test_backfill_errors_keep_their_signature() -> None:
    from backfill.errors import BackfillError, MigrationError

    assert (MigrationError().reason, str(MigrationError())) == ("migration_failed", "migration_failed")
    err = BackfillError("went wrong", reason="custom")
    assert (err.reason, err.message, str(err)) == ("custom", "went wrong", "went wrong")
