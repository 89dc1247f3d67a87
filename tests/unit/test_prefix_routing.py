"""Cache-aware routing (router/prefix_index.py, router.balancer: prefix), without engines: the
keys, the index and its forgetting, the choice and its bound, several routers agreeing, engines
joining and leaving, and the pool wiring it to the engines' stats."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
from collections import Counter
from types import SimpleNamespace
from unittest import mock

import pytest

from serve_app.router.balancer import EngineLoad
from serve_app.router.pool import EnginePool, PrefixRouting
from serve_app.router.prefix_index import Candidate, PrefixIndex, RecentWork, chain_keys, choose, rendezvous, within_bound
from serve_app.wire.protocol import EngineStats

B = 4  # tokens per block in these tests


def prompt(prefix: int, length: int = 6 * B, suffix: int = 0) -> list[int]:
    """Tokens of a prompt: ``length`` tokens of prefix number ``prefix``, then ``suffix`` more."""
    rng = random.Random(prefix)
    head = [rng.randrange(1000) for _ in range(length)]
    return head + [1000 + prefix * 7 + i for i in range(suffix)]


def deepest(index: PrefixIndex, keys: list[int], *engines: str) -> tuple[int, set[str]]:
    blocks, mask = index.deepest(keys, index.mask(engines))
    return blocks, index.names(mask)


def idle(*names: str) -> list[Candidate]:
    return [(n, 0, 0.0) for n in names]


# ---------------------------------------------------------------- keys
def test_keys_name_whole_prefixes_block_by_block():
    a = chain_keys(prompt(1, 6 * B, suffix=2 * B), B)
    b = chain_keys(prompt(1, 6 * B, suffix=0) + [9] * (3 * B), B)
    assert len(a) == 8 and len(b) == 9
    assert a[:6] == b[:6] and a[6] != b[6]  # the same first six blocks, then apart
    assert chain_keys([5, 6, 7], B) == []  # no whole block: nothing to match
    assert chain_keys(list(range(100 * B)), B, max_blocks=10) == chain_keys(list(range(10 * B)), B)
    # Block 2's key depends on block 1: the same tokens after another first block are another key.
    assert chain_keys([1] * B + [2] * B, B)[1] != chain_keys([3] * B + [2] * B, B)[1]
    # A cache_salt starts the chain, as in vLLM's block hashes: each salt's blocks are its own.
    salted = {salt: chain_keys(prompt(1), B, cache_salt=salt) for salt in (None, "a", "b")}
    assert len({keys[0] for keys in salted.values()}) == 3 and salted["a"] == chain_keys(prompt(1), B, cache_salt="a")


def test_keys_and_choices_are_the_same_in_every_process():
    """Router replicas are separate processes, each with its own string-hash seed: keys and the
    rendezvous choice must not depend on it."""
    code = (
        "from serve_app.router.prefix_index import chain_keys, rendezvous\n"
        "keys = chain_keys(list(range(64)), 4)\n"
        "salted = chain_keys(list(range(64)), 4, cache_salt='tenant-a')\n"
        "print(keys[-1], salted[-1], rendezvous(keys[3], [f'decode-{i}' for i in range(50)]))\n"
    )
    outputs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": seed}).stdout
        for seed in ("1", "2", "3")
    }
    assert len(outputs) == 1, outputs


# ---------------------------------------------------------------- the index
def test_the_index_matches_the_longest_prefix_each_engine_holds():
    index = PrefixIndex()
    index.record("d0", chain_keys(prompt(1), B))
    index.record("d1", chain_keys(prompt(1, 3 * B), B))
    keys = chain_keys(prompt(1, suffix=B), B)
    assert deepest(index, keys, "d0", "d1", "d2") == (6, {"d0"})
    assert deepest(index, keys, "d1", "d2") == (3, {"d1"})
    assert deepest(index, keys, "d2") == (0, set())


def test_an_engine_forgets_least_recently_used_blocks_beyond_its_capacity():
    index = PrefixIndex()
    first, second = chain_keys(prompt(1), B), chain_keys(prompt(2), B)
    index.record("d0", first)
    index.record("d0", second)
    index.record("d0", first)  # used again: now the newest
    index.set_capacity("d0", 8)
    assert index.held("d0") == 8
    assert deepest(index, first, "d0") == (6, {"d0"})
    # vLLM frees a prompt's blocks last first, so the start of the older prefix is still cached.
    assert deepest(index, second, "d0") == (2, {"d0"})
    assert not any(k in index.holders for k in second[2:])


def test_keys_thin_out_past_the_first_64_blocks_and_weigh_the_blocks_they_stand_for():
    from serve_app.router.prefix_index import BOUNDARIES, blocks_of

    keys = chain_keys(prompt(3, 200 * B), B)
    # Every block of the first 64, then 32 per doubling: 66, 68 .. 128, then 132, 136 .. 200.
    assert len(keys) == 64 + 32 + 18 and BOUNDARIES[len(keys) - 1] == 200 and blocks_of(len(keys)) == 200
    assert keys[:64] == chain_keys(prompt(3, 64 * B), B)  # a longer prompt has the shorter one's keys
    index = PrefixIndex()
    index.record("d0", keys)
    assert index.held("d0") == 200 and len(index.holders) == len(keys)  # blocks, not keys
    index.set_capacity("d0", 190)  # the last key stands for 4 blocks, the two before it for 4 each
    assert index.held("d0") == 188 and deepest(index, keys, "d0") == (len(keys) - 3, {"d0"})


def test_conversations_that_share_a_long_head_are_told_apart_by_their_own_turns():
    """An agent's system prompt and tools (here 100 blocks) shared by every conversation: each
    conversation's next turn goes to the engine that holds its earlier turns, not to whichever
    holds the head."""
    head = prompt(4, 100 * B)
    turn1 = {c: head + prompt(10 + c, 20 * B) for c in range(2)}
    index = PrefixIndex()
    index.record("d0", chain_keys(turn1[0], B))
    index.record("d1", chain_keys(turn1[1], B))
    for c, engine in ((0, "d0"), (1, "d1")):
        turn2 = chain_keys(turn1[c] + prompt(20 + c, 30 * B), B)
        name, blocks = choose(index, turn2, [("d0", 5, 0.0), ("d1", 0, 0.0)], max_imbalance=1.3, request_load=5)
        assert (name, blocks) == (engine, 120)  # its earlier turn, matched to the last key


def test_an_engine_that_has_not_reported_its_capacity_is_bounded_all_the_same():
    from serve_app.router import prefix_index

    index = PrefixIndex()
    with mock.patch.object(prefix_index, "UNREPORTED_CAPACITY_BLOCKS", 10):
        index.record("d0", chain_keys(prompt(1), B))
        index.set_capacity("d0", 0)  # an engine that does not know yet
        index.record("d0", chain_keys(prompt(2), B))
    assert index.held("d0") == 10 and len(index.holders) == 10


def test_a_restarted_engine_holds_nothing_and_a_leaving_one_is_forgotten():
    index = PrefixIndex()
    keys = chain_keys(prompt(1), B)
    index.record("d0", keys)
    index.record("d1", keys)
    index.set_epoch("d0", "first")
    index.set_epoch("d0", "first")  # the same start: kept
    assert index.held("d0") == 6
    index.set_epoch("d0", "second")  # it started afresh: an empty cache
    assert index.held("d0") == 0 and deepest(index, keys, "d0", "d1") == (6, {"d1"})
    index.forget("d1")
    assert index.held("d1") == 0 and index.holders == {}


# ---------------------------------------------------------------- the choice
def test_a_prefix_sticks_to_its_engine_until_its_load_crosses_the_bound():
    index = PrefixIndex()
    keys = chain_keys(prompt(7), B)
    engines = ["d0", "d1"]
    first, _ = choose(index, keys, idle(*engines), max_imbalance=1.3, request_load=10)
    index.record(first, keys)
    other = next(e for e in engines if e != first)
    load = {first: 0, other: 0}
    chosen = []
    for _ in range(6):
        name, blocks = choose(index, keys, [(e, load[e], 0.0) for e in engines], max_imbalance=1.3, request_load=10)
        index.record(name, keys)
        load[name] += 10  # each request stays in flight
        chosen.append((name, blocks))
    # With the other idle, the holder stays within 1.3x the mean plus one request while its
    # load is at most 10 / (1 - 0.65): three requests; the fourth goes to the other engine.
    assert [n for n, _ in chosen[:3]] == [first] * 3 and chosen[3] == (other, 0)
    # Both hold it now: the least loaded of them takes the next.
    assert chosen[4] == (other, 6) and chosen[5][1] == 6


def test_the_bound_never_leaves_no_engine_and_an_idle_pool_is_all_eligible():
    assert within_bound(idle("a", "b", "c"), 1.0, 0) == idle("a", "b", "c")
    heavy = [("a", 100, 0.0), ("b", 100, 0.0), ("c", 400, 0.0)]
    assert within_bound(heavy, 1.3, 0) == heavy[:2]
    assert within_bound([("a", 5, 9.0)], 1.0, 0) == [("a", 5, 9.0)]
    # Idle now, but sent far more than the others lately: out, as one loaded now would be.
    busy_lately = [("a", 0, 900.0), ("b", 0, 100.0), ("c", 0, 100.0)]
    assert within_bound(busy_lately, 1.3, 0, request_work=10.0) == busy_lately[1:]


def test_a_prompt_nobody_holds_goes_where_every_router_would_send_it():
    """A new prefix is placed by rendezvous on its first block: the same engine from any router,
    whatever the engines' order, and spread over the engines."""
    engines = [f"d{i}" for i in range(10)]
    placed = Counter()
    for p in range(2000):
        keys = chain_keys(prompt(p), B)
        name, blocks = choose(PrefixIndex(), keys, idle(*engines), max_imbalance=1.3, request_load=1)
        assert blocks == 0
        assert name == choose(PrefixIndex(), keys, idle(*reversed(engines)), max_imbalance=1.3, request_load=1)[0]
        placed[name] += 1
    assert len(placed) == 10 and max(placed.values()) < 1.3 * 200


