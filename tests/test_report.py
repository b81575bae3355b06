"""covey report and covey compare on run folders written here (and one from a real tiny training run)."""

import base64
import json
import re
import shutil
import subprocess

import numpy as np
import pytest
from PIL import Image

from covey import GRPOConfig, GRPOTrainer
from covey.cli import main
from covey.errors import ConfigError, DataError
from covey.telemetry.report import COLORS, compare_runs, moving_average, write_report
from tests.test_trainer import ROWS, count_a, small_args

FUNCTIONS = ("answer_format", "answer_correct")
EVERY_PLOT = {"reward", "rewards-answer_format", "rewards-answer_correct", "reward_std", "kl", "completion_length",
              "entropy", "learning_rate"}
HOSTILE = "<script>document.title='pwned'</script><img src=x onerror=alert(1)>"


def make_run(folder, steps=30, kl=True, summary=True, reward_slope=0.02):
    """A finished run folder as covey train writes it: config, metrics, completions (first and last step), summary."""
    folder.mkdir(parents=True)
    GRPOConfig(output_dir=str(folder), max_steps=steps, beta=0.04 if kl else 0.0, learning_rate=1e-5).save(
        folder / "config.yaml")
    rng = np.random.default_rng(0)
    with open(folder / "metrics.jsonl", "w") as f:
        for step in range(1, steps + 1):
            record = {"step": step, "reward": reward_slope * step + rng.normal(0, 0.05), "reward_std": 0.4,
                      "entropy": 2.0 - step / steps, "completions/mean_length": 20.0, "completions/min_length": 5.0,
                      "completions/max_length": 32.0, "learning_rate": 1e-5, "loss": 0.1, "grad_norm": 1.0}
            for i, fn in enumerate(FUNCTIONS):
                record[f"rewards/{fn}/mean"] = 0.1 * i + 0.01 * step
                record[f"rewards/{fn}/std"] = 0.3
            if kl:
                record["kl"] = 0.001 * step
            f.write(json.dumps(record) + "\n")
    with open(folder / "completions.jsonl", "w") as f:
        for step in (1, steps):
            for g in range(4):
                f.write(json.dumps({
                    "step": step, "prompt": [{"role": "system", "content": "Add."},
                                             {"role": "user", "content": f"What is {step} + {g}?"}],
                    "completion": HOSTILE if g == 0 else f"{step} + {g} = {step + g}",
                    "rewards": {"answer_format": 1.0, "answer_correct": None if g == 1 else 0.0},
                    "reward": 1.0, "advantage": 0.25 * g - 0.375, "finish_reason": "eos"}) + "\n")
    if summary:
        sample = {"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "completion": "5", "correct": True}
        (folder / "summary.json").write_text(json.dumps({
            "steps": steps, "model": "tiny-model", "dataset": "arithmetic",
            "before": {"accuracy": 0.25, "mean_reward": 0.5, "n": 8},
            "after": {"accuracy": 0.625, "mean_reward": 1.25, "n": 8}, "accuracy_change": 0.375,
            "eval_samples": {"before": [{**sample, "completion": HOSTILE, "correct": False}], "after": [sample]}}))
    return folder


def png_names(folder):
    return {p.stem for p in folder.glob("*.png")}


def image_sources(page_html):
    return re.findall(r'<img src="([^"]*)"', page_html)


def has_colour(path, hex_colour, tolerance=12):
    pixels = np.asarray(Image.open(path).convert("RGB"), dtype=int)
    target = np.array([int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)])
    return bool((np.abs(pixels - target).max(axis=-1) <= tolerance).any())


def test_report_writes_one_valid_png_per_metric_and_a_self_contained_page(tmp_path):
    run = make_run(tmp_path / "run")
    page = write_report(run)
    out = run / "report"
    assert page == out / "report.html"
    assert png_names(out) == EVERY_PLOT
    for png in out.glob("*.png"):
        with Image.open(png) as image:
            image.verify()
        with Image.open(png) as image:
            assert image.size == (640, 360)
            assert len(image.convert("RGB").getcolors(1 << 20)) > 20, f"{png.name} looks blank"
    assert has_colour(out / "reward.png", COLORS[0])

    text = page.read_text()
    sources = image_sources(text)
    assert len(sources) == len(EVERY_PLOT)  # every plot is on the page, embedded, and byte-identical to its file
    embedded = {base64.b64decode(s.removeprefix("data:image/png;base64,")) for s in sources}
    assert embedded == {p.read_bytes() for p in out.glob("*.png")}
    assert not re.search(r"<script|<link|https?://|src=\"(?!data:)", text)  # nothing external, no script at all
    for expected in (*FUNCTIONS, "tiny-model", "62.5%", "+37.5 pts", "First recorded step: step 1",
                     "Last recorded step: step 30", "What is 30 + 3?", "beta</code>"):
        assert expected in text, expected
    assert "Notes on this run" not in text


