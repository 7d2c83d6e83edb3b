"""The docs cannot fall behind the code: every user-facing error message is in docs/troubleshooting.md,
and every relative link of README.md and docs/*.md points at a file that exists.

Messages are found with ast in trinity/: the first argument of `UserError(...)`, of
`problems.append(...)` (config rules and loader) and of `record.error(...)` / `self.error(...)` (data
records, which wrap a UserError naming file and line). Of each message the fixed text is kept: a string
constant, or the constant parts of an f-string / `+` concatenation; the longest part of at least
MIN_FRAGMENT characters (whitespace collapsed) must appear in the doc. Shorter parts are placeholders
around a message built elsewhere (`f"{flag}: {exc}"`), which is checked where it is built.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "trinity"
TROUBLESHOOTING = REPO / "docs" / "troubleshooting.md"
MIN_FRAGMENT = 15
ERROR_METHOD_OWNERS = {"record", "self"}


def _squash(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _fragments(node: ast.expr) -> list[str] | None:
    """Constant text parts of a message expression; None when it is not built from literals."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _fragments(node.left), _fragments(node.right)
        return None if left is None or right is None else left + right
    return None


def _is_message_call(call: ast.Call) -> bool:
    f = call.func
    if isinstance(f, ast.Name):
        return f.id == "UserError"
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
        if f.attr == "append":
            return f.value.id == "problems"
        if f.attr == "error":
            return f.value.id in ERROR_METHOD_OWNERS
    return False


def error_messages() -> list[tuple[str, str]]:
    """(file:line, fixed text) of every user-facing message in the package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and _is_message_call(node) and node.args):
                continue
            parts = _fragments(node.args[0])
            if not parts:
                continue
            longest = max((_squash(p) for p in parts), key=len)
            if len(longest.strip()) >= MIN_FRAGMENT:
                found.append((f"{path.relative_to(REPO)}:{node.lineno}", longest))
    return found


def test_extraction_finds_the_known_messages():
    texts = [text for _, text in error_messages()]
    assert len(texts) > 100
    assert ": must look like dotted.key=value" in texts
    assert "data.train_files: no training files given" in texts
    assert "data.train_files: SFT needs at least one training file" in texts


def test_every_error_message_is_in_troubleshooting():
    doc = _squash(TROUBLESHOOTING.read_text(encoding="utf-8"))
    missing = [f"{where}: {text!r}" for where, text in error_messages() if text not in doc]
    assert not missing, "docs/troubleshooting.md lacks these messages (add them with what they mean and the fix):\n" + "\n".join(missing)


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def relative_links(md: Path) -> list[str]:
    text = CODE.sub("", md.read_text(encoding="utf-8"))
    links = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http(s), mailto, in-page anchors
        links.append(target)
    return links


def test_relative_links_point_to_existing_files():
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    broken = []
    checked = 0
    for md in docs:
        for target in relative_links(md):
            checked += 1
            path = (md.parent / target.split("#", 1)[0]).resolve()
            if not path.exists():
                broken.append(f"{md.relative_to(REPO)}: {target}")
    assert checked > 10
    assert not broken, "broken relative links:\n" + "\n".join(broken)


def test_every_doc_is_linked_from_readme():
    readme = REPO / "README.md"
    linked = {(readme.parent / t.split("#", 1)[0]).resolve() for t in relative_links(readme)}
    docs = sorted((REPO / "docs").glob("*.md"))
    assert len(docs) >= 12
    unlinked = [str(d.relative_to(REPO)) for d in docs if d.resolve() not in linked]
    assert not unlinked, "README.md does not link these docs (add them to its Documentation list):\n" + "\n".join(unlinked)
