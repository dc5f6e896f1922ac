"""Megatron's block hashes in the router, against SHA-256 alone over the same bytes.

Run: ``.venv/bin/python bench/bench_hashing.py [--rounds 2000]`` (``--no-results``: print,
record nothing). No etcd. A prompt of ``BLOCKS`` blocks of ``BLOCK`` tokens (random ids
below 128,000) is hashed with ``discovery.block_hashes`` (what a kv_aware pick hashes in the
router), its tokens held three ways: a list (what a tokenizer returns), a tuple, and an
``array('q')`` (an int64 buffer, taken as it is, as a NumPy int64 array would be). The floor
is ``hashlib.sha256`` alone over the same bytes, chained the same way (each block's digest
over the previous one's and the block), with the bytes packed beforehand. Every figure is
the median of ``--rounds`` timings, idle and then beside one CPU-burning process (this
benchmark takes both phases itself); "x SHA-256" is that median over SHA-256's median of
the same phase. Target (issue 44 item 3): <= 1.5x SHA-256.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import time
from array import array
from collections.abc import Callable, Sequence

from _common import Target, burners, record_results, table_text

from discovery import block_hashes
from discovery._state.blockhash import pack_tokens

BLOCK = 256
BLOCKS = 17  # a kv_aware pick's prompt: 16 blocks held, then one held nowhere
LIMIT = 1.5


def _median_us(run: Callable[[], object], rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        run()
        samples.append(time.perf_counter_ns() - t0)
    return statistics.median(samples) / 1000


def _sha256_chain(data: bytes) -> Callable[[], object]:
    step = BLOCK * 8

    def run() -> bytes:
        digest, view = bytes(32), memoryview(data)
        for start in range(0, len(data), step):
            digest = hashlib.sha256(digest + view[start : start + step]).digest()
        return digest

    return run


def measure(rounds: int) -> dict[str, float]:
    rng = random.Random(44)
    tokens = [rng.randrange(128_000) for _ in range(BLOCK * BLOCKS)]
    held: dict[str, Sequence[int]] = {
        "list": tokens,
        "tuple": tuple(tokens),
        "array('q')": array("q", tokens),
    }
    expected = block_hashes(tokens, BLOCK)
    assert all(block_hashes(t, BLOCK) == expected for t in held.values()), "values differ"
    cells = {"SHA-256 alone": _sha256_chain(pack_tokens(tokens, 0, len(tokens)))}
    for name, t in held.items():
        cells[f"block_hashes, {name}"] = lambda t=t: block_hashes(t, BLOCK)
    for run in cells.values():  # warm-up
        _median_us(run, 50)
    figures = dict.fromkeys(cells, 0.0)
    # Interleaved in slices, so that a burst of load from elsewhere falls on every cell.
    for _ in range(10):
        for name, run in cells.items():
            figures[name] += _median_us(run, max(1, rounds // 10)) / 10
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--no-results", action="store_true", help="leave bench/results/ alone")
    args = parser.parse_args()
    phases = {"idle": measure(args.rounds)}
    with burners(1):
        phases["one burner"] = measure(args.rounds)
    rows, targets = [], []
    for phase, figures in phases.items():
        floor = figures["SHA-256 alone"]
        for name, us in figures.items():
            rows.append([phase, name, f"{us:.1f}", f"{us / floor:.2f}"])
            if name != "SHA-256 alone":
                targets.append(Target(f"{name} / SHA-256 alone ({phase})", us / floor, LIMIT, "x"))
    header = (f"{BLOCKS} blocks of {BLOCK} tokens", "cell", "median us", "x SHA-256")
    text = table_text(header, rows) + "\n\n" + "\n".join(t.line() for t in targets)
    print(text)
    if not args.no_results:
        record_results("hashing", text, about=__doc__.split("\n\n", 1)[1], targets=targets)


if __name__ == "__main__":
    main()