def test_model_output_is_escaped_everywhere(tmp_path):
    text = write_report(make_run(tmp_path / "run")).read_text()
    assert "&lt;script&gt;document.title=&#x27;pwned&#x27;&lt;/script&gt;&lt;img src=x onerror=alert(1)&gt;" in text
    assert text.count("&lt;script&gt;") == 3  # first step, last step, held-out sample before training
    assert "<script" not in text and "onerror=alert(1)>" not in text
    assert len(image_sources(text)) == len(EVERY_PLOT)


def test_an_unfinished_run_without_kl_reports_what_is_missing(tmp_path):
    run = make_run(tmp_path / "run", steps=5, kl=False, summary=False)
    (run / "completions.jsonl").unlink()
    lines = (run / "metrics.jsonl").read_text().splitlines()
    broken = json.loads(lines[2])
    broken["entropy"] = float("nan")
    lines[2] = json.dumps(broken)  # a NaN in one line (json writes the literal NaN)
    (run / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 6, "rew')  # killed while writing a line
    text = write_report(run).read_text()
    assert png_names(run / "report") == EVERY_PLOT - {"kl"}
    assert "no summary.json: the run did not finish" in text
    assert "no completions.jsonl" in text and "last line of metrics.jsonl was cut off" in text
    assert "Not logged in this run, so not plotted: kl" in text
    assert "5 logged (unfinished)" in text and "No before/after evaluation" in text
    (run / "config.yaml").write_text("learning_rate: [unclosed\n")  # damaged by hand: the report still comes
    assert "config.yaml could not be read (ParserError)" in write_report(run).read_text()


def test_a_run_resumed_with_changed_settings_says_what_changed_and_when(tmp_path):
    run = make_run(tmp_path / "run", steps=12)
    GRPOConfig(output_dir=str(run), max_steps=12, beta=0.04, learning_rate=5e-6,
               resume_from_checkpoint="auto").save(run / "config.resumed-at-10.yaml")
    GRPOConfig(output_dir=str(run), max_steps=12, beta=0.04, learning_rate=1e-5).save(run / "config.resumed-at-4.yaml")
    text = write_report(run).read_text()
    first, second = text.index("resumed at step 4"), text.index("resumed at step 10")
    assert first < second  # in the order of the steps, not of the names
    assert "resumed at step 10 with changed settings: learning_rate 1e-05 -&gt; 5e-06 (the config" in text
    assert "resumed at step 4 with changed settings: none" in text


def test_regenerating_replaces_only_the_report_files(tmp_path):
    run = make_run(tmp_path / "run")
    write_report(run)
    out = run / "report"
    (out / "my-notes.txt").write_text("keep me")
    (out / "screenshot.png").write_bytes(b"not a plot")
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        del record["kl"], record["rewards/answer_correct/mean"]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    before["metrics.jsonl"] = (run / "metrics.jsonl").read_bytes()

    write_report(run)
    assert png_names(out) == EVERY_PLOT - {"kl", "rewards-answer_correct"} | {"screenshot"}
    assert (out / "my-notes.txt").read_text() == "keep me"
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before  # run files untouched

    elsewhere = write_report(run, tmp_path / "elsewhere")
    assert elsewhere.parent == tmp_path / "elsewhere" and (tmp_path / "elsewhere" / "reward.png").is_file()


def test_folders_that_are_not_runs_are_named_with_what_is_missing(tmp_path):
    with pytest.raises(ConfigError, match="nowhere does not exist"):
        write_report(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"empty is not a run folder: it has neither metrics.jsonl nor config.yaml"):
        write_report(tmp_path / "empty")
    run = make_run(tmp_path / "run")
    (run / "metrics.jsonl").unlink()
    with pytest.raises(DataError, match=r"run has no metrics.jsonl: the run logged no step yet"):
        write_report(run)
    for content, message in [("\n", r"metrics.jsonl is empty"),
                             ('{"step": 1, "reward": 0.5}\n{oops\n{"step": 3, "reward": 0.5}\n',
                              r"metrics.jsonl, line 2: not valid JSON"),
                             ('{"reward": 0.5}\n', r"record 1 has no numeric 'step'")]:
        (run / "metrics.jsonl").write_text(content)
        with pytest.raises(DataError, match=message):
            write_report(run)
    (run / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n')
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError, match="a-file is a file"):
        write_report(run, tmp_path / "a-file")


def test_moving_average_keeps_length_and_follows_a_ramp():
    ramp = np.arange(10, dtype=float)
    smoothed = moving_average(ramp, 3)
    assert smoothed.shape == ramp.shape
    assert np.allclose(smoothed[1:-1], ramp[1:-1]) and smoothed[0] == 0.5 and smoothed[-1] == 8.5
    assert np.allclose(moving_average(np.full(7, 2.0), 5), 2.0)


def test_compare_overlays_one_curve_per_run(tmp_path):
    runs = [make_run(tmp_path / f"run{i}", steps=10 + 10 * i, reward_slope=0.01 * (i + 1)) for i in range(3)]
    out = compare_runs(runs, tmp_path / "plots" / "cmp.png")
    with Image.open(out) as image:
        assert image.size == (640, 360)
    assert all(has_colour(out, COLORS[i]) for i in range(3)) and not has_colour(out, COLORS[3])
    two = compare_runs(runs[:2], tmp_path / "two.png", metric="kl")
    assert has_colour(two, COLORS[1]) and not has_colour(two, COLORS[2])

    no_kl = make_run(tmp_path / "nokl", kl=False)
    with pytest.raises(DataError, match=r"nokl has no value of metric 'kl'; it logged: .*entropy"):
        compare_runs([runs[0], no_kl], tmp_path / "x.png", metric="kl")


def test_cli_report_and_compare(tmp_path, capsys, monkeypatch):
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b", reward_slope=0.03)
    assert main(["report", str(a)]) == 0
    assert f"report: {a / 'report' / 'report.html'}" in capsys.readouterr().out
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "missing does not exist" in capsys.readouterr().err

    monkeypatch.chdir(tmp_path)
    assert main(["compare", str(a), str(b)]) == 0
    assert (tmp_path / "compare-reward.png").is_file()
    capsys.readouterr()
    assert main(["compare", str(a), str(b)]) == 2
    assert "compare-reward.png already exists: pass --overwrite" in capsys.readouterr().err
    assert main(["compare", str(a), str(b), "--overwrite"]) == 0
    assert main(["compare", str(a), str(b), "--metric", "rewards/answer_format/mean"]) == 0
    assert (tmp_path / "compare-rewards_answer_format_mean.png").is_file()
    assert main(["compare", str(a)]) == 2
    assert "at least two run folders" in capsys.readouterr().err
    assert main(["compare", str(a), str(b), "--out", str(tmp_path), "--overwrite"]) == 2
    assert "is a folder: name a file" in capsys.readouterr().err
    assert main(["compare", str(a), str(b), "--out", str(tmp_path / "nowhere" / "plot.png")]) == 2  # before plotting
    assert "there is no folder" in capsys.readouterr().err


def test_report_of_a_real_tiny_training_run(tmp_path, tokenizer, tiny_model):
    args = small_args(tmp_path, max_steps=2)
    GRPOTrainer(model=tiny_model, reward_funcs=[count_a], args=args, train_dataset=ROWS, eval_dataset=ROWS,
                processing_class=tokenizer, quiet=True).train()
    run = tmp_path / "run"
    text = write_report(run).read_text()
    assert png_names(run / "report") == {"reward", "rewards-count_a", "reward_std", "completion_length", "entropy",
                                         "learning_rate"}  # beta 0: no KL
    assert len(image_sources(text)) == 6
    assert "count_a" in text and "held-out (greedy)" in text and "First recorded step: step" in text
    assert "Notes on this run" not in text and "Not logged in this run, so not plotted: kl" in text


CHROMIUM = shutil.which("chromium")
CHECK_IMAGES = """<script>
addEventListener("load", () => {
  const images = Array.from(document.images);
  const loaded = images.filter(image => image.complete && image.naturalWidth > 0).length;
  const result = document.createElement("div");
  result.id = "check";
  result.textContent = (loaded === images.length ? "ok " : "broken ") + loaded + "/" + images.length;
  document.body.appendChild(result);
});
</script>"""


def chromium(tmp_path, *options):
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               f"--user-data-dir={tmp_path / 'chromium-profile'}", *options]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian package 'chromium')")
def test_every_image_loads_in_headless_chromium_and_the_page_renders(tmp_path):
    run = make_run(tmp_path / "run")
    page = write_report(run)
    checked = tmp_path / "checked.html"
    checked.write_text(page.read_text().replace("</body>", CHECK_IMAGES + "</body>"))
    dom = chromium(tmp_path, "--virtual-time-budget=5000", "--dump-dom", checked.as_uri()).stdout
    result = re.search(r'<div id="check">([^<]*)</div>', dom)
    assert result, "the check script did not run"
    assert result.group(1) == f"ok {len(EVERY_PLOT)}/{len(EVERY_PLOT)}"

    screenshot = page.parent / "screenshot.png"
    chromium(tmp_path, f"--screenshot={screenshot}", "--window-size=1280,2400", page.as_uri())
    with Image.open(screenshot) as image:
        assert image.size == (1280, 2400)
        assert len(image.convert("RGB").getcolors(1 << 24)) > 100, "the screenshot is (nearly) blank"


def test_a_folder_of_other_files_is_never_written_into(tmp_path):
    run = make_run(tmp_path / "run")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "kl.png").write_bytes(b"my own picture")
    with pytest.raises(ConfigError, match="holds files that are not a covey report"):
        write_report(run, mine)
    assert (mine / "kl.png").read_bytes() == b"my own picture" and not (mine / "report.html").exists()


def test_the_model_card_names_a_hub_model_but_never_a_local_folder(tmp_path, monkeypatch):
    from covey.telemetry.tables import model_card

    def front(base):
        return model_card(base, "arithmetic", ["r"], [1.0], {}, 1, None, None, adapter=False).split("---")[1]

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    assert "\nbase_model: HuggingFaceTB/SmolLM2-135M-Instruct\n" in front("HuggingFaceTB/SmolLM2-135M-Instruct")
    for local in ("models/tiny", "./models/tiny", "/abs/models/tiny", "a/b/c"):
        assert "\nbase_model:" not in front(local) and f"# base model: {local}" in front(local)
