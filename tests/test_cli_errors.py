"""Every mistake a user can make ends in one sentence on stderr and exit code 2, before compiling."""

import subprocess
import sys

import pytest

from jaxpar.cli import main

# case -> (arguments, where {tmp} is a scratch folder; words the error must contain)
BAD_INPUTS = {
    "mesh product": (["mesh.data=3", "mesh.tensor=2"], "multiply to 6 but there are 8 devices"),
    "tensor does not divide devices": (["mesh.tensor=3"], "does not divide the 8 devices"),
    "heads": (["mesh.data=2", "mesh.tensor=4", "model.n_heads=2", "model.d_model=64"],
              "model.n_heads=2 is not divisible by mesh.tensor=4"),
    "odd head size with rope": (["model.d_model=129", "model.n_heads=3"], "rotary positions need an even head size"),
    "d_ff": (["mesh.data=4", "mesh.tensor=2", "model.d_ff=513"], "model.d_ff=513 is not divisible by mesh.tensor=2"),
    "vocab": (["mesh.data=4", "mesh.tensor=2", "model.vocab_size=257"],
              "model.vocab_size=257 is not divisible by mesh.tensor=2"),
    "batch": (["mesh.data=8", "train.batch_size=12"], "train.batch_size=12 is not divisible"),
    "batch with accumulation": (["mesh.data=8", "train.batch_size=32", "train.grad_accum=8"],
                                "is not divisible by mesh.data x mesh.expert x train.grad_accum"),
    "unknown key": (["model.d_modle=64"], "did you mean 'model.d_model'"),
    "offloaded activations with sqrt remat": (["train.offload=activations", "train.remat=sqrt"],
                                              "train.remat=sqrt keeps segment inputs instead"),
    "offloaded activations in a pipeline": (["mesh.data=4", "mesh.tensor=1", "mesh.stage=2",
                                             "train.offload=activations"], "does not combine with mesh.stage > 1"),
    "local SGD without replicas": (["mesh.data=1", "mesh.tensor=1", "mesh.expert=8", "parallel.sync_every=4"],
                                   "needs data-parallel replicas: mesh.data > 1"),
    "local SGD with ZeRO": (["parallel.sync_every=4", "parallel.zero=1"], "does not combine with parallel.zero"),
    "sync_every zero": (["parallel.sync_every=0"], "parallel.sync_every must be 1 (synchronous) or more, got 0."),
    "outer momentum": (["parallel.sync_every=4", "parallel.outer_momentum=1"], "parallel.outer_momentum in [0, 1)"),
    "wrong type": (["train.steps=many"], "train.steps expects an integer"),
    "missing data file": (["data.source={tmp}/missing.txt"], "does not exist"),
    "missing config file": (["{tmp}/nope.yaml"], "does not exist"),
    "empty corpus": (["data.source={tmp}/empty.txt"], "too few for windows"),
    "short corpus": (["data.source={tmp}/short.txt"], "too few for windows"),
    "bad token file": (["data.source={tmp}/odd.bin"], "odd byte count"),
    "too many devices": (["run.devices=64"], "only 8 cpu devices exist"),
    "no devices": (["run.devices=0"], "run.devices must be 'auto' or a positive number, got 0."),
    "layers not divisible by stages": (["mesh.data=2", "mesh.stage=4", "model.n_layers=6"],
                                       "model.n_layers=6 is not divisible by mesh.stage x virtual stages"),
    "layers not divisible by virtual stages": (
        ["mesh.data=4", "mesh.stage=2", "parallel.pipeline.schedule=interleaved", "parallel.pipeline.virtual=4"],
        "is not divisible by mesh.stage x virtual"),
    "naive with microbatches": (["mesh.data=2", "mesh.stage=4", "parallel.pipeline.schedule=naive"],
                                "no microbatches: set parallel.pipeline.microbatches=1 (got 4)."),
    "1f1b with fewer microbatches than stages": (["mesh.data=2", "mesh.stage=4", "parallel.pipeline.microbatches=2"],
                                                 "needs at least as many microbatches as stages"),
    "batch not divisible by microbatches x data": (["mesh.data=4", "mesh.stage=2", "parallel.pipeline.microbatches=16"],
                                                   "is not divisible by mesh.data x mesh.expert x parallel.pipeline"),
    "experts not divisible by the expert axis": (["mesh.data=2", "mesh.expert=4", "model.moe.experts=6"],
                                                 "model.moe.experts=6 is not divisible by mesh.expert=4"),
    "top_k above experts": (["model.moe.experts=4", "model.moe.router=topk", "model.moe.top_k=5"],
                            "model.moe.top_k=5 must be between 1 and model.moe.experts=4"),
    "capacity factor not positive": (["model.moe.experts=4", "model.moe.capacity_factor=0"],
                                     "model.moe.capacity_factor must be positive"),
    "group size not dividing tokens per device": (["model.moe.experts=4", "model.moe.group_size=100"],
                                                  "model.moe.group_size=100 does not divide the 512 tokens per device"),
    "bias balancing with switch": (
        ["model.moe.experts=4", "model.moe.router=switch", "model.moe.balance=bias"],
        "model.moe.balance=bias needs model.moe.router=topk or dropless, but the router is switch"),
    "sigmoid scores with expert choice": (["model.moe.experts=4", "model.moe.router=expert_choice",
                                           "model.moe.score=sigmoid"],
                                          "model.moe.score=sigmoid needs model.moe.router=topk or dropless"),
    "expert width not divisible by tensor": (
        ["mesh.data=4", "mesh.tensor=2", "model.moe.experts=4", "model.moe.d_ff=63"],
        "the experts' width 63 (model.moe.d_ff, or model.d_ff when 0) is not divisible by mesh.tensor=2"),
    "negative shared experts": (["model.moe.experts=4", "model.moe.shared=-1"],
                                "model.moe.shared must be 0 or positive, got -1."),
    "virtual without interleaving": (["parallel.pipeline.virtual=2"], "needs parallel.pipeline.schedule=interleaved"),
    "accumulation with pipelining": (["mesh.data=4", "mesh.stage=2", "train.grad_accum=2"],
                                     "use parallel.pipeline.microbatches instead of train.grad_accum"),
    "zero 2 with interleaved stages": (["mesh.data=4", "mesh.stage=2", "parallel.pipeline.schedule=interleaved",
                                        "parallel.pipeline.virtual=2", "parallel.zero=2"],
                                       "parallel.zero=2 with interleaved stages is not supported; use zero 1 or 3."),
    "zbv with one layer per stage": (["mesh.data=2", "mesh.stage=4", "parallel.pipeline.schedule=zbv"],
                                     "the zbv schedule runs two chunks of layers on each stage: model.n_layers=4 "
                                     "is not divisible by 2 x mesh.stage = 8."),
    "zbv with fewer microbatches than stages": (
        ["mesh.data=2", "mesh.stage=4", "model.n_layers=8", "parallel.pipeline.schedule=zbv",
         "parallel.pipeline.microbatches=2"], "the zbv schedule needs at least as many microbatches as stages"),
    "recompute with a zero-bubble schedule": (
        ["mesh.data=4", "mesh.stage=2", "parallel.pipeline.schedule=zb-h1", "parallel.pipeline.recompute=true"],
        "parallel.pipeline.recompute=true is for 1F1B-type schedules; zb-h1 keeps"),
    "2bw with fp16": (["mesh.data=4", "mesh.stage=2", "parallel.pipeline.schedule=2bw", "train.precision=fp16"],
                      "2bw starts each step's microbatches before the previous step's gradient is checked"),
    "2bw with zero 2": (["mesh.data=4", "mesh.stage=2", "parallel.pipeline.schedule=2bw", "parallel.zero=2"],
                        "a 2bw step runs two; use parallel.zero=1 or 3."),
    "2bw with grpo": (["mesh.data=4", "mesh.stage=2", "parallel.pipeline.schedule=2bw", "train.objective=grpo",
                       "data.source=configs/grpo_numbers.jsonl"], "under 2bw trail the batches by a step"),
    "zero 2 with zbv": (["mesh.data=4", "mesh.stage=2", "parallel.pipeline.schedule=zbv", "parallel.zero=2"],
                        "parallel.zero=2 with zbv is not supported; use zero 1 or 3."),
    "negative seed": (["train.seed=-1"], "train.seed must be between 0 and 2**63 - 1, got -1."),
    "non-finite learning rate": (["train.lr=nan"], "train.lr must be a finite number, got nan."),
    "empty data source": (["data.source="], "data.source must be a non-empty path"),
    "kv heads not dividing heads": (["model.n_kv_heads=3"], "model.n_kv_heads=3 must divide model.n_heads=4"),
    "cudnn attention on cpu": (["model.attention=cudnn", "train.precision=bf16"],
                               "model.attention=cudnn needs an NVIDIA GPU, but the devices are cpu"),
    "cudnn attention in fp32": (["model.attention=cudnn"],
                                "model.attention=cudnn needs train.precision=bf16 or fp16"),
    "flash block not dividing seq_len": (["model.attention=flash", "model.seq_len=96", "model.flash_block_q=64"],
                                         "model.flash_block_q=64 does not divide model.seq_len=96"),
    "sequence with seq_len not divisible by tensor": (
        ["mesh.data=2", "mesh.tensor=4", "parallel.sequence=true", "model.seq_len=126"],
        "parallel.sequence=true splits model.seq_len=126 over mesh.tensor=4, which does not divide it"),
    "sequence with kv heads not divisible by tensor": (
        ["mesh.data=2", "mesh.tensor=4", "parallel.sequence=true", "model.n_kv_heads=2"],
        "parallel.sequence=true needs the 2 key/value heads (model.n_kv_heads) to be divisible by mesh.tensor=4"),
    "loss chunks not dividing seq_len": (["train.loss_chunks=3"],
                                         "train.loss_chunks=3 must be 0 (automatic) or divide model.seq_len=128."),
    "loss chunks not splitting over tensor": (
        ["mesh.data=2", "mesh.tensor=4", "parallel.sequence=true", "train.loss_chunks=64"],
        "or divide model.seq_len=128 into chunks divisible by mesh.tensor=4 (sequence parallelism)."),
    "context chunks not dividing seq_len": (["mesh.context=8", "model.seq_len=120"],
                                            "mesh.context=8 cuts model.seq_len=120 into 16 chunks (balanced: 2 x "
                                            "context), which do not divide it."),
    "cudnn attention across context": (["mesh.context=2", "model.attention=cudnn", "train.precision=bf16"],
                                       "model.attention=cudnn cannot run across mesh.context=2"),
    "context ring with pipeline stages": (["mesh.data=2", "mesh.context=2", "mesh.stage=2"],
                                          "mesh.context with pipeline stages runs only with "
                                          "parallel.context_attention=allgather"),
    "balanced context with MoE": (["mesh.context=2", "model.moe.experts=4"],
                                  "set parallel.context_balance=false with model.moe.experts."),
}


