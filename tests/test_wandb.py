"""run.wandb: an offline W&B run whose history holds every metrics.jsonl row with the same values, read
back from its .wandb file with wandb's own record type; resumes that continue one W&B run; and the
one-sentence errors for a missing package or login. Nothing here touches the network."""

import json
import struct
import zlib
from pathlib import Path

import pytest
from helpers import train_here

from jaxpar.config import Config

pytest.importorskip("wandb")

# The .wandb file is a LevelDB-style log: a 7-byte file header, then records cut into chunks that never
# cross a 32 KiB block, each chunk with a header of CRC-32 (of its type byte and data), length and type.
BLOCK, CHUNK_HEADER = 32768, 7
FULL, LAST = 1, 4
WANDB_OWN = {"_step", "_runtime", "_timestamp"}


@pytest.fixture(autouse=True)
def quiet_offline_wandb(monkeypatch, tmp_path):
    """W&B offline, its settings and caches in tmp_path, no login, no console capture, git or system stats."""
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off",
                        "WANDB_DISABLE_GIT": "true", "WANDB__DISABLE_STATS": "true", "HOME": str(tmp_path),
                        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
                        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
                        "WANDB_DATA_DIR": str(tmp_path / "wandb-data")}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def wandb_records(path: Path):
    """Each record of a .wandb file, as wandb's protobuf Record."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    position, chunks = 7, []
    while position + CHUNK_HEADER <= len(data):
        if BLOCK - position % BLOCK < CHUNK_HEADER:  # too little room left for a header: the block is padded
            position += BLOCK - position % BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[position:position + CHUNK_HEADER])
        if kind == 0:
            break  # zero padding at the end of the file
        chunk = data[position + CHUNK_HEADER:position + CHUNK_HEADER + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc
        position += CHUNK_HEADER + length
        chunks.append(chunk)
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            yield record


def read_offline_run(run_file: Path) -> tuple[dict[int, dict], dict, dict]:
    """(history by step, summary, config) of one offline run, values JSON-decoded."""
    history, summary, config = {}, {}, {}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.setdefault(items["_step"], {}).update(items)
        elif kind == "summary":
            summary.update({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.summary.update})
        elif kind == "run":
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
    return history, summary, config


def offline_runs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def as_logged(row: dict) -> dict:
    """A metrics.jsonl row as W&B history keys: per-expert lists as key/0, key/1, ...; flags as 0 or 1."""
    logged = {}
    for key, value in row.items():
        if isinstance(value, list):
            logged.update({f"{key}/{i}": v for i, v in enumerate(value)})
        elif key != "step":
            logged[key] = int(value) if isinstance(value, bool) else value
    return logged


@pytest.mark.slow
def test_offline_history_holds_every_metrics_row(tmp_path, capsys):
    run = tmp_path / "run"
    code, err = train_here(capsys, run, "train.steps=5", "train.eval_every=2", "run.wandb=true",
                           "run.wandb_mode=offline", "run.wandb_project=jaxpar-test")
    assert code == 0, err
    [run_file] = offline_runs(run)
    history, summary, config = read_offline_run(run_file)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == sorted(history) == [1, 2, 3, 4, 5]
    final = json.loads((run / "summary.json").read_text())
    for row in rows:
        logged = {k: v for k, v in history[row["step"]].items() if k not in WANDB_OWN}
        # the last row has no val_loss of its own (eval_every=2): the final validation adds it at its step
        extra = {"val_loss": final["val_loss"]} if row["step"] == 5 else {}
        assert logged == {**as_logged(row), **extra}
    assert config["model"]["d_model"] == 64 and config["train"]["steps"] == 5
    assert config["run"]["wandb_project"] == "jaxpar-test"
    assert summary["val_loss"] == final["val_loss"] and summary["steps"] == 5
    assert summary["goodput/goodput"] == final["goodput"]["goodput"]
    assert summary["machine/cores"] == final["machine"]["cores"] and summary["machine/line"].startswith(
        final["machine"]["processor"])
    assert not any(key == "config" or key.startswith("config/") for key in summary)


def writer_run(cfg: Config, run_dir: Path, start: int, steps: range, final_val: float | None = None) -> None:
    from jaxpar.train.wandb_writer import WandbWriter

    writer = WandbWriter(cfg, run_dir, start)
    for step in steps:
        writer.record({"step": step, "loss": 10.0 - step + start / 100, "expert_load": [step, 2 * step],
                       "skipped": step % 2 == 0})
    if final_val is not None:
        writer.validation(steps[-1], final_val)
    writer.close()


def test_a_resume_continues_the_run_without_the_steps_it_holds(tmp_path):
    cfg = Config().replace(**{"run.wandb": True, "run.wandb_mode": "offline"})
    run_dir = tmp_path / "run"
    writer_run(cfg, run_dir, 0, range(1, 5))  # steps 1-4 logged, then stopped; resumed from step 2's save
    writer_run(cfg, run_dir, 2, range(3, 7), final_val=1.5)
    first, second = offline_runs(run_dir)
    assert first.name == second.name  # one W&B run id across the resume
    history, _, _ = read_offline_run(first)
    assert sorted(history) == [1, 2, 3, 4] and history[3]["loss"] == 7.0
    assert history[3]["expert_load/1"] == 6
    assert [history[step]["skipped"] for step in (3, 4)] == [0, 1] and type(history[4]["skipped"]) is int
    history, _, _ = read_offline_run(second)
    assert sorted(history) == [5, 6]  # 3 and 4 trained again: W&B holds them from the first attempt
    assert history[5]["loss"] == 10.0 - 5 + 2 / 100 and history[6]["val_loss"] == 1.5
    writer_run(cfg, run_dir, 0, range(1, 2))  # a start from step 0 is a new W&B run
    assert len({path.name for path in offline_runs(run_dir)}) == 2


def test_online_without_a_login_is_one_sentence(tmp_path, monkeypatch):
    from jaxpar.errors import UserError
    from jaxpar.train.wandb_writer import WandbWriter

    monkeypatch.delenv("WANDB_MODE")
    cfg = Config().replace(**{"run.wandb": True, "run.wandb_mode": "online"})
    with pytest.raises(UserError, match=r"^run\.wandb=true could not start a W&B run in online mode \(.*API key.*"
                                        r"`wandb login`, or set run\.wandb_mode=offline .*`wandb sync`\.$"):
        WandbWriter(cfg, tmp_path / "run", 0)


@pytest.mark.parametrize("setting, sentence", [
    ("run.wandb=true", "run.wandb=true needs the wandb package, which is not installed: pip install 'jaxpar[wandb]'."),
    ("run.wandb_project=team/models", "run.wandb_project must be a name of 1 to 128 printable characters without "
                                      "/ \\ # ? % :, got 'team/models'."),
])
def test_a_missing_package_or_bad_project_is_one_sentence_before_anything_is_written(tmp_path, capsys, monkeypatch,
                                                                                     setting, sentence):
    import jaxpar.features.run as run_checks

    real = run_checks.find_spec
    monkeypatch.setattr(run_checks, "find_spec", lambda name: None if name == "wandb" else real(name))
    run = tmp_path / "run"
    code, err = train_here(capsys, run, setting)
    assert code == 2
    assert err.strip().splitlines() == [f"jaxpar: error: {sentence}"]
    assert not run.exists()


def test_online_without_a_login_stops_before_anything_compiles(tmp_path, capsys, monkeypatch):
    """The login is looked for where `wandb login` leaves it (WANDB_API_KEY, or the netrc entry of W&B's host)
    when the config is checked, before a run folder or a compile."""
    from jaxpar.features.run import _wandb_key

    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    netrc_file = tmp_path / "netrc"
    netrc_file.write_text("machine example.org login user password secret\n")
    monkeypatch.setenv("NETRC", str(netrc_file))
    code, err = train_here(capsys, tmp_path / "run", "run.wandb=true", "run.wandb_mode=online")
    assert code == 2 and not (tmp_path / "run").exists()
    assert err == ("jaxpar: error: run.wandb_mode=online needs a W&B login (wandb login, or WANDB_API_KEY), and this "
                   "machine has none; log in, or set run.wandb_mode=offline and upload later with wandb sync.\n")
    netrc_file.write_text("machine api.wandb.ai login user password " + "0" * 40 + "\n")
    assert _wandb_key()
    netrc_file.write_text("")
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    assert _wandb_key()
