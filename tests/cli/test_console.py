"""distmis owns its console: native library noise filtered from descriptor 2, no ANSI codes where nobody sees
colours, the libraries' logging turned down unless --verbose."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from distmis.cli.console import NATIVE_NOISE, StripAnsi, quiet_environment

ABSL = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
ONEDNN = ("I0000 00:00:1795617414.390555    5158 port.cc:153] oneDNN custom operations are on. You may see "
          "slightly different numerical results")


def test_the_noise_patterns_drop_absl_info_and_warnings_and_keep_errors():
    assert NATIVE_NOISE.match(ABSL) and NATIVE_NOISE.match(ONEDNN)
    assert NATIVE_NOISE.match("W0000 00:00:1795617414.390555    5158 cpu_feature_guard.cc:210] This TensorFlow")
    assert not NATIVE_NOISE.match("E0000 00:00:1795617414.390555    5158 cuda_dnn.cc:8310] Could not load cuDNN")
    assert not NATIVE_NOISE.match("F tensorflow/core/framework/tensor_shape.cc:45] Check failed")
    assert not NATIVE_NOISE.match("Traceback (most recent call last):")


def test_ansi_codes_are_stripped_from_a_stream_that_is_not_a_terminal():
    target = io.StringIO()
    stream = StripAnsi(target)
    stream.write("\x1b[36m(trial pid=1)\x1b[0m epoch 1\x1b[2K\n")
    assert target.getvalue() == "(trial pid=1) epoch 1\n"
    assert quiet_environment(verbose=False, colour=False) == {
        "MLFLOW_LOGGING_LEVEL": "WARNING", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false", "RAY_COLOR_PREFIX": "0"}
    assert quiet_environment(verbose=True, colour=True) == {}


def run_console(tmp_path: Path, verbose: bool) -> subprocess.CompletedProcess:
    """A process whose console is distmis's, with a child process and C-level writes to descriptor 2."""
    script = textwrap.dedent(f"""
        import logging, os, subprocess, sys
        from distmis.cli.console import console
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
        with console(verbose={verbose}):
            logging.getLogger("tensorflow").warning("retracing advice")
            logging.getLogger("tensorflow").error("a tensorflow error")
            os.write(2, {ABSL!r}.encode() + b"\\n" + {ONEDNN!r}.encode() + b"\\n")
            subprocess.run([sys.executable, "-c", "import os; os.write(2, b{ABSL!r} + b'\\\\nchild error\\\\n')"])
            print("\\x1b[32mcoloured\\x1b[0m to a pipe", file=sys.stderr)
            print("progress 50%\\r", end="", file=sys.stderr, flush=True)
            os.write(2, b"E0000 00:00:1.0 1 x.cc:1] a real error\\n")
            print("stdout \\x1b[1mline\\x1b[0m")
            print(os.environ.get("MLFLOW_LOGGING_LEVEL"))
        print("after", file=sys.stderr)
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    env.pop("MLFLOW_LOGGING_LEVEL", None)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120,
                          cwd=tmp_path)


def test_descriptor_2_keeps_what_matters_and_drops_the_notices(tmp_path: Path):
    done = run_console(tmp_path, verbose=False)
    assert done.returncode == 0, done.stderr
    assert "absl::InitializeLog" not in done.stderr and "oneDNN" not in done.stderr
    for kept in ("child error", "coloured to a pipe", "progress 50%", "a real error", "after", "a tensorflow error"):
        assert kept in done.stderr
    assert "retracing advice" not in done.stderr
    assert "\x1b" not in done.stderr and "\x1b" not in done.stdout
    assert done.stdout.splitlines() == ["stdout line", "WARNING"]


def test_verbose_leaves_the_notices_on_the_console(tmp_path: Path):
    done = run_console(tmp_path, verbose=True)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("absl::InitializeLog") == 2 and "oneDNN" in done.stderr
    assert "retracing advice" in done.stderr
    assert done.stdout.splitlines()[-1] == "None"


def run_progress(tmp_path: Path, stderr: int | None) -> tuple[int, str]:
    """A command's console (distmis's descriptor-2 filter on) showing a loop's progress; ``stderr``: a terminal's
    descriptor, or None for a pipe. Returns the exit code and what reached stderr."""
    script = textwrap.dedent("""
        import sys
        from distmis.cli.console import console
        from distmis.data.case_progress import case_progress
        with console(verbose=False):
            print("terminal" if sys.stderr.isatty() else "not a terminal", file=sys.stderr)
            for _ in case_progress(range(3), "synthesize"):
                pass
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    if stderr is None:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120,
                              cwd=tmp_path)
        return done.returncode, done.stderr
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=stderr, env=env,
                               cwd=tmp_path)
    return process.wait(timeout=120), ""


def test_progress_is_a_bar_on_a_terminal_and_plain_lines_in_a_pipe(tmp_path: Path):
    """Off a terminal no carriage return reaches the log (issue 46); on one, behind the console's filter of
    descriptor 2, stderr still says it is a terminal and the bar is drawn."""
    import pty

    code, err = run_progress(tmp_path, None)
    assert code == 0 and "\r" not in err
    assert err.splitlines() == ["not a terminal", "synthesize: 3 cases", "synthesize: 3/3 cases in 0:00"]

    leader, follower = pty.openpty()
    try:
        code, _ = run_progress(tmp_path, follower)
        os.close(follower)
        drawn = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal's other end closed: all read
                break
            if not chunk:
                break
            drawn += chunk
    finally:
        os.close(leader)
    assert code == 0
    text = drawn.decode()
    # a bar (the terminal itself turns each "\n" into "\r\n"), not the plain lines
    assert text.startswith("terminal\r\n") and "synthesize: 100%|" in text and "synthesize: 3 cases" not in text
