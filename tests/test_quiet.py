"""Import-time lines of other packages that say nothing to a user are dropped (torchtune_grpo/runtime/quiet.py), and
only those: another warning of the same packages still shows."""

import subprocess
import sys

TORCHAO_LINE = "Skipping import of cpp extensions due to incompatible torch version"


def _stderr(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def test_torchaos_line_is_dropped_where_the_package_is_imported_first():
    plain = _stderr("import torchtune")
    quiet = _stderr("import torchtune_grpo, torchtune")
    assert TORCHAO_LINE not in quiet, quiet
    # Where torchao's compiled kernels match this torch (torch 2.9.1 with torchao 0.15) it says nothing either
    # way; everywhere else the plain import says it, and the two outputs differ by exactly that line.
    assert quiet == "\n".join(line for line in plain.splitlines() if TORCHAO_LINE not in line) + ("\n" if quiet else "")


def test_other_warnings_of_those_packages_still_show():
    code = ("import logging, warnings, torchtune_grpo\n"
            "logging.getLogger('torchao').warning('a torchao warning that matters')\n"
            "warnings.warn('a user warning that matters', UserWarning)\n")
    err = _stderr(code)
    assert "a torchao warning that matters" in err and "a user warning that matters" in err
    assert "deprecated" not in _stderr("import warnings, torchtune_grpo\n"
                                       "warnings.warn(\"'set_vital' is deprecated, please do not call\", UserWarning)")
