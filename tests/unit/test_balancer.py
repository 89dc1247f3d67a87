from __future__ import annotations

from serve_app.router.balancer import EngineLoad, decode_score, every_line_at_least, prefill_score, select


def loads(*specs):
    return [EngineLoad(name=n, role="decode", reserved_tokens=r, kv_used_tokens=k, healthy=h) for n, r, k, h in specs]


def test_least_loaded_decode_wins():
    pool = loads(("d0", 100, 500, True), ("d1", 300, 0, True))
    assert select(pool, decode_score).name == "d1"


def test_ties_rotate_instead_of_always_index_zero():
    pool = loads(("d0", 0, 0, True), ("d1", 0, 0, True))
    assert {select(pool, decode_score, turn=t).name for t in range(4)} == {"d0", "d1"}


def test_unhealthy_engines_are_skipped_and_none_left_means_none():
    pool = loads(("d0", 0, 0, False), ("d1", 999, 0, True))
    assert select(pool, decode_score).name == "d1"
    assert select(loads(("d0", 0, 0, False)), decode_score) is None


def test_avoid_is_a_preference_not_a_ban():
    pool = loads(("d0", 0, 0, True), ("d1", 50, 0, True))
    assert select(pool, decode_score, avoid={"d0"}).name == "d1"
    assert select(loads(("d0", 0, 0, True)), decode_score, avoid={"d0"}).name == "d0"


def test_prefill_score_is_the_prompt_tokens_in_the_engines_line_whichever_router_sent_them():
    a = EngineLoad(name="p0", role="prefill", reserved_tokens=1000, healthy=True)
    b = EngineLoad(name="p1", role="prefill", reserved_tokens=200, num_waiting=3, healthy=True)
    assert prefill_score(b) == 200 and select([a, b], prefill_score).name == "p1"
    # Another router replica's 20 long prompts wait on p1: its report says so, in tokens (a count
    # of waiting requests beside this router's tokens weighed 20 such prompts as 20 tokens).
    b.num_waiting, b.queued_prompt_tokens = 20, 20 * 4096
    assert prefill_score(b) == 81920 and select([a, b], prefill_score).name == "p0"
    # The report lags this router's newest calls: its own count then stands.
    a.queued_prompt_tokens = 300
    assert prefill_score(a) == 1000


def test_scores_are_integers():
    load = EngineLoad(name="d", role="decode", reserved_tokens=7, kv_used_tokens=128, healthy=True)
    assert isinstance(decode_score(load), int)


def test_the_prefill_queue_is_the_shortest_line_of_a_healthy_engine():
    """What router.local_prefill_queue_tokens compares: an unhealthy or leaving engine's line
    does not count."""
    loads = [
        EngineLoad("prefill-0", "prefill", reserved_tokens=4096, healthy=True),
        EngineLoad("prefill-1", "prefill", reserved_tokens=2048, healthy=True),
        EngineLoad("prefill-2", "prefill", reserved_tokens=0, healthy=False, draining=True),
    ]
    assert every_line_at_least(loads, 2048) and not every_line_at_least(loads, 2049)
    assert every_line_at_least(loads[:1], 4096) and not every_line_at_least(loads[:1], 4097)
