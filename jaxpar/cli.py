"""The `jaxpar` command line: train, verify, plan, schedule, tokenize, export-hf, generate, eval and launch.

User mistakes (config, devices, data, a checkpoint that does not fit the config) end in one
sentence on stderr and exit code 2, before anything is compiled. A training run whose loss
stops being finite, or whose checkpoint cannot be restored although it is not damaged, ends
in one sentence and exit code 1. In a multi-process run, a process that loses a peer, or
whose coordinator stops answering, ends in one sentence naming it and exit code 3.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from jaxpar.config import ConfigError, flatten_dict
from jaxpar.config.presets import load_config, parse_override
from jaxpar.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, RunFailed, UserError


def _split_args(args: list[str]) -> tuple[str | None, list[str]]:
    configs = [a for a in args if a.endswith((".yaml", ".yml")) and "=" not in a]
    if len(configs) > 1:
        raise ConfigError(f"give at most one config file, got {', '.join(map(repr, configs))}.")
    return (configs[0] if configs else None), [a for a in args if a not in configs]


def _load(args: list[str], extra: dict | None = None):
    path, overrides = _split_args(args)
    cfg = load_config(path, overrides)
    return cfg.replace(**extra) if extra else cfg


def cmd_train(args: argparse.Namespace) -> int:
    started = time.time()  # the process's start, for goodput: device setup and restore are part of a (re)start
    cfg = _load(args.settings, {"run.elastic": True} if args.elastic else None)
    if cfg.run.elastic:  # the devices first, then the layout for them
        from jaxpar.plan.replan import prepare_elastic as prepare
    else:
        from jaxpar.train.run_session import prepare
    session = prepare(cfg)
    from jaxpar.runtime.goodput import describe
    from jaxpar.train.loop import NonFiniteLoss, train

    try:
        summary = train(session, progress=not args.no_progress, started=started)
    except NonFiniteLoss as e:
        # Not a config mistake: the run diverged, so exit 1 rather than 2.
        print(f"jaxpar: {e}", file=sys.stderr)
        return EXIT_FAILED
    if "preempted" in summary:
        return 0  # the loop has said where the checkpoint is
    from jaxpar.runtime import distributed

    if distributed.is_secondary():
        return 0  # process 0 reports for the whole run
    if "final_reward" in summary:  # GRPO: the reward is the measure, and no windows are held out
        print(f"\nmean reward {summary['final_reward']:.3f} at the last step (first step "
              f"{summary['first_reward']:.3f}), sampling {summary['generate_share']:.0%} of the time, "
              f"{describe(summary['goodput'])}")
    elif summary["final_loss"] is not None:
        mfu = "" if summary.get("mfu") is None else f", MFU {summary['mfu']:.1%} ({summary['peak_source']})"
        print(f"\nfinal train loss {summary['final_loss']:.4f} (first step {summary['first_loss']:.4f}), "
              f"validation loss {summary['val_loss']:.4f}, {summary['tokens_per_s_median']:.0f} tokens/s (median)"
              f"{mfu}, {describe(summary['goodput'])}")
    else:
        print(f"\nvalidation loss {summary['val_loss']:.4f}")
    if summary["sample"] is not None:
        print(f"sample: {summary['sample']!r}")
    board = ", tensorboard/" if session.cfg.run.tensorboard else ""
    print(f"outputs in {session.cfg.run.dir}/: metrics.jsonl, summary.json, loss.png{board}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from jaxpar.verify.run import DEFAULT_STEPS

    _, overrides = _split_args(args.settings)
    steps_given = any(o.split("=", 1)[0].strip() == "train.steps" for o in overrides)
    cfg = _load(args.settings, None if steps_given else {"train.steps": DEFAULT_STEPS})
    from jaxpar.train.run_session import prepare

    session = prepare(cfg)
    from jaxpar.runtime import distributed
    from jaxpar.verify.run import verify

    primary = not distributed.is_secondary()  # process 0 reports for a multi-process run
    result = verify(session, log=lambda line: print(line, file=sys.stderr) if primary else None)
    if primary:
        print(json.dumps(result))
    return 0 if result["ok"] else 1


def cmd_plan(args: argparse.Namespace) -> int:
    if not args.search and (args.memory_gb is not None or args.top is not None or args.processes):
        raise ConfigError("--memory-gb, --top and --processes belong to a layout search; add --search.")
    if args.hosts != 1 and not args.target:
        raise ConfigError("--hosts counts the hosts of GPUs that plan --target compiles for; add --target.")
    if args.target and not args.search:  # XLA:CPU's plan beside XLA:GPU's, compiled here without a GPU
        from jaxpar.plan.gpu_plan import plan_on_target
        return plan_on_target(_load(args.settings), args.target, args.hosts, args.hardware)
    if args.search:
        return _plan_search(args)
    from jaxpar.runtime.devices import setup_devices
    from jaxpar.session import on_devices

    cfg = _load(args.settings)
    session = on_devices(cfg, setup_devices(cfg))  # shapes only: no data is read, so any seq_len plans
    from jaxpar.plan.memory import format_report
    from jaxpar.plan.step_plan import plan_of, predicted

    plan, trainer = plan_of(session)
    if args.hardware:
        plan["predicted"] = predicted(plan, trainer, args.hardware, session.devices)
    from jaxpar.runtime import distributed

    if not distributed.is_secondary():  # per-device figures: every process compiled the same program
        print(format_report(plan))
        print(json.dumps({k: v for k, v in plan.items() if k != "collective_ops"}))
    return 0


def _plan_search(args: argparse.Namespace) -> int:
    from jaxpar.features import MESH_KEYS, SEARCHED_KEYS
    from jaxpar.runtime import distributed

    if distributed.from_environment() is not None:
        raise ConfigError("plan --search compiles every layout in one process; run it outside jaxpar launch.")
    if args.memory_gb is not None and not args.memory_gb > 0:
        raise ConfigError(f"--memory-gb must be positive, got {args.memory_gb:g}.")
    if args.processes < 0:
        raise ConfigError(f"--processes must be 0 (automatic) or more, got {args.processes}.")
    if args.top is not None and args.top < 1:
        raise ConfigError(f"--top must be at least 1, got {args.top}.")
    path, overrides = _split_args(args.settings)
    cfg = _load(args.settings)
    given = {key for key, _ in map(parse_override, overrides)}
    flat = flatten_dict(cfg.to_dict())
    fixed = {k: flat[k] for k in SEARCHED_KEYS if k in given and not (k in MESH_KEYS and flat[k] == -1)}
    if args.target:  # every layout compiled by XLA:GPU for the target, within one GPU's memory
        from jaxpar.plan.gpu_plan import search_devices
        cfg, devices, memory = search_devices(cfg, args.target, args.hosts, args.hardware)
    else:
        from jaxpar.runtime.devices import setup_devices
        devices, memory = setup_devices(cfg), None
    from jaxpar.config import precision
    from jaxpar.plan import search_report
    from jaxpar.plan.calibrate import profile
    from jaxpar.plan.search import search
    from jaxpar.runtime.hardware import PROFILES, for_device_kind
    from jaxpar.train.model_flops import flops_per_token

    name = args.hardware or args.target or ("cpu" if devices[0].platform == "cpu"
                                            else for_device_kind(devices[0].device_kind))
    if name is None:
        raise ConfigError(f"no hardware profile matches {devices[0].device_kind!r}; "
                          f"give --hardware (one of {', '.join(PROFILES)}).")
    hardware = profile(name, devices)
    budget = args.memory_gb * 1e9 if args.memory_gb is not None else memory or hardware.memory_bytes
    top = args.top or DEFAULT_TOP
    result = search(cfg, devices, hardware, budget, fixed, progress=not args.no_progress,
                    processes=args.processes or min(os.cpu_count() or 1, MAX_SEARCH_PROCESSES), top=top,
                    target=(args.target, len(devices), args.hosts) if args.target else None)
    best = search_report.best_overrides(result)
    print(search_report.table(result, top))
    settings = [*([path] if path else []), *(o for o in overrides if parse_override(o)[0] not in SEARCHED_KEYS)]
    print("train it: jaxpar train " + " ".join([*settings, *(f"{k}={v}" for k, v in best.items())]))
    per_step = flops_per_token(cfg) * cfg.train.batch_size * cfg.model.seq_len
    print(json.dumps(search_report.summary(result, best, per_step, precision.of(cfg).compute, len(devices))))
    return 0


def cmd_schedule(args: argparse.Namespace) -> int:
    from jaxpar.config.command_flags import check_schedule_flags
    from jaxpar.parallel.schedule_timing import Costs
    from jaxpar.parallel.schedules import SCHEDULES
    from jaxpar.plan.schedule_chart import chart_table, draw, run_summary, summary, text_chart

    costs = Costs(*check_schedule_flags(args.schedule, args.stages, args.microbatches, args.virtual, SCHEDULES,
                                        args.costs))
    table = chart_table(args.schedule, args.stages, args.microbatches, args.virtual)
    print(text_chart(table))
    if args.out:
        draw(table, args.out, costs)
        print(f"chart written to {args.out}")
    runs = run_summary(args.stages, args.microbatches, args.steps) if args.schedule == "2bw" else {}
    print(json.dumps({**summary(table, costs), **runs}))
    return 0


def cmd_tokenize(args: argparse.Namespace) -> int:
    from jaxpar.tokenize.command import run_tokenize

    return run_tokenize(args)


def cmd_export_hf(args: argparse.Namespace) -> int:
    from jaxpar.interop.hf import export_run

    result = export_run(args.run_dir, args.out, args.step, args.dtype, progress=not args.no_progress,
                        adapter=args.adapter, merge=args.merge)
    if args.adapter:
        print(f"step {result['step']} of {args.run_dir}: its LoRA adapters written to {args.out}/ as peft stores "
              f"them: {', '.join(result['files'])}")
    else:
        print(f"step {result['step']} of {args.run_dir} written to {args.out}/ as a {result['family']} checkpoint "
              f"({result['dtype']}{', adapters merged' if args.merge else ''}): {', '.join(result['files'])}")
    print(json.dumps(result))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from jaxpar.sampling.choice import Sampling
    from jaxpar.sampling.command import check_flags, generate

    check_flags(args)
    if args.prompts is None:
        result = generate(args.source, args.prompt, args.tokens, args.temperature, args.seed, args.step)
        print(result["text"])
        print(f"{result['new_tokens']} new tokens after {result['prompt_tokens']} of prompt, "
              f"{result['tokens_per_s']:.1f} tokens/s", file=sys.stderr)
        return 0
    from jaxpar.sampling.from_files import Request, generate_file

    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    request = Request(args.prompts, args.out, args.batch, args.tokens, sampling, args.step)
    result = generate_file(args.source, request, args.settings, progress=not args.no_progress)
    print(f"{result['prompts']} completions ({result['new_tokens']} new tokens) in {result['out']}, "
          f"{result['tokens_per_s']:.1f} tokens/s on {result['layout']}", file=sys.stderr)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from jaxpar.features.evals import lm_eval_missing

    if missing := lm_eval_missing("jaxpar eval"):
        raise UserError(missing)
    from jaxpar.evals.command import run_command

    return run_command(args)


def cmd_launch(args: argparse.Namespace) -> int:
    from jaxpar.config.command_flags import check_launch_flags
    from jaxpar.runtime.elastic import check_restart_flags
    from jaxpar.runtime.launch import launch

    command = args.command_args[1:] if args.command_args[:1] == ["--"] else args.command_args
    check_launch_flags(args.processes, args.devices_per_process, command)
    cfg = _load([a for a in command[1:] if not a.startswith("--")]) if command[0] == "train" else None
    check_restart_flags(args.restarts, args.elastic, args.min_processes, args.regrow_after, args.health_check,
                        args.backoff, args.processes, args.devices_per_process, command, cfg)
    if not args.restarts:
        return launch(args.processes, command, args.devices_per_process, args.grace, args.verbose)
    from pathlib import Path

    from jaxpar.runtime.supervisor import Policy, Supervisor

    policy = Policy(args.restarts, args.backoff, args.elastic, args.min_processes or 1, args.regrow_after,
                    args.health_check)
    command = [*command, "run.elastic=true"] if args.elastic else command
    return Supervisor(policy, args.processes, command, args.devices_per_process, args.grace, args.verbose,
                      Path(cfg.run.dir)).run()


MAX_SEARCH_PROCESSES = 4  # each compiling process holds its own jax and XLA (about 1 GB)
DEFAULT_TOP = 10  # rows of plan --search's table, and the rank a ladder must be able to reach
SETTINGS_HELP = "an optional CONFIG.yaml followed by key=value overrides (e.g. mesh.tensor=2)"


def _add_command(sub, name: str, run, help: str, reads_config: bool = False, **options) -> argparse.ArgumentParser:
    """The subcommand `name`, which `run`s; one that reads a config takes its settings as arguments."""
    p = sub.add_parser(name, help=help, **options)
    if reads_config:
        p.add_argument("settings", nargs="*", help=SETTINGS_HELP)
    p.set_defaults(run=run)
    return p


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for all subcommands."""
    from jaxpar.config import command_flags

    parser = argparse.ArgumentParser(prog="jaxpar", description="Train transformer LMs across many devices with JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = _add_command(sub, "train", cmd_train, "train a model and write metrics, summary, plot and a sample",
                     reads_config=True)
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--elastic", action="store_true", help="run.elastic=true: on another device count than the "
                                                          "checkpoint's, re-plan the layout and keep the global batch")
    _add_plan(sub)
    p = _add_command(sub, "schedule", cmd_schedule, "draw a pipeline schedule and print its idle fraction")
    p.add_argument("--schedule", required=True, help="naive, gpipe, 1f1b, interleaved, 2bw, zb-h1 or zbv")
    p.add_argument("--stages", type=int, required=True, help="pipeline stages S")
    p.add_argument("--microbatches", type=int, required=True, help="microbatches M per step")
    p.add_argument("--virtual", type=int, default=1, help="chunks per device v (interleaved)")
    p.add_argument("--costs", default="1,1,1", metavar="F,B,W",
                   help="what one chunk's forward, input backward and weight backward cost (a fused backward: B + W)")
    p.add_argument("--out", help="write the Gantt chart to this PNG")
    p.add_argument("--steps", type=int, default=10, help="2bw: the run's steps for its idle fraction (default 10)")
    _add_command(sub, "verify", cmd_verify, "compare a layout against the single-device reference", reads_config=True)
    p = _add_command(sub, "tokenize", cmd_tokenize, "train a byte-level BPE tokenizer (or apply one) and write token "
                                                    "shards for data.source")
    command_flags.add_tokenize_flags(p)
    export_hf = _add_command(sub, "export-hf", cmd_export_hf, "write a run's checkpoint as a Hugging Face checkpoint "
                             "(config.json, safetensors, tokenizer)")
    command_flags.add_export_flags(export_hf)
    command_flags.add_generate_flags(_add_command(sub, "generate", cmd_generate, "continue prompts with a trained or "
                                                  "imported model (key/value cache; greedy or sampled)"))
    command_flags.add_eval_flags(_add_command(sub, "eval", cmd_eval, "run lm-evaluation-harness tasks on a run's "
                                              "checkpoint or a Hugging Face checkpoint, on a layout"))
    p = _add_command(sub, "launch", cmd_launch, "run a jaxpar command as N local processes of one distributed run",
                     usage=f"jaxpar launch --processes N [--devices-per-process K] -- "
                           f"{'|'.join(command_flags.LAUNCHABLE_COMMANDS)} ...")
    _add_launch_flags(p)
    return parser


