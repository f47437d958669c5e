"""Byte-level language-modelling data from real text files, split deterministically into train/eval.

Sources: the source files of Python's standard library (every machine with Python has them), a
directory of text files, or a synthetic stream for tests. Batch `step` is a pure function of
(seed, step), so a resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import pathlib
import sysconfig
import zlib

import numpy as np

from jtopoep.config import DataConfig

MAX_BYTES = 16 << 20  # read at most this much text: plenty for the small models trained here


class DataError(ValueError):
    """Training data that cannot be used: a missing or empty folder, or too little text."""


def _text_files(root: pathlib.Path, pattern: str, skip_tests: bool) -> list[pathlib.Path]:
    """Files under root, less (for the standard library) its test suites, whose data files are not
    Python text. Only folders below root count, so data kept under a folder named `test` is read."""
    return sorted(p for p in root.rglob(pattern)
                  if p.is_file() and not (skip_tests and "test" in p.relative_to(root).parts))


def _split(files: list[pathlib.Path], root: pathlib.Path, eval_fraction: float):
    train, evaluation = [], []
    for path in files:
        # A hash of the relative path, not the file order, decides the split: adding a file never
        # moves another one between train and eval.
        bucket = zlib.crc32(str(path.relative_to(root)).encode()) % 10_000
        (evaluation if bucket < eval_fraction * 10_000 else train).append(path)
    return train, evaluation


def _read(files: list[pathlib.Path], limit: int) -> np.ndarray:
    chunks, total = [], 0
    for path in files:
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    return np.frombuffer(b"\n".join(chunks)[:limit], dtype=np.uint8).astype(np.int32)


class ByteDataset:
    def __init__(self, config: DataConfig, seq_len: int, vocab_size: int, seed: int = 0):
        if vocab_size < 256 and config.source != "synthetic":
            raise DataError(f"model.vocab_size = {vocab_size} is too small for byte-level text: expected >= 256")
        self.seq_len, self.seed = seq_len, seed
        if config.source == "synthetic":
            rng = np.random.default_rng(seed)
            # A learnable stream: noisy repetitions of a few fixed phrases.
            phrases = [rng.integers(0, min(vocab_size, 256), rng.integers(5, 20)) for _ in range(16)]
            stream = np.concatenate([phrases[i] for i in rng.integers(0, 16, 20_000)])
            cut = int(len(stream) * (1 - config.eval_fraction))
            self.train, self.eval = stream[:cut].astype(np.int32), stream[cut:].astype(np.int32)
            return
        if config.source == "stdlib":
            root, pattern = pathlib.Path(sysconfig.get_paths()["stdlib"]), "*.py"
        else:
            root, pattern = pathlib.Path(config.path), "*"
            if not root.is_dir():
                what = "is a file" if root.exists() else "does not exist"
                raise DataError(f"data.path = {config.path!r} {what}: expected a folder of text files")
        files = _text_files(root, pattern, skip_tests=config.source == "stdlib")
        if not files:
            raise DataError(f"data.path = {str(root)!r} holds no files: expected a folder of text files")
        train, evaluation = _split(files, root, config.eval_fraction)
        if not evaluation:
            evaluation = train[-1:]
            train = train[:-1] or evaluation
        self.train = _read(train, MAX_BYTES)
        self.eval = _read(evaluation, MAX_BYTES // 8)
        for name, data in (("train", self.train), ("eval", self.eval)):
            if len(data) <= seq_len + 1:
                raise DataError(f"the {name} split of {root} holds {len(data)} bytes, fewer than one sequence of "
                                f"model.seq_len + 1 = {seq_len + 1}: add text or shorten model.seq_len")

    def batch(self, step: int, batch_size: int, split: str = "train") -> np.ndarray:
        """int32 [batch_size, seq_len + 1]: random windows, a pure function of (seed, split, step)."""
        data = self.train if split == "train" else self.eval
        rng = np.random.default_rng([self.seed, 0 if split == "train" else 1, step])
        starts = rng.integers(0, len(data) - self.seq_len - 1, batch_size)
        return np.stack([data[s:s + self.seq_len + 1] for s in starts])
