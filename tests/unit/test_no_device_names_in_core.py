"""Core never asks what a device *is* (issue #19): no comparison with a device-type name
(``platform.device_type == "cpu"``, ``device.type == "cuda"``, ``x in ("xpu", "hpu")``), no
table keyed by device names, and no ``torch.cuda`` anywhere in core/ outside the platform
contract's own definitions (core/platform.py, whose defaults such as
``Platform.shares_host_memory`` are where such a question is answered once).

Core asks through capabilities and small platform methods instead (``pin_host_memory``,
``shares_host_memory``, ``ray_resource``). The allow-list below holds the sites that exist
today in files this change could not edit; each names the fix it needs. Removing a site
from core makes its entry stale, which fails too: the list can only shrink.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "core"

DEVICE_NAMES = frozenset({"cpu", "cuda", "xpu", "hpu", "xla", "tpu", "rocm", "hip", "mps", "npu"})
"""torch device types and platform names of devices (lower case, as torch spells them; the
Ray resource names "CPU"/"GPU" are not device types)."""

CONTRACT = {"platform.py"}
"""Files (relative to core/) that define the contract and may name the host device."""

ALLOWED = Counter({
    # (file relative to core/, the offending expression as ast.unparse writes it): count.
    # The conformance suite's contract facts, not device questions: host (swap) caches live
    # on the cpu device by contract (checks_blocks.py:119), and the CPU platform is the
    # reference the others are compared with (checks_e2e.py:71).
    ("conformance/checks_blocks.py", "host.device.type == 'cpu'"): 1,
    ("conformance/checks_e2e.py", "core_platform.name == 'cpu'"): 1,
})


def _names(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in DEVICE_NAMES:
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [n for e in node.elts for n in _names(e)]
    return []


def _is_device_question(node: ast.AST) -> bool:
    if isinstance(node, ast.Compare):
        return any(_names(x) for x in (node.left, *node.comparators))
    if isinstance(node, ast.Dict):  # a lookup table keyed by device names
        return sum(1 for k in node.keys if k is not None and _names(k)) >= 2
    if isinstance(node, ast.Attribute):  # torch.cuda.<anything>
        return node.attr == "cuda" and isinstance(node.value, ast.Name) and node.value.id == "torch"
    return False


def device_questions(root: Path) -> list[tuple[str, int, str]]:
    """(file relative to root, line, expression) of every device question under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in CONTRACT:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if _is_device_question(node):
                found.append((rel, node.lineno, ast.unparse(node)))
    return found


def test_the_scanner_finds_each_kind_of_device_question(tmp_path):
    (tmp_path / "a.py").write_text(
        "import torch\n"
        "def f(p, d):\n"
        "    if p.device_type == 'cuda' or d.type in ('xpu', 'hpu'):\n"
        "        torch.cuda.synchronize()\n"
        "    return {'cpu': 1, 'xla': 2}, p.name == 'acme', 'cpu' + 'x'\n"
    )
    got = sorted((line, expr) for _, line, expr in device_questions(tmp_path))
    assert [line for line, _ in got] == [3, 3, 4, 5], got
    assert ("d.type in ('xpu', 'hpu')") in {e for _, e in got}


def test_no_new_device_name_comparisons_in_core():
    found = Counter((rel, expr) for rel, _, expr in device_questions(CORE))
    where = {(rel, expr): line for rel, line, expr in device_questions(CORE)}
    new = {k: n for k, n in found.items() if n > ALLOWED.get(k, 0)}
    assert not new, (
        "core/ asks what a device is (ask a capability or a Platform method instead, see "
        "docs/plugins.md): " + "; ".join(f"core/{f}:{where[(f, e)]}: {e}" for f, e in new)
    )
    stale = {k: n for k, n in ALLOWED.items() if found.get(k, 0) < n}
    assert not stale, f"fixed sites still allow-listed (remove them from ALLOWED): {sorted(stale)}"