def _add_launch_flags(p: argparse.ArgumentParser) -> None:
    """`jaxpar launch`: the processes, their devices and their supervision."""
    from jaxpar.runtime.launch import DEFAULT_GRACE_S
    from jaxpar.runtime.supervisor import add_restart_flags

    p.add_argument("--processes", type=int, required=True, help="number of processes N")
    p.add_argument("--devices-per-process", type=int, help="devices per process K (emulated CPU devices, or GPUs)")
    p.add_argument("--grace", type=float, default=DEFAULT_GRACE_S,
                   help=f"seconds the others get to stop by themselves after one process fails "
                        f"(default {DEFAULT_GRACE_S:g})")
    p.add_argument("--verbose", action="store_true", help="also show the JAX runtime's own log lines")
    add_restart_flags(p)
    p.add_argument("command_args", nargs=argparse.REMAINDER, help="-- then the jaxpar command and its settings")


def _add_plan(sub) -> None:
    """`jaxpar plan` and its search."""
    from jaxpar.runtime.hardware import PROFILES

    p = _add_command(sub, "plan", cmd_plan, "compile the step and report per-device memory, FLOPs and collectives; "
                                            "--search ranks every layout by predicted step time", reads_config=True)
    p.add_argument("--search", action="store_true",
                   help="compile every valid layout of the model on these devices and rank them by predicted step "
                        "time within the memory budget")
    p.add_argument("--hardware", choices=PROFILES,
                   help="the hardware profile of the roofline (default: the devices' own; cpu is measured here "
                        "once and cached); without --search, adds the predicted step time to the plan")
    p.add_argument("--memory-gb", type=float, help="memory budget per device in GB (default: the profile's memory)")
    p.add_argument("--top", type=int, help=f"rows of the ranked table (default {DEFAULT_TOP})")
    p.add_argument("--processes", type=int, default=0,
                   help="processes compiling layouts at once "
                        f"(default 0: one per core, at most {MAX_SEARCH_PROCESSES})")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar of --search")
    from jaxpar.plan.gpu_target import add_target_flags
    add_target_flags(p)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `jaxpar` console script."""
    from jaxpar.runtime import distributed

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and getattr(args, "settings", None) is not None and all("=" in a and a[0] != "-" for a in extra):
        args.settings = [*args.settings, *extra]  # key=value overrides after the options
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        code = args.run(args)
    except UserError as e:
        distributed.abandon()
        if not distributed.is_secondary():  # every process finds the same mistake; process 0 says it once
            print(f"jaxpar: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except RunFailed as e:
        distributed.abandon()
        if not (e.everywhere and distributed.is_secondary()):
            print(f"jaxpar: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        distributed.abandon()
        print("jaxpar: interrupted.", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception:
        distributed.wait_for_lost_peer()  # a peer's death surfaces here as a failed collective
        distributed.abandon()
        raise
    distributed.finish()  # in a multi-process run: wait for the others before the watchdog stops
    return code


if __name__ == "__main__":
    sys.exit(main())
