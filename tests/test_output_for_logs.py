"""What covey prints where no terminal reads it (a CI log, a pipe, a file) or with --plain: each table row
whole on one line; covey verify --json for CI gates; covey env and covey --version for bug reports."""

import io
import json
import os
import re
from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table

import covey
from covey.cli import _plain_option, main
from covey.rollout.fast import decode_kernel
from covey.telemetry.plain import VARIABLE, is_plain, print_table, table_lines
from covey.telemetry.runlog import RunLog


def _check_line(check: dict) -> str:
    """A check as the plain output writes it: stage  check  STATUS  measured  what to do."""
    cells = [check["stage"], check["check"], check["status"], check["measured"], check["message"]]
    while cells and not cells[-1]:
        cells.pop()
    return "  ".join((c or "-").replace("\n", "\\n") for c in cells)


@pytest.fixture
def kernel_cache_cleared():
    """The decode kernel's loader asks again (it keeps its answer per process), before and after the test."""
    decode_kernel._library.cache_clear()
    decode_kernel._amx_library.cache_clear()
    yield
    decode_kernel._library.cache_clear()
    decode_kernel._amx_library.cache_clear()


def _verify_config(tmp_path: Path, model_dir: Path) -> Path:
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {model_dir}\nnum_generations: 4\nmax_completion_length: 6\n"
                      "reward_funcs: [answer_format, answer_correct]\n")
    return config


def test_verify_through_a_pipe_prints_each_check_whole_on_one_line_and_its_json(tmp_path, tiny_model_dir, capsys):
    out_file = tmp_path / "verify.json"
    code = main(["verify", str(_verify_config(tmp_path, tiny_model_dir)), "--json", str(out_file)])
    out = capsys.readouterr().out  # captured: not a terminal, as in a CI log
    data = json.loads(out_file.read_text())
    lines = out.splitlines()
    assert code == 0 == data["exit_code"] and data["verdict"] == "WARN" and data["first_failing_stage"] is None
    assert data["counts"]["WARN"] >= 1 and sum(data["counts"].values()) == len(data["checks"]) > 10
    # a random tiny model never writes tags: answer_format's long warning, which a box table wraps over rows
    long = [c for c in data["checks"] if c["status"] == "WARN" and len(c["message"]) > 80]
    assert long, "a warning with a message longer than a line of 80 columns"
    for check in data["checks"]:
        assert _check_line(check) in lines, f"not whole on one line: {_check_line(check)}"
    assert lines.index("stage  check  status  measured  what to do") < lines.index(_check_line(data["checks"][0]))
    assert not any(ch in out for ch in "│┃━"), "no box drawing in a log"
    assert lines[-1].startswith("every stage passed, with")
    if decode_kernel.available():  # the fast engine's decode steps ran in covey's kernel, and verify says so
        kernel = next(c for c in data["checks"] if c["check"].startswith("decode steps run in covey's kernel"))
        assert kernel["status"] == "PASS" and kernel["measured"].startswith("covey's decode kernel (float32")
    # the file is kept unless --overwrite, refused before any checking
    assert main(["verify", str(tmp_path / "c.yaml"), "--json", str(out_file)]) == 2
    assert "already exists: pass --overwrite" in capsys.readouterr().err
    assert main(["verify", str(tmp_path / "c.yaml"), "--json", "-"]) == 2
    assert "covey verify --json writes a file" in capsys.readouterr().err


def test_verify_warns_where_the_decode_kernel_cannot_be_built_here(tmp_path, tiny_model_dir, capsys, monkeypatch,
                                                                  kernel_cache_cleared):
    if not decode_kernel.could_run_here():
        pytest.skip("the decode kernel is not for this machine (Linux, x86-64, AVX-512)")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no library built before
    out_file = tmp_path / "verify.json"
    assert main(["verify", str(_verify_config(tmp_path, tiny_model_dir)), "--json", str(out_file)]) == 0
    kernel = next(c for c in json.loads(out_file.read_text())["checks"]
                  if c["check"].startswith("decode steps run in covey's kernel"))
    assert kernel["status"] == "WARN" and "(float32, lean decoder)" in kernel["measured"]
    assert "covey's kernel" not in kernel["measured"] and "no C compiler" in kernel["message"]
    assert _check_line(kernel) in capsys.readouterr().out.splitlines()