def test_a_common_head_does_not_pin_every_prefix_to_one_engine():
    """Prompts that share a chat template's first blocks and then differ: once the head is on
    several engines, the tie among them is broken by the first block past it, per prefix."""
    head = [7] * (2 * B)
    engines = ["d0", "d1", "d2", "d3"]
    index = PrefixIndex()
    for name in engines:
        index.record(name, chain_keys(head, B))
    placed = Counter()
    for p in range(400):
        keys = chain_keys(head + prompt(p), B)
        name, blocks = choose(index, keys, idle(*engines), max_imbalance=1.3, request_load=1)
        assert blocks == 2
        placed[name] += 1
    assert set(placed) == set(engines) and max(placed.values()) < 1.5 * 100


def test_two_routers_with_their_own_traffic_agree_on_where_each_prefix_lives():
    """Two router replicas, each seeing every other request: their separate indexes send each
    prefix to the same engine, so the engines see each prefix once, as from one router."""
    engines = [f"d{i}" for i in range(4)]
    routers = [PrefixIndex(), PrefixIndex()]
    homes: dict[int, set[str]] = {}
    rng = random.Random(0)
    for i in range(2000):
        p = rng.randrange(40)
        keys = chain_keys(prompt(p, suffix=rng.randrange(8)), B)
        index = routers[i % 2]
        name, _ = choose(index, keys, idle(*engines), max_imbalance=1.3, request_load=1)
        index.record(name, keys)
        homes.setdefault(p, set()).add(name)
    assert all(len(h) == 1 for h in homes.values()), homes


