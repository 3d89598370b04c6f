"""Data sources and deterministic batches."""

import numpy as np
import pytest

from jaxpar.data import BatchSampler, DataError, builtin_text, load_tokens, split_tokens


def test_builtin_corpus_is_real_english_text():
    text = builtin_text()
    assert len(text.encode()) > 400_000
    assert "the" in text and "function" in text


def test_text_file_folder_and_token_file(tmp_path):
    (tmp_path / "a.txt").write_text("hello ")
    (tmp_path / "b.txt").write_text("world")
    assert bytes(load_tokens(str(tmp_path / "a.txt"), 256)) == b"hello "
    assert bytes(load_tokens(str(tmp_path), 256)) == b"hello \n\nworld"
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "t.bin")
    tokens = load_tokens(str(tmp_path / "t.bin"), 1000)
    assert isinstance(tokens, np.memmap) and tokens[999] == 999
    with pytest.raises(DataError, match="outside model.vocab_size=999"):
        load_tokens(str(tmp_path / "t.bin"), 999)


def test_batches_are_reproducible_per_step_and_differ_across_steps():
    tokens = np.arange(10_000) % 256
    sampler = BatchSampler(tokens, seq_len=16, batch_size=4, seed=3)
    first = sampler.batch(5)
    assert first.shape == (4, 17) and first.dtype == np.int32
    np.testing.assert_array_equal(first, BatchSampler(tokens, 16, 4, seed=3).batch(5))
    assert not np.array_equal(first, sampler.batch(6))
    assert not np.array_equal(first, BatchSampler(tokens, 16, 4, seed=4).batch(5))
    # windows are contiguous text: target = input shifted by one
    assert all(np.all((row[1:] - row[:-1]) % 256 == 1) for row in first)


def validation_batches(sampler: BatchSampler, count: int) -> list[np.ndarray]:
    """The `count` validation batches, read as the training loop reads them."""
    return [sampler.windows(starts) for starts in sampler.fixed_starts(count)]


def test_validation_split_is_held_out():
    tokens = np.arange(1000)
    train, val = split_tokens(tokens, 0.1, 8)
    assert len(val) == 100 and train[-1] + 1 == val[0]
    batches = validation_batches(BatchSampler(val, 8, 2, 0), 3)
    assert len(batches) == 3 and all(b.min() >= 900 for b in batches)


@pytest.mark.parametrize("val_fraction", [0.05, 0.3])
def test_val_fraction_holds_out_the_tail_and_training_never_reads_it(session_for, tmp_path, val_fraction):
    """data.val_fraction through the session: the validation split is the last int(N x fraction)
    tokens, and no training window (of any step) nor validation window crosses the boundary.
    Each token's value is its position in the file, so a window says where it came from."""
    n = 20_000
    np.arange(n, dtype=np.uint16).tofile(tmp_path / "positions.bin")
    session = session_for(f"data.source={tmp_path / 'positions.bin'}", f"model.vocab_size={n}", "model.seq_len=64",
                          "train.batch_size=64", f"data.val_fraction={val_fraction}", "train.eval_batches=4")
    n_val = int(n * val_fraction)
    boundary = n - n_val
    assert len(session.val_data.tokens) == n_val and len(session.train_data.tokens) == boundary
    train_windows = np.concatenate([session.train_data.batch(step) for step in range(200)])
    assert train_windows.max() < boundary
    assert train_windows.min() < 0.01 * boundary and train_windows.max() > 0.99 * boundary  # the whole train part
    val_windows = np.concatenate(validation_batches(session.val_data, session.cfg.train.eval_batches))
    assert val_windows.min() == boundary and val_windows.max() == n - 1  # the whole tail, nothing before it
    assert all(np.all(np.diff(w) == 1) for w in val_windows)  # contiguous windows
