"""The ``covey`` command.

    covey train                                   # the built-in demo
    covey train my.yaml --learning-rate 2e-5 --max-steps 50
    covey train my.yaml --output-dir runs/a --resume-from-checkpoint auto
    covey eval runs/20261129-101500               # a run folder's final model on its held-out split
    covey verify my.yaml                          # check every stage of the pipeline on one batch
    covey verify --trl train_grpo.py [args]       # the same checks on a TRL GRPO script's trainer
    covey generate my.yaml --num-prompts 3        # completions, rewards and advantages, no training
    covey report runs/20261129-101500             # plots and an HTML page of a run
    covey diagnose runs/20261129-101500           # learning, not learning, gaming the reward or collapsed?
    covey compare runs/a runs/b                   # reward curves of several runs in one plot
    covey server my.yaml                          # a rollout server for vllm_mode: server
    covey plan my.yaml --processes 2              # a step's peak memory per device, before loading the model
    covey env                                     # versions, CPU, devices, settings: for a bug report
    covey --version

For a log, or with --plain (before or after the command), tables print as plain lines, one row per line.

Every GRPOConfig field is an option in dash-case; YAML values are overridden by the command line.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from covey.config import DEMO, GRPOConfig, config_fields
from covey.trl_fields import suggest_field
from covey.trl_fields import SAME_AS
from covey.train.distributed import World
from covey.errors import ConfigError, CoveyError, TrainingInterrupted
from covey.telemetry.plain import VARIABLE as PLAIN_VARIABLE


# what argparse takes for a negative number rather than an option: with exponents too (-1e-3)
_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    parser._negative_number_matcher = _NEGATIVE_NUMBER
    parser.add_argument("config", nargs="?", help="YAML file of config fields (command-line options override it)")
    group = parser.add_argument_group("config fields (TRL names, dash-case)")
    for f in config_fields():
        kind = str(f.type)
        options: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": f.metadata["help"]}
        if kind.startswith("list"):
            options.update(nargs="+", metavar="VALUE")
        elif kind.startswith("bool"):
            options.update(nargs="?", const="true", metavar="BOOL")
        elif kind.startswith("dict"):
            options["metavar"] = "JSON"
        else:
            options["metavar"] = kind.split(" ")[0].upper()
        if "choices" in f.metadata:
            options["help"] += f" ({' | '.join(f.metadata['choices'])})"
        aliases = [alias for alias, name in SAME_AS.items() if name == f.name]  # TRL's script arguments' names
        group.add_argument(*("--" + name.replace("_", "-") for name in [f.name, *aliases]), **options)


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.Namespace, dict[str, Any]]:
    # --learning_rate as well as --learning-rate (TRL's scripts take both)
    argv = [re.sub(r"^(--[^=]+)", lambda m: m[1].replace("_", "-"), token) if token.startswith("--") else token
            for token in argv]
    namespace, unknown = parser.parse_known_args(argv)
    for token in unknown:
        if token.startswith("--"):
            name = token[2:].split("=", 1)[0].replace("-", "_")
            raise ConfigError(f"unknown option {token.split('=', 1)[0]}{suggest_field(name, [f.name for f in config_fields()])}; "
                              "see covey train --help")
        raise ConfigError(f"unexpected argument {token!r}; give at most one config file")
    names = {f.name for f in config_fields()}
    unsettable = {f.name for f in config_fields() if "None" in str(f.type)}
    overrides = {k: v for k, v in vars(namespace).items() if k in names}
    for name, value in overrides.items():  # an optional list given as the single word none: unset
        if name in unsettable and isinstance(value, list) and len(value) == 1 and str(value[0]).lower() in ("none", "null"):
            overrides[name] = None
    flags = {f.name for f in config_fields() if str(f.type).startswith("bool")}
    for name in flags & overrides.keys():  # `--use-peft run.yaml`: a bare flag, then the config file (or run folder)
        value = str(overrides[name])
        if namespace.config is None and (value.lower().endswith((".yaml", ".yml")) or os.path.exists(value)):
            namespace.config, overrides[name] = value, "true"
    return namespace, overrides


def _parse_command(prog: str, description: str, argv: list[str], num_prompts_help: str | None = None,
                   json_help: str | None = None, probes: bool = False) -> tuple[argparse.Namespace, dict[str, Any]]:
    """Parse a command's options: [CONFIG], every config field, and optionally --num-prompts / --json
    (with ``json_help``, what it writes) / --accept-probe (``probes``)."""
    json_output = json_help is not None
    parser = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False)
    if num_prompts_help:
        parser.add_argument("--num-prompts", type=int, default=2, help=num_prompts_help)
    if probes:
        parser.add_argument("--accept-probe", action="append", default=[], metavar="NAME",
                            help="a known reward-probe finding that only warns: FUNCTION:PROBE, or FUNCTION for all "
                                 "of its probes (repeatable; docs/verify.md)")
    if json_output:
        parser.add_argument("--json", metavar="FILE", help=json_help)
        parser.add_argument("--overwrite", action="store_true", help="replace the --json FILE if it exists")
    _add_config_options(parser)
    namespace, overrides = _parse(parser, argv)
    if num_prompts_help and namespace.num_prompts < 1:
        raise ConfigError("--num-prompts must be at least 1")
    if json_output and namespace.json not in (None, "-"):  # before the sampling, not after it
        _check_output_file("--json", Path(namespace.json), namespace.overwrite)
    return namespace, overrides


def _check_output_file(option: str, out: Path, overwrite: bool) -> None:
    """Refuse, before any work, an output file that cannot be written or would replace one unasked."""
    if out.is_dir():
        raise ConfigError(f"{option} {out} is a folder: name a file")
    if out.exists() and not overwrite:
        raise ConfigError(f"{option} {out} already exists: pass --overwrite to replace it, or name another file")
    if not out.parent.is_dir():
        raise ConfigError(f"{option} {out}: there is no folder {out.parent} to write it in")


def _load_config(config_path: str | None, overrides: dict[str, Any]) -> GRPOConfig:
    """The config file's fields over TRL's defaults; without a file, the demo preset (said once)."""
    if config_path is None:
        config = GRPOConfig.from_dict({**DEMO, **overrides}, source="command line")
        if preset := {k: v for k, v in DEMO.items() if k not in overrides}:
            print(f"no config file: the demo preset ({', '.join(f'{k}={v}' for k, v in preset.items())}); "
                  "give a YAML file for a run of your own", file=sys.stderr)
        return config
    return GRPOConfig.from_yaml(config_path, overrides)


def cmd_train(argv: list[str]) -> int:
    namespace, overrides = _parse_command("covey train", "Train a model with GRPO.", argv)
    args = _load_config(namespace.config, overrides)
    from covey.train.trainer import GRPOTrainer

    try:
        GRPOTrainer(args=args).train()
    finally:
        World.leave()
    return 0


def cmd_eval(argv: list[str]) -> int:
    namespace, overrides = _parse_command(
        "covey eval", "Greedy held-out accuracy and mean reward of a model or run folder.", argv)
    config_path = namespace.config
    run_dir = Path(config_path) if config_path and Path(config_path).is_dir() else None
    if run_dir is not None:  # a run folder: its config (the last resume's, if it changed any), its final model
        from covey.telemetry.runlog import latest_run_config

        if not (run_dir / "config.yaml").is_file() or not (run_dir / "final_model").is_dir():
            raise ConfigError(f"{run_dir} is not a finished run folder (needs config.yaml and final_model/)")
        config_path = str(latest_run_config(run_dir))
        overrides.setdefault("model", str(run_dir / "final_model"))
    overrides.setdefault("use_peft", False)  # a saved adapter is loaded as it is, not wrapped again
    args = _load_config(config_path, overrides)

    from covey.data import heldout_rows
    from covey.models import eos_token_ids, load_policy, load_processing
    from covey.telemetry.plain import output_console
    from covey.telemetry.tables import percent
    from covey.train.evaluation import evaluate
    from covey.train.setup import build_engine, load_rewards, model_loading

    rows = heldout_rows(args.dataset, args.eval_dataset, args.eval_max_samples or 10**9, args.eval_split,
                        args.system_prompt, args.dataset_config)
    if not rows:
        raise ConfigError(f"no held-out data for dataset {args.dataset!r}: pass --eval-dataset FILE")
    reward_funcs, reward_weights = load_rewards(args)
    tokenizer, processor = load_processing(args.model, args.trust_remote_code, args.model_revision)
    model = load_policy(args.model, model_loading(args)).eval()
    engine = build_engine(args, model, tokenizer, eos_token_ids(model, tokenizer))
    result = evaluate(engine, tokenizer, rows, reward_funcs, reward_weights, args, processor=processor)
    output_console().print(f"{args.model}: accuracy {percent(result['accuracy'])} "
                           f"(n={result['n']}), mean reward {result['mean_reward']:.3f}")
    return 0


def _verify_output_options(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """covey verify's --json FILE and --overwrite, wherever they stand before --trl; the other arguments."""
    cut = argv.index("--trl") if "--trl" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="covey verify", add_help=False, allow_abbrev=False)
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--overwrite", action="store_true")
    namespace, rest = parser.parse_known_args(argv[:cut])
    if namespace.json == "-":
        raise ConfigError("covey verify --json writes a file (standard output has the checks as lines): name one")
    if namespace.json is not None:
        _check_output_file("--json", Path(namespace.json), namespace.overwrite)
    return namespace, rest + argv[cut:]