def test_an_engine_leaving_moves_only_its_own_prefixes_and_one_joining_takes_only_its_share():
    engines = [f"d{i}" for i in range(8)]
    first_keys = [chain_keys(prompt(p), B)[0] for p in range(800)]
    before = {k: rendezvous(k, engines) for k in first_keys}
    after_leave = {k: rendezvous(k, engines[:-1]) for k in first_keys}
    moved = {k for k in first_keys if before[k] != after_leave[k]}
    assert moved == {k for k in first_keys if before[k] == "d7"}
    after_join = {k: rendezvous(k, [*engines, "d8"]) for k in first_keys}
    joined = {k for k in first_keys if before[k] != after_join[k]}
    assert all(after_join[k] == "d8" for k in joined) and 0 < len(joined) < 2 * 800 / 9


def test_at_scale_100_engines_and_10k_prefixes_each_prefix_keeps_one_home():
    engines = [f"decode-{i}" for i in range(100)]
    index = PrefixIndex()
    for name in engines:
        index.set_capacity(name, 10_000)
    homes: dict[int, str] = {}
    for round_ in range(2):
        for p in range(10_000):
            keys = chain_keys(prompt(p, 4 * B, suffix=round_), B)
            name, blocks = choose(index, keys, idle(*engines), max_imbalance=1.3, request_load=1)
            index.record(name, keys)
            assert homes.setdefault(p, name) == name
            assert blocks == (0 if round_ == 0 else 4)
    spread = Counter(homes.values())
    assert len(spread) == 100 and max(spread.values()) < 2 * 100


