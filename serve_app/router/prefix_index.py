"""Which engine is expected to hold which prompt blocks, and the choice it leads to (pure).

A prompt is cut into blocks of ``block_tokens`` token ids (the engines' KV block size: vLLM caches
whole blocks only). A *key* names the whole prefix up to and including some block: the hash of
(the key before it, the token ids since), as vLLM's own block hashes chain. Keys are taken at
fixed block counts (``BOUNDARIES``): at every block of a prompt's first 64, then 32 per doubling
of its length, so that a prefix of any length (a long system prompt or tool list shared by many
conversations, each conversation's earlier turns) is told apart from another at about 3% of its
length, for a few hundred keys at most per prompt. Keys are Python hashes of tuples of ints,
which are the same in every process (no hash seed applies to them), so every router replica
computes the same keys and the same choices.

The index records the keys of each prompt it routes to an engine (the engine then holds them in
its prefix cache), and forgets them the way the engine would: least recently used first, and of
one prompt its last blocks first (vLLM frees a request's blocks tail first, so the start of a
prefix stays longest), beyond the engine's KV capacity; all at once when the engine restarts or
leaves. It is the router's own
record, kept honest by the engines' stats (their capacity, and an epoch that changes when an
engine starts afresh), not a copy of vLLM's KV cache events: those would cross the network
unauthenticated (vLLM publishes them on a plain ZMQ socket) and carry every prompt's tokens, and
each router replica would subscribe to every engine. docs/design.md, "Cache-aware routing".

The choice (``choose``): among the engines whose load is within the imbalance bound, the one
expected to hold the longest prefix of the prompt; ties, including a prompt nobody holds, go to
the engine with the highest rendezvous weight for the first block past the common prefix. The
rendezvous part is what makes several router replicas agree without sharing state: each places
a new prefix on the same engine, and one engine joining or leaving moves only its share.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

DENSE_BLOCKS = 64  # a key at each of a prompt's first blocks
KEYS_PER_OCTAVE = 32  # then this many per doubling of its length
# A prefix longer than this many blocks is matched on its first blocks only (16M tokens in blocks
# of 128): past any context length, while a request's keys stay a few hundred.
MAX_BLOCKS = 1 << 17
# An engine whose capacity is not known yet (before its first stats) is taken to hold at most
# this many blocks, so that its record cannot grow without bound meanwhile.
UNREPORTED_CAPACITY_BLOCKS = 1 << 16


def _boundaries() -> tuple[int, ...]:
    out = list(range(1, DENSE_BLOCKS + 1))
    low = DENSE_BLOCKS
    while low < MAX_BLOCKS:
        step = low // KEYS_PER_OCTAVE
        out.extend(range(low + step, 2 * low + 1, step))
        low *= 2
    return tuple(out)


# Key i names a prompt's first BOUNDARIES[i] blocks and stands, in an engine's capacity, for the
# WEIGHTS[i] blocks since the key before it.
BOUNDARIES = _boundaries()
WEIGHTS = tuple(b - a for a, b in zip((0, *BOUNDARIES), BOUNDARIES))


def chain_keys(token_ids: Sequence[int], block_tokens: int, max_blocks: int = MAX_BLOCKS, cache_salt: str | None = None) -> list[int]:
    """The keys of the prompt's whole blocks at ``BOUNDARIES``, first to last (up to
    ``max_blocks``). A request's ``cache_salt`` starts the chain, as it does vLLM's block hashes:
    an engine holds a salted prefix only for requests with the same salt. Every token of the
    covered blocks is hashed once (about 2 ms for 128K tokens)."""
    keys: list[int] = []
    key = 0 if cache_salt is None else salt_key(cache_salt)
    n = min(len(token_ids) // block_tokens, max_blocks)
    start = 0
    for blocks in BOUNDARIES[: bisect.bisect_right(BOUNDARIES, n)]:
        end = blocks * block_tokens
        key = hash((key, *token_ids[start:end]))
        keys.append(key)
        start = end
    return keys


def blocks_of(matched: int) -> int:
    """The blocks a prompt's first ``matched`` keys cover."""
    return BOUNDARIES[matched - 1] if matched else 0