def cmd_verify(argv: list[str]) -> int:
    output, argv = _verify_output_options(argv)
    if argv[:1] == ["--trl"]:  # covey verify --trl train_grpo.py [its own arguments]
        return _verify_trl_script(argv[1:], output.json)
    namespace, overrides = _parse_command(
        "covey verify", "Run every stage of the pipeline on one small batch and check its invariant; "
        "exit 0 when every stage passed, 1 naming the first failing stage, 2 on bad settings (docs/verify.md).",
        argv, num_prompts_help="prompts in the checked batch",
        json_help="also write the checks and the verdict as JSON to FILE, for CI (schema in docs/verify.md)",
        probes=True)
    args = _load_config(namespace.config, overrides)
    from covey.verify import verify

    report = verify(args, num_prompts=namespace.num_prompts, probes=True, accepted_probes=namespace.accept_probe)
    return _print_verify_report(report, output.json)


def _print_verify_report(report, json_file: str | None) -> int:
    import json

    from covey.telemetry.plain import output_console
    from covey.verify.report import print_report, report_data

    code = print_report(report, output_console())
    if json_file is not None:
        Path(json_file).write_text(json.dumps(report_data(report), indent=2) + "\n")
    return code


def _verify_trl_script(argv: list[str], json_file: str | None) -> int:
    """Run a TRL GRPO script up to its trainer.train(), then check that trainer stage by stage."""
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: covey verify [--json FILE [--overwrite]] --trl SCRIPT [SCRIPT ARGS ...]\n\nRun your TRL GRPO "
              "script unchanged up to trainer.train(); instead of training, check every stage of its pipeline (TRL's "
              "own code, as installed) and exit 1 naming the first failing stage.")
        return 0 if argv else 2
    from covey.verify.trl import run_until_train, verify_trl

    return _print_verify_report(verify_trl(run_until_train(argv[0], argv[1:])), json_file)