# ---------------------------------------------------------------- the pool
def pool_of(*names: str, role: str = "decode") -> EnginePool:
    pool = EnginePool({}, prefix=PrefixRouting(block_tokens=B, max_imbalance=1.3))
    for name in names:
        pool.loads[name] = EngineLoad(name=name, role=role, healthy=True)
    return pool


def test_the_pool_picks_by_prefix_records_the_choice_and_reports_it():
    pool = pool_of("d0", "d1")
    told = []
    pool.on_prefix_choice = lambda role, engine, tokens: told.append((role, engine, tokens))
    keys = pool.prefix_keys(prompt(3))
    first = pool.pick("decode", prefix_keys=keys, request_load=1)
    again = pool.pick("decode", prefix_keys=keys, request_load=1)
    assert first is again and told == [("decode", first.name, 6 * B)]  # the first choice held nothing
    # Avoided (the engine that just failed): the other one, unless it is the only one healthy.
    other = pool.pick("decode", avoid=frozenset({first.name}), prefix_keys=keys, request_load=1)
    assert other.name != first.name
    assert pool.pick("decode", prefix_keys=[], request_load=1) is not None  # no whole block: by load
    assert EnginePool({}).prefix_keys(prompt(3)) == []  # router.balancer: load


def test_router_replicas_that_name_an_engine_differently_send_a_new_prefix_to_the_same_engine():
    """One router still holds an earlier engine named decode-0 and calls the new one
    decode-0.<id>; after Serve renumbers ranks two live engines can even swap names between
    routers. The rendezvous goes by each engine's Serve replica id, not the name it has here."""
    from serve_app.router.membership import ReplicaInfo

    def router(order: list[tuple[str, str]]) -> EnginePool:
        pool = EnginePool({}, prefix=PrefixRouting(block_tokens=B, max_imbalance=1.3))
        pool.attach("decode", SimpleNamespace(options=lambda **_: None))
        for replica_id, name in order:
            pool.join(ReplicaInfo(replica_id=replica_id, role="decode", name=name))
        return pool

    # Replica ids chosen so that by name alone the two routers disagree on some prefixes.
    a = router([("aaaaaaaa1", "decode-0"), ("bbbbbbbb2", "decode-0")])  # b is "decode-0.bbbbbbbb" here
    b = router([("bbbbbbbb2", "decode-0"), ("aaaaaaaa1", "decode-0")])  # a is "decode-0.aaaaaaaa" here
    replica = {pool_: {name: m.replica_id for name, m in pool_.members.items()} for pool_ in (a, b)}
    chosen = []
    for seed in range(40):
        keys = a.prefix_keys(prompt(100 + seed))
        got = [replica[pool_][pool_.pick("decode", prefix_keys=keys, request_load=1).name] for pool_ in (a, b)]
        chosen.append(got[0])
        assert got[0] == got[1], seed
    assert set(chosen) == {"aaaaaaaa1", "bbbbbbbb2"}  # both engines take new prefixes


