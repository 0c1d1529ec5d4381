"""Run `dlm-studio` as a subprocess, as scripts do, and check its one-line errors."""
import subprocess
import sys

CLI = [sys.executable, "-m", "studio"]


def cli(*args, check_rc=None, **kw):
    r = subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=600, **kw)
    if check_rc is not None:
        assert r.returncode == check_rc, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    return r


def assert_one_line_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]