def cmd_generate(argv: list[str]) -> int:
    namespace, overrides = _parse_command(
        "covey generate", "Sample completions for a few prompts and show every reward, the total and the "
        "advantage, without training.", argv, num_prompts_help="prompts to sample (each num_generations times)",
        json_help="also write one JSON line per completion to FILE ('-' = stdout)")
    args = _load_config(namespace.config, overrides)
    import json

    from covey.telemetry.plain import output_console, print_table
    from covey.telemetry.tables import completions_table
    from covey.train.setup import one_batch_settings
    from covey.train.rounds import score_prompts
    from covey.train.trainer import GRPOTrainer

    parts = GRPOTrainer(args=one_batch_settings(args, namespace.num_prompts), quiet=True).parts
    indices = list(range(min(namespace.num_prompts, len(parts.prompts.rows))))
    records = score_prompts(parts, indices).records()
    table = completions_table(records, title=f"{len(records)} completions of {len(indices)} prompts")
    print_table(output_console(), table)
    if namespace.json:
        lines = "".join(json.dumps(r) + "\n" for r in records)
        if namespace.json == "-":
            sys.stdout.write(lines)
        else:
            Path(namespace.json).write_text(lines)
    return 0


def cmd_report(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="covey report", allow_abbrev=False,
        description="Plots of a run's training curves and one self-contained HTML page with the plots, the config, "
                    "the before/after evaluation and sample completions.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (output_dir of covey train)")
    parser.add_argument("--out", metavar="DIR", help="folder for report.html and the PNGs (default: RUN_DIR/report)")
    namespace = parser.parse_args(argv)
    from covey.telemetry.report import write_report

    page = write_report(namespace.run_dir, namespace.out)
    print(f"report: {page}")
    return 0


