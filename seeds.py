"""Randomness as a pure function of named keys: every random number of a run is found from the
run's --seed and what the number is for, never from a generator's position in a stream.

    key("train", 3)                          # an int64 from any parts (str, int, float, tuple)
    derive(seed, "problems", step)           # a seed for random.Random / torch.Generator
    uniforms(seed, keys, positions)          # float64 in [0, 1), one per (key, position)
    with global_generators(derive(seed, ...)):   # a fork's own random / numpy / torch draws

So a completion's draws depend on the seed, the step (or the evaluation), and the row's
identity (problem, rollout, call: what rollout.make_llm hashes into a row key) and its token
position, and on nothing else: not on the KV budget, the slot a row lands in, the order of
refills, or how the step's problems are split across ranks. A resumed run needs no generator
state: the same keys give the same numbers.

The mixer is SplitMix64's finaliser (Steele, Lea, Flood 2014), in int64 tensor arithmetic
(multiplication wraps modulo 2^64, and the right shifts are made logical by masking), so one
call hashes a whole batch on the device; `splitmix64` is the plain-integer version that the
tests check it against.
"""
import contextlib
import hashlib
import random

import numpy as np
import torch

M64 = (1 << 64) - 1
GOLDEN, MUL1, MUL2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 that holds it."""
    return x - (1 << 64) if x >= 1 << 63 else x


def splitmix64(x: int) -> int:
    """SplitMix64's finaliser of x + GOLDEN, on Python integers modulo 2^64."""
    z = (x + GOLDEN) & M64
    z = ((z ^ (z >> 30)) * MUL1) & M64
    z = ((z ^ (z >> 27)) * MUL2) & M64
    return z ^ (z >> 31)


def _shr(z, k: int):
    """Logical right shift of an int64 tensor (torch's >> keeps the sign)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def splitmix64_t(z):
    """splitmix64 of every element of an int64 tensor."""
    z = z + _signed(GOLDEN)
    z = (z ^ _shr(z, 30)) * _signed(MUL1)
    z = (z ^ _shr(z, 27)) * _signed(MUL2)
    return z ^ _shr(z, 31)


def key(*parts) -> int:
    """A 64-bit key (as an int64) of any printable parts, the same in every process (unlike
    Python's hash, which is seeded per process)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return _signed(int.from_bytes(digest, "little"))


@contextlib.contextmanager
def global_generators(seed: int):
    """Python's, numpy's and torch's (CPU) global generators seeded with `seed` inside, and put
    back as they were after: a workflow that draws with them (random.sample of its candidates)
    repeats under the run's seed and on resume, and nothing outside sees its draws."""
    py, npy = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            random.seed(seed)
            np.random.seed(seed & 0xFFFFFFFF)
            torch.manual_seed(seed)
            yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)


def derive(seed: int, *what) -> int:
    """A non-negative seed for random.Random or torch.Generator, for `what` under `seed`."""
    return key(seed, *what) & ((1 << 63) - 1)


def uniforms(seed: int, keys, positions):
    """float64 uniforms in [0, 1), one per element: keys and positions are int64 tensors of one
    shape (broadcast), on any device. The top 53 bits of the mix of (seed, key, position)."""
    base = splitmix64_t(keys ^ _signed(splitmix64(seed & M64)))
    z = splitmix64_t(base + positions)
    return _shr(z, 11).to(torch.float64) * 2.0 ** -53
