"""`launch/compile.py` for a v6e-64 slice, every program of aepo_gaia's run at 2 layers (its own file, so that under
`-n 2 --dist loadfile` it compiles beside the v5p tests of tests/train/test_compile.py instead of after them)."""

import pytest

from test_compile import _fits  # noqa: F401  (skips the module without libtpu, as test_compile does)


@pytest.mark.slow
def test_aepo_gaia_fits_v6e_64():
  _fits("v6e:8x8", 64, 32.0)