def test_the_pool_keeps_the_index_honest_from_the_engines_stats():
    pool = pool_of("d0")
    keys = pool.prefix_keys(prompt(3))
    pool.pick("decode", prefix_keys=keys, request_load=1)
    assert pool.prefix.index.held("d0") == 6

    def report(epoch: str, capacity_tokens: int) -> None:
        stats = EngineStats(name="d0", role="decode", kv_capacity_tokens=capacity_tokens, epoch=epoch)

        async def stats_of(name: str) -> EngineStats:
            return stats

        pool._stats = stats_of  # type: ignore[method-assign]  # the engine's answer to a poll
        asyncio.run(pool.refresh(["d0"]))

    report("a", 4 * B)  # room for 4 blocks: the oldest 2 are gone
    assert pool.prefix.index.held("d0") == 4
    report("b", 4 * B)  # restarted: empty
    assert pool.prefix.index.held("d0") == 0


def test_the_random_baseline_uses_every_healthy_engine_and_no_index():
    pool = EnginePool({}, pick_at_random=True)
    for name in ("d0", "d1", "d2"):
        pool.loads[name] = EngineLoad(name=name, role="decode", healthy=name != "d2")
    picked = Counter(pool.pick("decode").name for _ in range(200))
    assert set(picked) == {"d0", "d1"} and min(picked.values()) > 50
    assert pool.pick("decode", avoid=frozenset({"d0"})).name == "d1"
    assert pool.prefix_keys(prompt(1)) == []


def test_by_load_tied_engines_take_turns_even_when_each_attempt_also_picks_a_prefill_engine():
    pool = EnginePool({})
    for name, role in (("d0", "decode"), ("d1", "decode"), ("p0", "prefill")):
        pool.loads[name] = EngineLoad(name=name, role=role, healthy=True)
    decodes = []
    for _ in range(4):  # an attempt: decode first, then prefill
        decodes.append(pool.pick("decode").name)
        assert pool.pick("prefill").name == "p0"
    assert decodes == ["d0", "d1", "d0", "d1"]


def test_recent_work_halves_each_half_life_and_keeps_its_order_when_rescaled():
    work = RecentWork(half_life_s=10.0)
    work.add("a", 100, work.factor(0.0))
    work.add("b", 100, work.factor(10.0))  # sent one half-life later: twice a's weight now
    factor = work.factor(10.0)
    assert work.scaled("a") / factor == pytest.approx(50) and work.scaled("b") / factor == pytest.approx(100)
    factor = work.factor(10.0 * 45)  # past 2^40: values are rescaled, their ratio kept
    assert factor == 1.0 and work.scaled("b") / work.scaled("a") == pytest.approx(2)
    work.forget("a")
    assert work.scaled("a") == 0.0


def test_recent_work_survives_hours_without_a_choice():
    """A router idle for hours (2^(t / half-life) past a float's range) still chooses; the old
    work has decayed to nothing and new work counts afresh."""
    work = RecentWork(half_life_s=10.0)
    work.add("a", 100, work.factor(0.0))
    for idle_s in (3 * 3600.0, 30 * 86400.0):
        factor = work.factor(idle_s)
        assert factor == 1.0 and work.scaled("a") == 0.0
    work.add("b", 5, work.factor(30 * 86400.0 + 10.0))
    assert work.scaled("b") / work.factor(30 * 86400.0 + 10.0) == pytest.approx(5)


def test_a_pool_picks_by_prefix_after_a_quiet_night():
    pool = pool_of("d0", "d1")
    keys = pool.prefix_keys(prompt(4))
    clock = [1000.0]
    with mock.patch("serve_app.router.pool.time.monotonic", lambda: clock[0]):
        first = pool.pick("decode", prefix_keys=keys, request_load=10).name
        clock[0] += 10 * 3600
        assert pool.pick("decode", prefix_keys=keys, request_load=10).name == first  # where its prefix is


def test_short_calls_of_one_hot_prefix_spread_once_its_engine_took_more_than_its_share():
    """Prefill calls end before the next choice: the load now never crosses the bound. The work
    sent lately does, so the prefix's engine keeps it only up to 1.3x the mean, and the other
    engine then holds it too."""
    pool = pool_of("p0", "p1", role="prefill")
    keys = pool.prefix_keys(prompt(5))
    chosen = Counter(pool.pick("prefill", prefix_keys=keys, request_load=24).name for _ in range(100))
    assert set(chosen) == {"p0", "p1"} and max(chosen.values()) <= 1.3 * 50 + 2, chosen
