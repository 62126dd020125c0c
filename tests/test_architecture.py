"""The import directions of docs/architecture.md, read from the source (every import, lazy ones included)."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "aepo_jax"

ALLOWED = {  # docs/architecture.md's table
  "parallel": set(),
  "model": {"parallel"},
  "objectives": set(),
  "tools": set(),
  "rewards": {"tools"},
  "data": set(),
  "rollout": {"model", "parallel", "tools", "objectives"},
  "serve": {"model", "rollout"},
  "checkpoint": {"model", "parallel"},
  "eval": {"model", "rollout", "tools", "rewards", "data", "checkpoint"},
  "train": {"parallel", "model", "objectives", "tools", "rewards", "data", "rollout", "serve", "checkpoint", "eval"},
  "viz": {"objectives"},
  "logs": set(),
  "testing": {"model", "tools"},
}
LAZY_ONLY = {("train", "eval"), ("train", "serve")}  # never at module level
NO_JAX = ("tools", "rewards", "data")


def _imports():
  """(part, file, imported top-level name or aepo_jax part, at module level?) for every import statement."""
  for path in sorted(ROOT.rglob("*.py")):
    part = path.relative_to(ROOT).parts[0].removesuffix(".py")
    tree = ast.parse(path.read_text())
    top_level = {id(n) for n in tree.body}
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        names = [a.name.split(".") for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        mod = node.module.split(".")
        names = [mod + [a.name] for a in node.names] if mod == ["aepo_jax"] else [mod]
      else:
        continue
      for name in names:
        target = name[1] if name[0] == "aepo_jax" and len(name) > 1 else name[0]
        yield part, path.relative_to(ROOT.parent), target, id(node) in top_level, name[0] == "aepo_jax"


def test_parts_import_only_what_the_table_allows():
  bad = []
  for part, path, target, module_level, internal in _imports():
    if not internal or target == part:
      continue
    if target not in ALLOWED.get(part, set()):
      bad.append(f"{path}: {part} -> {target}")
    elif (part, target) in LAZY_ONLY and module_level:
      bad.append(f"{path}: {part} -> {target} at module level (allowed only inside functions)")
  assert not bad, "imports against docs/architecture.md:\n" + "\n".join(bad)


def test_worker_parts_never_import_jax_and_the_core_never_imports_torch_or_jetstream():
  bad = []
  for part, path, target, module_level, internal in _imports():
    if internal:
      continue
    if part in NO_JAX and target in ("jax", "jaxlib", "flax", "optax"):
      bad.append(f"{path}: {part} imports {target}")
    if target in ("torch", "jetstream") and (module_level or part not in ("rollout", "testing")):
      bad.append(f"{path}: imports {target} {'at module level' if module_level else 'outside the adapter'}")
  assert not bad, "\n".join(bad)


def test_the_table_is_the_documented_one():
  doc = (ROOT.parent / "docs" / "architecture.md").read_text()
  for part, allowed in ALLOWED.items():
    if part == "testing":
      continue
    row = next(line for line in doc.splitlines() if line.startswith(f"| `{part}"))
    cell = row.rstrip(" |").rsplit("|", 1)[-1]
    listed = {w.strip("` ,") for w in cell.replace("(", " ").split() if w.strip("` ,") in ALLOWED}
    assert listed == allowed or part == "train", (part, listed, allowed)
