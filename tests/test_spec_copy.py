"""docs/spec.md is the specification every "spec §x" in the code cites; it must be the project's shared copy, and
every § it is cited with must exist in it."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(ROOT, "..", "shared", "docs", "algorithms.md")


def _spec():
  with open(os.path.join(ROOT, "docs", "spec.md")) as f:
    text = f.read()
  return text.split("\n", 2)[2]  # after the provenance comment and its blank line


def test_spec_is_the_shared_copy():
  if not os.path.exists(SHARED):  # a clone outside the workspace has only the copy
    return
  with open(SHARED) as f:
    assert _spec() == f.read(), "docs/spec.md differs from ../shared/docs/algorithms.md: copy it again"


def test_every_cited_section_exists():
  headings = set(re.findall(r"^#+\s*(\d+(?:\.\d+)*)\.?\s", _spec(), flags=re.M))
  cited = set()
  for folder in ("aepo_jax", "configs", "docs", "launch"):
    for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
      for name in files:
        if name.endswith((".py", ".md")) and name != "spec.md":
          with open(os.path.join(dirpath, name), errors="replace") as f:
            cited.update(re.findall(r"spec §(\d+(?:\.\d+)*)", f.read()))
  missing = sorted(c for c in cited if c not in headings and c.split(".")[0] not in headings)
  assert not missing, f"spec sections cited but not in docs/spec.md: {missing}"
