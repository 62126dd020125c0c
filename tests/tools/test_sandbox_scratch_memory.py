"""The scratch tmpfs mounts of one sandboxed call (/tmp, /dev/shm, /var/tmp, /run/lock) hold at most the call's
tmpfs_mb together: their pages are host memory outside the call's memory limit, so tmpfs_mb each would let one call
hold several times its budget."""

import pytest

from aepo_jax.tools import _isolation, run_python

# Fills every scratch dir with 1 MiB files until it refuses, then prints the bytes written in each.
FILL = """
import os
total = {}
for d in ('/tmp', '/dev/shm', '/var/tmp', '/run/lock'):
    n = 0
    try:
        for i in range(100000):
            with open(os.path.join(d, f'fill{i}'), 'wb') as f:
                f.write(b'x' * (1 << 20))
            n += 1 << 20
    except OSError:
        pass
    total[d] = n
print(total)
"""


@pytest.mark.parametrize("tmpfs_mb", [16, 64])
def test_the_scratch_sizes_add_up_to_the_budget(tmpfs_mb):
  sizes = _isolation.scratch_sizes(tmpfs_mb << 20)
  assert set(sizes) == {"/tmp", "/dev/shm", "/var/tmp", "/run/lock"}
  assert sum(sizes.values()) <= tmpfs_mb << 20 and all(v >= 4096 for v in sizes.values())
  assert sizes["/tmp"] >= (tmpfs_mb << 20) // 2  # most of it where programs write
  script = _isolation._unshare_script(tmpfs_mb << 20)
  for size in sizes.values():
    assert f"size={size}," in script
  assert f"size={tmpfs_mb << 20}," not in script


def test_one_call_holds_at_most_its_tmpfs_budget(isolation):
  tmpfs_mb = 16
  res = run_python(FILL, isolation=isolation, timeout_s=60, tmpfs_mb=tmpfs_mb, max_file_mb=4)
  assert res.exit_code == 0, res
  written = eval(res.stdout.strip())  # {dir: bytes}
  assert written["/tmp"] >= 8 << 20, written  # the budget is usable
  assert sum(written.values()) <= tmpfs_mb << 20, written
  again = run_python("6 * 7", isolation=isolation, timeout_s=10)  # the next call starts empty and works
  assert again.text == "42", again
