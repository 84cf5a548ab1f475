"""Training data: memory-mapped uint16 token shards, an offline byte-level corpus builder, and a sampler whose
order depends only on (seed, step, sample) — never on the layout, the rank count or a restart.

A corpus directory holds `index.json` (the shards, their token counts and content hashes) and `shard_*.bin`
(raw little-endian uint16 tokens). Sample `g` of step `s` is window `perm_e[(s·B + g) mod W]` of the corpus, with
B the global batch, W the number of windows of seq_len + 1 tokens, and perm_e a permutation seeded by (seed, epoch
e). A dp rank reads samples [d·B/dp, (d+1)·B/dp) of each step, microbatch m the m-th run of microbatch_size of
those; so every layout sees the same global batch, and the cursor to save is just the next step.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Final

import numpy as np
import torch
from pydantic import NonNegativeInt

from plan.cache import default_corpus
from plan.records import DataVersion
from plan.section import Section

BYTE_VOCAB: Final = 256
SHARD_TOKENS: Final = 1 << 20  # 1 Mi tokens (2 MiB) per shard keeps each file small and memory-mapped cheaply


class DataError(ValueError):
    """A corpus that cannot be used, naming its path and the fix."""


class DataCursor(Section):
    """Where the data order stands: everything before `step` has been consumed."""

    step: NonNegativeInt = 0
    """Next optimizer step to read (steps)."""
    fingerprint: str = ""
    """Fingerprint of the corpus the cursor belongs to."""


def synthetic_text(n_bytes: int, seed: int) -> bytes:
    """Deterministic English-like text: words from a Zipf-weighted lexicon chained by a sparse Markov model.

    Needs no download, and has structure a small model can learn (word spelling, likely successors), so a
    short run shows the loss falling from ln 256.
    """
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"etaoinshrdlcumwfgypbvkjxqz", dtype=np.uint8)
    letter_p = np.linspace(2.0, 0.2, len(letters))
    letter_p /= letter_p.sum()
    lexicon = [bytes(rng.choice(letters, size=int(rng.integers(1, 9)), p=letter_p)) for _ in range(512)]
    successors = rng.integers(0, len(lexicon), size=(len(lexicon), 8))
    weights = 1.0 / np.arange(1, 9)
    weights /= weights.sum()
    out, word, size = [], 0, 0
    choices = rng.choice(8, size=n_bytes // 2 + 16, p=weights)
    ends = rng.random(n_bytes // 2 + 16)
    for i in range(len(choices)):
        token = lexicon[word] + (b". " if ends[i] < 0.08 else b" ")
        out.append(token)
        size += len(token)
        if size >= n_bytes:
            break
        word = int(successors[word, choices[i]])
    return b"".join(out)[:n_bytes]


def build_corpus(out: Path, tokens: int = 4 * SHARD_TOKENS, seed: int = 0, source: bytes | None = None) -> Path:
    """Write a byte-level corpus of `tokens` tokens (from `source`, or synthetic text) as uint16 shards.

    Written to a temporary directory and renamed into place, so a reader never sees half a corpus.
    """
    data = np.frombuffer(source if source is not None else synthetic_text(tokens, seed), dtype=np.uint8)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    shards = []
    for i, start in enumerate(range(0, len(data), SHARD_TOKENS)):
        chunk = data[start : start + SHARD_TOKENS].astype("<u2")
        name = f"shard_{i:05d}.bin"
        chunk.tofile(tmp / name)
        shards.append({"file": name, "tokens": len(chunk), "sha256": hashlib.sha256(chunk.tobytes()).hexdigest()})
    index = {"format": "uint16-le", "vocab": BYTE_VOCAB, "tokenizer": "bytes", "shards": shards}
    (tmp / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True))
    try:
        tmp.rename(out)
    except OSError:  # another process built it first: keep theirs
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    return out


class TokenCorpus:
    """Read-only view of a corpus directory: memory-mapped shards cut into windows of `seq_len` + 1 tokens."""

    def __init__(self, path: Path, seq_len: int) -> None:
        self.path, self.seq_len = path, seq_len
        index_path = path / "index.json"
        try:
            self.index = json.loads(index_path.read_text())
            shards = self.index["shards"]
        except (OSError, ValueError, KeyError) as exc:
            raise DataError(f"{index_path}: not a token corpus ({exc}); build one with executor.data") from None
        self.vocab = int(self.index.get("vocab", BYTE_VOCAB))
        self.maps = [np.memmap(path / s["file"], dtype="<u2", mode="r") for s in shards]
        per_shard = [(len(m) - 1) // seq_len for m in self.maps]
        self.offsets = np.cumsum([0, *per_shard])
        if self.offsets[-1] == 0:
            raise DataError(f"{path}: fewer than seq_len + 1 = {seq_len + 1} tokens per shard; build a larger corpus")

    @property
    def windows(self) -> int:
        return int(self.offsets[-1])

    @property
    def tokens(self) -> int:
        return int(sum(len(m) for m in self.maps))

    def fingerprint(self) -> str:
        """Hash of the index (which holds every shard's content hash)."""
        return hashlib.sha256((self.path / "index.json").read_bytes()).hexdigest()[:16]

    def version(self) -> DataVersion:
        return DataVersion(path=str(self.path), fingerprint=self.fingerprint(), tokens=self.tokens, vocab=self.vocab)

    def window(self, i: int) -> np.ndarray:
        """Tokens of window i (seq_len + 1 of them)."""
        shard = int(np.searchsorted(self.offsets, i, side="right") - 1)
        start = (i - int(self.offsets[shard])) * self.seq_len
        return np.asarray(self.maps[shard][start : start + self.seq_len + 1], dtype=np.int64)


@lru_cache(maxsize=4)
def _permutation(windows: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(windows)


class Sampler:
    """The deterministic order: which windows each (step, dp rank, microbatch) reads."""

    def __init__(self, corpus: TokenCorpus, global_batch: int, seed: int) -> None:
        self.corpus, self.global_batch, self.seed = corpus, global_batch, seed

    def window_ids(self, step: int, first: int, count: int) -> list[int]:
        """Windows of samples [first, first + count) of `step` in the global batch."""
        out = []
        for g in range(first, first + count):
            sample = step * self.global_batch + g
            epoch, pos = divmod(sample, self.corpus.windows)
            out.append(int(_permutation(self.corpus.windows, self.seed, epoch)[pos]))
        return out

    def batch(self, step: int, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each [global_batch / dp, seq_len] int64: a dp rank's samples of `step`, in order."""
        per_rank = self.global_batch // dp
        ids = self.window_ids(step, dp_rank * per_rank, per_rank)
        windows = torch.from_numpy(np.stack([self.corpus.window(i) for i in ids]))
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def cursor(self, next_step: int) -> DataCursor:
        return DataCursor(step=next_step, fingerprint=self.corpus.fingerprint())


def open_corpus(path: Path | None, seq_len: int, vocab: int, build: bool = True) -> TokenCorpus:
    """Open the corpus at `path` (default: the synthetic byte corpus in the user's cache, plan/cache.py, built on
    first use)."""
    path = path or default_corpus()
    if not (path / "index.json").exists():
        if not build:
            raise DataError(f"{path}: no corpus here; pass --data with a corpus directory or omit it")
        build_corpus(path)
    corpus = TokenCorpus(path, seq_len)
    if corpus.vocab > vocab:
        raise DataError(f"{path}: tokenizer vocabulary {corpus.vocab} exceeds model.vocab={vocab}; raise model.vocab")
    return corpus


def save_cursor(cursor: DataCursor, path: Path) -> None:
    """Write the cursor atomically (write, then rename) so a crash leaves the previous one intact."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(cursor.model_dump_json())
    tmp.replace(path)


def load_cursor(path: Path) -> DataCursor:
    try:
        return DataCursor.model_validate_json(path.read_text())
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot read the data cursor ({exc})") from None
