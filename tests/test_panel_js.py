"""The panel's JS formatting and aggregation, unit-tested with node's own test runner (tests/js)."""

import shutil
import subprocess

import pytest
import rkharness

pytestmark = pytest.mark.panel


def test_js_unit_tests_pass_under_node():
    node = shutil.which("node") or shutil.which("nodejs")
    if node is None:
        pytest.skip("node is not installed (the JS unit tests need Node.js 18+)")
    files = sorted(str(p) for p in (rkharness.TESTS / "js").glob("*.test.mjs"))
    assert files, "no JS tests found"
    out = subprocess.run([node, "--test", *files], capture_output=True, text=True, timeout=120,
                         cwd=rkharness.ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "# fail 0" in out.stdout and "# pass 0" not in out.stdout, out.stdout[-2000:]