def test_a_table_for_a_log_is_one_line_per_row_with_every_cell_whole():
    table = Table(title="step 3: sample completions")
    for column in ("prompt", "completion", "reward", "note"):
        table.add_column(column)
    table.add_row("What is 2+2?", "It is\n4. " + "A long sentence that a box table would wrap. " * 4, "[green]1[/]", "")
    table.add_row("", "5", "0", "off by one")
    lines = table_lines(table)
    assert lines[0] == "step 3: sample completions:" and lines[1] == "prompt  completion  reward  note"
    assert lines[2] == "What is 2+2?  It is\\n4. " + ("A long sentence that a box table would wrap. " * 4).strip() + "  1"
    assert lines[3] == "-  5  0  off by one"
    file = io.StringIO()
    print_table(Console(file=file, width=40, soft_wrap=True), table)  # a file: plain, whatever the width
    assert file.getvalue().splitlines() == lines


def test_plain_on_a_terminal_only_when_asked(monkeypatch):
    monkeypatch.delenv(VARIABLE, raising=False)
    terminal = Console(file=io.StringIO(), force_terminal=True)
    assert not is_plain(terminal) and is_plain(Console(file=io.StringIO()))
    assert not is_plain(Console(file=io.StringIO(), force_jupyter=True))  # a notebook draws rich's tables
    assert _plain_option(["verify", "c.yaml"]) == ["verify", "c.yaml"] and VARIABLE not in os.environ
    # --plain before or after the command; a TRL script's own arguments are its own
    assert _plain_option(["--plain", "verify", "--trl", "s.py", "--plain"]) == ["verify", "--trl", "s.py", "--plain"]
    assert os.environ[VARIABLE] == "1" and is_plain(terminal)


def test_a_run_logged_to_a_file_writes_a_line_per_step(tmp_path):
    file = io.StringIO()
    with RunLog(tmp_path, total_steps=3, console=Console(file=file, width=40)) as log:
        for step in (1, 2):
            log.log_metrics(step, {"reward": 0.5 * step, "reward_std": 0.25, "completions/mean_length": 12.0})
        log.log_completions(2, [{"prompt": "What is 2+2? " * 5, "completion": "It is 4, as anyone can count " * 3,
                                 "rewards": {"answer_correct": 1.0}, "reward": 1.0, "advantage": 0.5}], None)
    lines = file.getvalue().splitlines()
    assert "step 1/3  reward 0.5  std 0.25  len 12" in lines and "step 2/3  reward 1  std 0.25  len 12" in lines
    assert ("What is 2+2? " * 5).strip() + "  " + ("It is 4, as anyone can count " * 3).strip() + "  1  1  +0.500" in lines
    assert not any("━" in line for line in lines), "no progress bar in a log"


def test_version_and_env_for_a_bug_report(capsys, monkeypatch):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"covey {covey.__version__}\n"
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("COVEY_SERVER_TOKEN", "a-secret")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    fields = dict(re.match(r"([^:]+):\s+(.*)", line).groups() for line in out.splitlines())
    assert fields["covey"].startswith(f"{covey.__version__} (") and fields["torch"].split()[0] == __import__("torch").__version__
    assert re.search(r"\((CPU|CUDA [\d.]+|ROCm .+) build\)", fields["torch"])
    assert {"Python", "transformers", "peft", "datasets", "trl", "vllm", "CPU", "decode kernel"} <= fields.keys()
    assert fields["OMP_NUM_THREADS"] == "2" and fields["COVEY_SERVER_TOKEN"] == "(set)" and "a-secret" not in out
    if Path("/proc/cpuinfo").exists():
        assert re.fullmatch(r"(\w+ (yes|no), )+\w+ (yes|no)", fields["CPU features"]) and "avx512f" in fields["CPU features"]
        assert "RAM" in fields
    assert fields["decode kernel"].startswith("runs: float32" if decode_kernel.available() else "does not run here")


def test_env_says_why_the_decode_kernel_does_not_run(tmp_path, monkeypatch, kernel_cache_cleared):
    monkeypatch.setenv("COVEY_DECODE_KERNEL", "0")
    assert decode_kernel.describe().startswith("does not run here (turned off by COVEY_DECODE_KERNEL=0)")
    monkeypatch.delenv("COVEY_DECODE_KERNEL")
    decode_kernel._library.cache_clear()
    decode_kernel._amx_library.cache_clear()
    if not decode_kernel.could_run_here():
        assert "AVX-512 only" in decode_kernel.describe()
        return
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert "no C compiler (" + str(tmp_path / "no-such-compiler") + ") found" in decode_kernel.describe()