def cmd_diagnose(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="covey diagnose", allow_abbrev=False,
        description="Run covey's health rules (reward hacking, collapse, a run not learning) over a finished or "
                    "running run folder: covey's (metrics.jsonl) or TRL's (trainer_state.json). Prints one verdict "
                    "(learning, not learning, gaming the reward, collapsed) and the evidence behind it. Exit "
                    "status: 0 learning, 1 any other verdict.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a covey run folder or a TRL output_dir")
    parser.add_argument("--html", action="store_true", help="also write the report (covey report; a TRL folder: a "
                        "page of the diagnosis alone) with the diagnosis in it")
    parser.add_argument("--out", metavar="DIR", help="folder of the --html page (default: RUN_DIR/report)")
    parser.add_argument("--json", action="store_true", help="print the verdict and findings as JSON")
    namespace = parser.parse_args(argv)
    import json

    from covey.telemetry.diagnose import LEARNING, diagnose, read_run, standalone_page

    run = read_run(namespace.run_dir)
    diagnosis = diagnose(run)
    if namespace.json:
        print(json.dumps({"verdict": diagnosis.verdict, "reason": diagnosis.reason, "source": run.source,
                          "findings": [{"warned_at": step, "key": f.key, "kind": f.kind, "began": f.began,
                                        "message": f.message, "advice": f.advice, "values": f.values,
                                        "examples": list(f.examples)} for step, f in diagnosis.findings],
                          "warnings": [{"step": step, "message": m} for step, m in diagnosis.warnings],
                          "contradicted": diagnosis.contradicted, "notes": diagnosis.notes}, indent=2))
    else:
        print(f"{run.folder} ({run.source} run, {len(run.history)} logged steps)\n{diagnosis.text()}")
    if namespace.html:
        if run.source == "covey":
            from covey.telemetry.report import write_report

            page = write_report(namespace.run_dir, namespace.out)
        else:
            page = standalone_page(run, diagnosis, Path(namespace.out or Path(namespace.run_dir) / "report"))
        print(f"report: {page}", file=sys.stderr if namespace.json else sys.stdout)
    return 0 if diagnosis.verdict == LEARNING else 1


def cmd_compare(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="covey compare", allow_abbrev=False,
        description="Overlay one metric of several runs in one plot (PNG).")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="two or more run folders")
    parser.add_argument("--metric", default="reward", help="a key of metrics.jsonl (default: reward)")
    parser.add_argument("--out", metavar="FILE", help="the PNG to write (default: compare-<metric>.png here)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    namespace = parser.parse_args(argv)
    from covey.telemetry.report import compare_file_name, compare_runs

    if len(namespace.run_dirs) < 2:
        raise ConfigError("covey compare needs at least two run folders (covey report shows one run)")
    out = Path(namespace.out or compare_file_name(namespace.metric))
    _check_output_file("--out", out, namespace.overwrite)
    print(f"plot: {compare_runs(namespace.run_dirs, out, namespace.metric)}")
    return 0


def cmd_export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="covey export", allow_abbrev=False,
        description="Write a trained policy as a plain Hugging Face model with its tokenizer, a LoRA adapter merged "
                    "into its base weights, in a new folder that transformers.pipeline('text-generation', ...) loads.")
    parser.add_argument("source", metavar="SOURCE", help="a run folder (its final_model/), a checkpoint folder (its "
                        "model/), or any model: a folder, a saved adapter, a hub id")
    parser.add_argument("out", metavar="OUT", help="the folder to write (it must not exist)")
    parser.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code (hub models)")
    namespace = parser.parse_args(argv)
    from covey.train.export import export_model

    out = export_model(namespace.source, namespace.out, namespace.dtype, namespace.trust_remote_code)
    print(f"exported to {out}: load it with transformers.pipeline('text-generation', model={str(out)!r})")
    return 0


