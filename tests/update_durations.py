"""Writes tests/durations.json (seconds per test file) from the output of a full run with `--durations=0`, both
tiers (a file's seconds are summed over every log given; a log of one tier alone would drop the other tier's files,
which then run last):

  python -m pytest -n 2 --dist loadfile --durations=0 -q -m "not slow" | tee /tmp/fast.log
  python -m pytest -n 2 --dist loadfile --durations=0 -q -m slow | tee /tmp/slow.log
  python tests/update_durations.py /tmp/fast.log /tmp/slow.log

tests/conftest.py starts the longest files first, so that under `-n 2 --dist loadfile` a long file does not run
alone at the end while the other worker idles. Files missing from durations.json run after the known ones.
"""

import collections
import json
import pathlib
import re
import sys


def main(log_paths):
  per_file = collections.Counter()
  for log_path in log_paths:
    found = 0
    for line in open(log_path):
      m = re.match(r"([\d.]+)s (?:call|setup|teardown)\s+(\S+)", line)
      if m:
        per_file[m.group(2).split("::")[0]] += float(m.group(1))
        found += 1
    if not found:
      sys.exit(f"{log_path}: no '--durations=0' lines found; run pytest with --durations=0")
  out = pathlib.Path(__file__).with_name("durations.json")
  out.write_text(json.dumps({f: round(t, 1) for f, t in sorted(per_file.items())}, indent=1) + "\n")
  print(f"wrote {out}: {len(per_file)} files, {sum(per_file.values()):.0f} test-seconds")


if __name__ == "__main__":
  if len(sys.argv) < 2:
    sys.exit(__doc__)
  main(sys.argv[1:])