# `jaxpar plan` works from shapes and reads no data: a cluster's corpus need not be on the laptop that plans
DATA_CASES = {"missing data file", "empty corpus", "short corpus", "bad token file"}


@pytest.mark.parametrize(("command", "case"), [(command, case) for case in BAD_INPUTS
                                               for command in ("train", "verify", "plan")
                                               if not (command == "plan" and case in DATA_CASES)])
def test_bad_input_exits_2_with_one_sentence(case, command, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "short.txt").write_text("just a few words of text")
    (tmp_path / "odd.bin").write_bytes(b"abc")
    args, message = BAD_INPUTS[case]
    run_dir = tmp_path / "run"
    code = main([command, f"run.dir={run_dir}", *(a.format(tmp=tmp_path) for a in args)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert message in err
    assert len(err.splitlines()) == 1 and err.startswith("jaxpar: error: ") and err.endswith((".", "?"))
    assert not run_dir.exists(), "nothing may be written for a rejected config"


# the flags of `jaxpar schedule` and `jaxpar launch` -> the whole sentence
BAD_FLAGS = {
    "unknown schedule": (["schedule", "--schedule", "zigzag", "--stages", "4", "--microbatches", "8"],
                         "--schedule must be one of naive, gpipe, 1f1b, interleaved, 2bw, zb-h1, zbv, got 'zigzag'."),
    "no stages": (["schedule", "--schedule", "gpipe", "--stages", "0", "--microbatches", "8"],
                  "--stages, --microbatches and --virtual must be positive."),
    "virtual without interleaving": (["schedule", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8",
                                      "--virtual", "2"], "--virtual 2 needs --schedule interleaved."),
    "interleaved microbatches": (["schedule", "--schedule", "interleaved", "--stages", "4", "--microbatches", "6",
                                  "--virtual", "2"],
                                 "interleaved 1F1B needs --microbatches to be a multiple of --stages (4)."),
    "naive microbatches": (["schedule", "--schedule", "naive", "--stages", "4", "--microbatches", "8"],
                           "the naive schedule runs one batch through the stages, no microbatches: give "
                           "--microbatches 1 (got 8)."),
    "zbv microbatches": (["schedule", "--schedule", "zbv", "--stages", "4", "--microbatches", "3"],
                         "the zbv schedule needs at least as many microbatches as stages, got --microbatches 3 < "
                         "--stages 4."),
    "costs": (["schedule", "--schedule", "zb-h1", "--stages", "4", "--microbatches", "8", "--costs", "1,2"],
              "--costs must be three non-negative numbers F,B,W with F + B > 0, got '1,2'."),
    "no processes": (["launch", "--processes", "0", "--", "train"], "--processes must be positive, got 0."),
    "no devices per process": (["launch", "--processes", "2", "--devices-per-process", "0", "--", "train"],
                               "--devices-per-process must be positive, got 0."),
    "nothing to launch": (["launch", "--processes", "2"], "give the jaxpar command to run after '--', e.g. "
                                                         "'jaxpar launch --processes 2 -- train mesh.tensor=4'."),
    "restarts without checkpoints": (["launch", "--processes", "2", "--restarts", "3", "--", "train"],
                                     "--restarts 3 goes on from the last checkpoint, but checkpoint.every=0 writes "
                                     "none; set checkpoint.every=N (saves are asynchronous, so a small N costs "
                                     "little)."),
    "elastic batch that cannot be kept": (
        ["launch", "--processes", "3", "--devices-per-process", "2", "--restarts", "1", "--elastic", "--", "train",
         "train.batch_size=12", "checkpoint.every=5"],
        "an elastic run cannot keep train.batch_size=12 on 4 devices: its 2 rows per device do not divide it over "
        "data=4; choose a batch size they divide on every device count the run may have."),
    "elastic flags without --elastic": (["launch", "--processes", "2", "--restarts", "1", "--min-processes", "1", "--",
                                         "train", "checkpoint.every=5"],
                                        "--min-processes leaves processes out of a run and takes them back; add "
                                        "--elastic."),
}


@pytest.mark.parametrize("case", list(BAD_FLAGS))
def test_bad_schedule_or_launch_flags_exit_2_with_one_sentence(case, capsys):
    args, sentence = BAD_FLAGS[case]
    assert main(args) == 2
    assert capsys.readouterr().err.strip() == f"jaxpar: error: {sentence}"


def test_console_script_error_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "jaxpar", "train", "mesh.tensor=3", f"run.dir={tmp_path}/r"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "jaxpar: error: the fixed mesh axes (mesh.tensor=3) multiply to 3, which does not divide the 8 devices."]