def cmd_plan(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="covey plan", allow_abbrev=False,
        description="Estimate the peak memory of a training step per device from the model's config and tokenizer "
                    "and the prompts' measured lengths (no weights are loaded): weights, gradients, optimizer state, "
                    "activations, the log-prob pass, the "
                    "reference and the engine; whether it fits this machine's GPU (or RAM), and settings that would "
                    "make it fit. covey train checks the same estimate before loading the model.")
    parser.add_argument("--processes", type=int, help="processes the run is launched with (default: WORLD_SIZE, or 1)")
    parser.add_argument("--probe", action="store_true",
                        help="also train one real step (loading the model) and give its time, its measured peak and "
                             "the whole run's expected wall time")
    _add_config_options(parser)
    namespace, overrides = _parse(parser, argv)
    if namespace.processes is not None and namespace.processes < 1:
        raise ConfigError("--processes must be at least 1")
    if namespace.probe and (namespace.processes or 1) > 1:
        raise ConfigError("--probe trains one step in this one process; leave --processes out to probe")
    args = _load_config(namespace.config, overrides)
    from covey.plan import make_plan
    from covey.plan.advice import advice
    from covey.plan.report import plan_text

    plan = make_plan(args, namespace.processes)
    print(plan_text(plan, None if plan.fits else advice(plan)))
    if namespace.probe:
        from covey.train.probe import probe, probe_text

        print()
        print(probe_text(plan, probe(args)))
    return 0


def cmd_server(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="covey server", allow_abbrev=False,
        description="A rollout server for trainers run with rollout_engine: vllm and vllm_mode: server. With "
                    "--backend vllm it starts vLLM's own server (vllm serve) with the settings covey needs; with "
                    "--backend fast it serves covey's fast engine behind the same endpoints (any machine). Give it "
                    "the run's config; the trainer pushes its weights before each round that follows optimizer "
                    "steps. With COVEY_SERVER_TOKEN set in the environment, only trainers with the same value are "
                    "served.")
    parser.add_argument("--backend", choices=("vllm", "fast"), default="vllm",
                        help="engine behind the server (default: vllm; fast runs anywhere, e.g. to try the setup)")
    parser.add_argument("--host", help="address to listen on (default: vllm_server_host where the config sets it, "
                                       "else 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to listen on (default: vllm_server_port)")
    parser.add_argument("--insecure", action="store_true",
                        help="listen beyond this machine where the weight endpoints are open (without "
                             "COVEY_SERVER_TOKEN for fast; always for vllm, whose --api-key leaves them open)")
    _add_config_options(parser)
    namespace, overrides = _parse(parser, argv)
    args = _load_config(namespace.config, overrides)
    from covey.rollout.server import run_server
    from covey.train.setup import server_backend, vllm_serve

    # the trainers' default, TRL's 0.0.0.0, reaches this machine; a server listens there only when told to
    host = namespace.host or (args.vllm_server_host if "vllm_server_host" in args.fields_given else "127.0.0.1")
    port = args.vllm_server_port if namespace.port is None else namespace.port
    if namespace.backend == "fast":
        return run_server(lambda: server_backend(args), f"the fast engine over {args.model}", host, port,
                          namespace.insecure)
    from covey.rollout.wire import is_loopback

    if not is_loopback(host):  # refused or warned before vLLM is even imported
        if not namespace.insecure:
            raise ConfigError(f"covey server --backend vllm refuses to listen on {host}: vLLM's RL endpoints (which "
                              "replace the model's weights) are open to anyone who reaches the port, whatever "
                              "--api-key says. Listen on 127.0.0.1 and reach it through an SSH tunnel, or pass "
                              "--insecure on a network only you use")
        print(f"covey server: warning: listening on {host} (--insecure): anyone who can reach this port can replace "
              "the model's weights", file=sys.stderr, flush=True)
    serve = vllm_serve(args, host, port)
    print("covey server: " + " ".join(shlex.quote(a) for a in serve.argv) + "  (with "
          + ", ".join(f"{k}=..." if k == "VLLM_API_KEY" else f"{k}={v}" for k, v in serve.env.items()) + ")",
          file=sys.stderr, flush=True)
    os.execve(serve.argv[0], serve.argv, {**os.environ, **serve.env})