@functools.lru_cache(maxsize=4096)
def salt_key(cache_salt: str) -> int:
    """A chain's first key for a salted prompt: the same in every router replica (``hash(str)``
    is not), and apart from the unsalted chain's 0."""
    return int.from_bytes(hashlib.blake2b(cache_salt.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big") | 1


@functools.lru_cache(maxsize=4096)
def engine_salt(name: str) -> int:
    """A stable integer per engine name (``hash(str)`` differs between processes)."""
    return zlib.crc32(name.encode())


class PrefixIndex:
    """key -> engines expected to hold it; per engine, its keys in least-recently-used order.

    The engines holding a key are a bit mask over engine numbers, not a set of names: a key's
    holders cost the index one int, which the garbage collector never scans (a set per key would
    make its passes over a large index the routing's main cost), and narrowing a prompt's holders
    block by block is one ``&``. With each engine's recency order, 130-160 bytes per key and
    engine in all (docs/design.md, "Cost")."""

    def __init__(self) -> None:
        self.holders: dict[int, int] = {}  # key -> mask of engine bits
        self._lru: dict[str, OrderedDict[int, int]] = {}  # key -> the blocks it stands for
        self._blocks: dict[str, int] = {}  # the sum of an engine's keys' blocks
        self._capacity: dict[str, int] = {}  # blocks; absent: not yet reported
        self._epoch: dict[str, str] = {}
        self._bit: dict[str, int] = {}  # engine -> its bit
        self._engine: dict[int, str] = {}  # bit -> engine
        self._free_bits: list[int] = []

    def held(self, engine: str) -> int:
        """The blocks ``engine`` is expected to hold."""
        return self._blocks.get(engine, 0)

    def mask(self, engines: Iterable[str]) -> int:
        bits = self._bit
        out = 0
        for engine in engines:
            bit = bits.get(engine)
            if bit is not None:
                out |= bit
        return out

    def names(self, mask: int) -> set[str]:
        out = set()
        while mask:
            low = mask & -mask
            out.add(self._engine[low])
            mask ^= low
        return out

    def record(self, engine: str, keys: Sequence[int]) -> None:
        """``engine`` now holds these blocks (it was sent their prompt, ``chain_keys``): most
        recently used, its first block most of all (vLLM evicts a prompt's last blocks first)."""
        lru = self._lru.get(engine)
        if lru is None:
            lru = self._lru[engine] = OrderedDict()
            bit = self._free_bits.pop() if self._free_bits else 1 << len(self._bit)
            self._bit[engine], self._engine[bit] = bit, engine
        bit = self._bit[engine]
        holders = self.holders
        added = 0
        for i in range(len(keys) - 1, -1, -1):
            key = keys[i]
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = WEIGHTS[i]
                added += WEIGHTS[i]
                holders[key] = holders.get(key, 0) | bit
        self._blocks[engine] = self._blocks.get(engine, 0) + added
        self._evict(engine)

    def set_capacity(self, engine: str, blocks: int) -> None:
        """What the engine reports it can hold: older blocks past it are gone from its cache.
        Not reported yet (0): ``UNREPORTED_CAPACITY_BLOCKS``."""
        if blocks > 0:
            self._capacity[engine] = blocks
            self._evict(engine)

    def set_epoch(self, engine: str, epoch: str) -> None:
        """The engine's start: a new one means an empty cache, whatever was recorded."""
        if not epoch:
            return
        if self._epoch.get(engine, epoch) != epoch:
            self.forget(engine)
        self._epoch[engine] = epoch

    def forget(self, engine: str) -> None:
        for key in self._lru.pop(engine, ()):
            self._drop(key, self._bit[engine])
        bit = self._bit.pop(engine, None)
        if bit is not None:
            del self._engine[bit]
            self._free_bits.append(bit)
        self._capacity.pop(engine, None)
        self._epoch.pop(engine, None)
        self._blocks.pop(engine, None)

    def _evict(self, engine: str) -> None:
        capacity = self._capacity.get(engine, UNREPORTED_CAPACITY_BLOCKS)
        lru = self._lru.get(engine)
        if lru is None:
            return
        bit = self._bit[engine]
        blocks = self._blocks[engine]
        while blocks > capacity:
            key, weight = lru.popitem(last=False)
            blocks -= weight
            self._drop(key, bit)
        self._blocks[engine] = blocks

    def _drop(self, key: int, bit: int) -> None:
        mask = self.holders.get(key, 0) & ~bit
        if mask:
            self.holders[key] = mask
        else:
            self.holders.pop(key, None)

    def deepest(self, keys: Sequence[int], candidates: int) -> tuple[int, int]:
        """(the longest prefix of the prompt a candidate holds, in keys (``blocks_of`` gives its
        blocks); the mask of the candidates holding it, 0 when none holds its first block)."""
        alive = candidates
        longest = 0
        holders = self.holders
        for i, key in enumerate(keys):
            still = holders.get(key, 0) & alive
            if not still:
                break
            alive, longest = still, i + 1
        return (longest, alive) if longest else (0, 0)


# (engine, its load score now: balancer.py, lower is less loaded; the work sent to it lately:
# ``RecentWork``). A plain tuple: one is made per engine per choice, the choice's main cost
# with a hundred engines.
Candidate = tuple[str, int, float]


def within_bound(candidates: Sequence[Candidate], max_imbalance: float, request_load: int, request_work: float = 0.0) -> list[Candidate]:
    """The candidates within ``max_imbalance`` times the mean, with room for this request (so an
    idle pool, all at 0, is all eligible), in both the load now and the work sent lately. The
    load now alone misses an engine that takes every short call of a popular prefix: each is
    done before the next choice sees it. Never empty: else the least loaded now."""
    n = len(candidates)
    load_bound = max_imbalance * sum(c[1] for c in candidates) / n + request_load
    work_bound = max_imbalance * sum(c[2] for c in candidates) / n + request_work
    return [c for c in candidates if c[1] <= load_bound and c[2] <= work_bound] or [min(candidates, key=lambda c: c[1])]


RESCALE_HALVINGS = 40  # 2^40: ~1e12, far from float's limits either way


class RecentWork:
    """Work sent to each engine, decaying by half every ``half_life_s``: the long-run share the
    bound keeps even. Values are kept multiplied by 2^(t / half_life_s), so adding is one
    multiplication and comparing engines at one moment needs no decay at all; they are rescaled
    before the factor grows large."""

    def __init__(self, half_life_s: float) -> None:
        self.half_life_s = half_life_s
        self._origin: float | None = None
        self._scaled: dict[str, float] = {}

    def factor(self, now: float) -> float:
        """What work sent at ``now`` weighs in ``scaled`` units."""
        if self._origin is None:
            self._origin = now
        halvings = (now - self._origin) / self.half_life_s
        if halvings <= RESCALE_HALVINGS:
            return 2.0**halvings
        # Rescale before the power gets large: after hours without a choice it would overflow
        # a float (2^1024), and the shrinking power underflows to 0 instead, as the work has.
        shrink = 2.0**-halvings
        self._scaled = {engine: value * shrink for engine, value in self._scaled.items()}
        self._origin = now
        return 1.0

    def add(self, engine: str, work: float, factor: float) -> None:
        self._scaled[engine] = self._scaled.get(engine, 0.0) + work * factor

    def scaled(self, engine: str) -> float:
        return self._scaled.get(engine, 0.0)

    def forget(self, engine: str) -> None:
        self._scaled.pop(engine, None)


_MASK = (1 << 64) - 1


def weight(key: int, salt: int) -> int:
    """A well-mixed 64-bit weight of (key, engine): SplitMix64's finaliser. Python's own tuple
    hash leaves weights of nearby salts correlated, which piles prefixes on a few engines."""
    x = (key ^ (salt * 0x9E3779B97F4A7C15)) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def rendezvous(key: int, names: Iterable[str], salt: Callable[[str], int] = engine_salt) -> str:
    """The name with the highest weight for ``key``: the same answer in every process."""
    return max(names, key=lambda name: weight(key, salt(name)))


def choose(
    index: PrefixIndex,
    keys: Sequence[int],
    candidates: Sequence[Candidate],
    *,
    max_imbalance: float,
    request_load: int,
    request_work: float = 0.0,
    salt: Callable[[str], int] = engine_salt,
) -> tuple[str, int]:
    """(the engine for a prompt with these keys (``chain_keys``), the blocks it is expected to
    hold). ``salt``: each engine's rendezvous salt, by name unless the caller knows a better
    identity."""
    eligible = within_bound(candidates, max_imbalance, request_load, request_work)
    best, holding = index.deepest(keys, index.mask(c[0] for c in eligible))
    tied = index.names(holding) if holding else {c[0] for c in eligible}
    if len(tied) == 1:
        return next(iter(tied)), blocks_of(best)
    if best < len(keys):
        return rendezvous(keys[best], tied, salt), blocks_of(best)
    if keys:  # the whole prompt is held by several: the least loaded of them
        loads = {c[0]: c[1] for c in eligible}
        return min(tied, key=lambda name: (loads[name], -weight(keys[-1], salt(name)))), blocks_of(best)
    return min(eligible, key=lambda c: c[1])[0], 0