def cmd_env(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="covey env", allow_abbrev=False,
        description="Print what covey runs on, to paste into a bug report: the versions of covey, Python, torch and "
                    "the libraries it uses, the CPU and its features, whether covey's decode kernel runs here, the "
                    "devices and their memory, and the settings read from the environment.")
    parser.parse_args(argv)
    import covey
    from covey.rollout.fast import decode_kernel
    from covey.telemetry.environment import format_report, report

    here = f"{covey.__version__} ({Path(covey.__file__).parent})"
    sys.stdout.write(format_report(report(here, decode_kernel.describe())))
    return 0


COMMANDS = {"train": cmd_train, "eval": cmd_eval, "verify": cmd_verify, "generate": cmd_generate,
            "report": cmd_report, "diagnose": cmd_diagnose, "compare": cmd_compare, "export": cmd_export,
            "server": cmd_server, "env": cmd_env, "plan": cmd_plan}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["--version"], ["-V"]):
        import covey

        print(f"covey {covey.__version__}")
        return 0
    argv = _plain_option(argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"covey: unknown command {argv[0]!r}", file=sys.stderr)
        print("usage: covey {train,eval,verify,generate} [CONFIG] [--field value ...]   "
              "(covey train --help lists the fields)\n"
              "       covey plan [CONFIG] [--processes N] [--probe] [--field value ...]\n"
              "       covey report RUN_DIR [--out DIR]\n"
              "       covey diagnose RUN_DIR [--html] [--out DIR] [--json]\n"
              "       covey compare RUN_DIR RUN_DIR ... [--metric NAME] [--out FILE.png] [--overwrite]\n"
              "       covey export SOURCE OUT [--dtype float32|bfloat16|float16]\n"
              "       covey server [CONFIG] [--backend vllm|fast] [--host H] [--port P] [--field value ...]\n"
              "       covey env | covey --version\n"
              "--plain (before or after the command): tables as plain lines, one row per line (so too where the "
              "output is not a terminal); covey verify --json FILE: the checks as data (docs/verify.md)",
              file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        if argv[0] != "train" and World.launched_size() > 1:
            raise ConfigError(f"covey {argv[0]} runs in a single process; of the commands only covey train runs "
                              "under a launcher (torchrun, accelerate launch): run this one without it")
        return COMMANDS[argv[0]](argv[1:])
    except TrainingInterrupted as e:
        print(f"{_name()}: {e}", file=sys.stderr)
        return 128 + e.signal_number
    except CoveyError as e:
        print(f"{_name()}: error: {e}", file=sys.stderr)
        return 2


def _plain_option(argv: list[str]) -> list[str]:
    """argv without --plain (given before the command, or among its options up to a TRL script's own
    arguments), which it turns into COVEY_PLAIN=1 for this process and those it starts."""
    cut = argv.index("--trl") if "--trl" in argv else len(argv)
    if "--plain" not in argv[:cut]:
        return argv
    os.environ[PLAIN_VARIABLE] = "1"
    return [a for a in argv[:cut] if a != "--plain"] + argv[cut:]


def _name() -> str:
    """How messages are signed: with the process's rank under a launcher, as every process prints its own."""
    return f"covey[{os.environ.get('RANK', '0')}]" if World.launched_size() > 1 else "covey"


if __name__ == "__main__":
    sys.exit(main())
