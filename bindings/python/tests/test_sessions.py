"""Sessions across conversation turns (save_session, open_session, drop_session, schedule_sessions, session_tier,
flush_sessions) and context-window truncation (drop_front): round trips, misses, tiers, and bad input."""

import numpy as np
import pytest
from conftest import GEOMETRY, N_SINK, TOKENS, make_context, random_kv

import kvret

N_Q, N_KV, D, LAYERS = GEOMETRY["n_q_heads"], GEOMETRY["n_kv_heads"], GEOMETRY["head_dim"], GEOMETRY["n_layers"]
# keys and values of every layer of a TOKENS-token f32 sequence
SESSION_KV_BYTES = 2 * LAYERS * TOKENS * N_KV * D * 4


def raised(call, status, *words):
    with pytest.raises(kvret.KvretError) as info:
        call()
    error = info.value
    assert error.status == status, error
    for word in words:
        assert word in error.message, error
    return error


def filled_sequence(ctx, rng, tokens=TOKENS):
    seq = ctx.open_sequence()
    for layer in range(LAYERS):
        seq.append_prefill(layer, *random_kv(rng, tokens))
    return seq


def contents(seq):
    """Every layer's stored keys and values."""
    return [seq.read(layer, 0, seq.length(layer)) for layer in range(LAYERS)]


def assert_same_sequence(a, b, rng):
    for (ka, va), (kb, vb) in zip(contents(a), contents(b)):
        np.testing.assert_array_equal(ka, kb)
        np.testing.assert_array_equal(va, vb)
    q = rng.standard_normal((N_Q, D), dtype=np.float32)
    for layer in range(LAYERS):
        np.testing.assert_array_equal(a.select(layer, q), b.select(layer, q))
        np.testing.assert_array_equal(a.attend(layer, q), b.attend(layer, q))


# ---- round trips ----


def test_save_then_open_gives_the_same_sequence(rng):
    with make_context() as ctx, filled_sequence(ctx, rng) as seq:
        seq.save_session("conversation-1")
        assert ctx.session_tier("conversation-1") == kvret.SessionTier.DRAM
        with ctx.open_session("conversation-1") as reopened:
            assert isinstance(reopened, kvret.Sequence) and reopened.context is ctx
            assert_same_sequence(seq, reopened, rng)
            # the two are independent: a decode step on one leaves the other as it was
            k, v = random_kv(rng, 1)
            reopened.append_decode(0, k[0], v[0])
            assert reopened.length(0) == TOKENS + 1 and seq.length(0) == TOKENS
        assert seq.length(0) == TOKENS  # saving left the sequence open and unchanged
        stats = ctx.stats()
        assert stats["session_saves"] == 1 and stats["session_hits_dram"] == 1 and stats["session_misses"] == 0
        assert stats["session_dram_count"] == 1 and stats["session_dram_bytes"] >= SESSION_KV_BYTES


def test_a_session_outlives_its_sequence_and_a_save_replaces_the_older_one(rng):
    with make_context() as ctx:
        with filled_sequence(ctx, rng) as seq:
            seq.save_session(b"turn")  # bytes ids are the same ids as their str
            expected = contents(seq)
        with ctx.open_session("turn") as reopened:
            for (k, v), (ek, ev) in zip(contents(reopened), expected):
                np.testing.assert_array_equal(k, ek)
                np.testing.assert_array_equal(v, ev)
            k, v = random_kv(rng, 3)
            reopened.append_prefill(0, k, v)  # the next turn appends only its new tokens
            reopened.save_session("turn")
        with ctx.open_session("turn") as latest:
            assert latest.length(0) == TOKENS + 3 and latest.length(1) == TOKENS


def test_unicode_ids_are_their_utf8_bytes(rng):
    with make_context() as ctx, filled_sequence(ctx, rng, 40) as seq:
        seq.save_session("café-🙂")
        assert ctx.session_tier("café-🙂".encode("utf-8")) == kvret.SessionTier.DRAM
        assert ctx.session_tier(bytearray("café-🙂", "utf-8")) == kvret.SessionTier.DRAM
        assert ctx.session_tier("cafe-🙂") == kvret.SessionTier.NONE
        seq.save_session("x" * 255)  # the longest id
        assert ctx.session_tier("x" * 255) == kvret.SessionTier.DRAM
        seq.save_session("é" * 127)  # 254 bytes
        assert ctx.session_tier("é" * 127) == kvret.SessionTier.DRAM


def test_a_miss_is_none_and_drop_says_whether_there_was_a_session(rng):
    with make_context() as ctx, filled_sequence(ctx, rng, 40) as seq:
        assert ctx.open_session("never-saved") is None
        assert ctx.session_tier("never-saved") == kvret.SessionTier.NONE
        assert ctx.drop_session("never-saved") is False
        seq.save_session("a")
        assert ctx.drop_session("a") is True
        assert ctx.session_tier("a") == kvret.SessionTier.NONE
        assert ctx.open_session("a") is None
        assert ctx.drop_session("a") is False
        stats = ctx.stats()
        assert stats["session_misses"] == 2 and stats["session_dram_count"] == 0
        assert ctx.stats()["sequences"] == 1  # a miss opens no sequence


def test_sessions_move_to_the_disk_tier_and_open_from_it(rng, tmp_path):
    # DRAM holds one session (not two): the second save moves the first to disk
    with make_context(disk_path=tmp_path, session_dram_bytes=SESSION_KV_BYTES * 3 // 2, session_policy="lru") as ctx:
        assert ctx.config["disk_path"] == str(tmp_path) and ctx.config["session_policy"] == "lru"
        first, second = filled_sequence(ctx, rng), filled_sequence(ctx, rng)
        first.save_session("first")
        second.save_session("second")
        ctx.flush_sessions()
        assert ctx.session_tier("first") == kvret.SessionTier.DISK
        assert ctx.session_tier("second") == kvret.SessionTier.DRAM
        stats = ctx.stats()
        assert stats["session_evictions"] >= 1 and stats["session_disk_count"] >= 1 and stats["disk_bytes"] > 0
        with ctx.open_session("first") as reopened:
            assert_same_sequence(first, reopened, rng)
        assert ctx.stats()["session_hits_disk"] == 1
        ctx.schedule_sessions(["second", "first", "second"])
        ctx.schedule_sessions([])  # clears the queue
        ctx.schedule_sessions(iter(("first",)))  # any iterable
        ctx.flush_sessions()
        assert ctx.drop_session("first") is True and ctx.session_tier("first") == kvret.SessionTier.NONE
        first.close()
        second.close()


def test_a_new_context_on_the_same_directory_sees_the_saved_sessions(rng, tmp_path):
    with make_context(disk_path=tmp_path, session_dram_bytes=1) as ctx, filled_sequence(ctx, rng) as seq:
        seq.save_session("persisted")  # fits no DRAM: straight to disk
        assert ctx.session_tier("persisted") == kvret.SessionTier.DISK
        expected = contents(seq)
    with make_context(disk_path=tmp_path) as ctx:
        assert ctx.session_tier("persisted") == kvret.SessionTier.DISK
        with ctx.open_session("persisted") as reopened:
            for (k, v), (ek, ev) in zip(contents(reopened), expected):
                np.testing.assert_array_equal(k, ek)
                np.testing.assert_array_equal(v, ev)
        assert ctx.open_session("persisted") is not None  # opening leaves it stored
        assert ctx.drop_session("persisted") is True
    with make_context(disk_path=tmp_path) as ctx:
        assert ctx.session_tier("persisted") == kvret.SessionTier.NONE


def test_pre_rope_sessions_round_trip_through_disk_after_drop_front(rng, tmp_path):
    with make_context(rope_keys=True, disk_path=tmp_path, session_dram_bytes=1) as ctx:
        with filled_sequence(ctx, rng) as seq:
            seq.drop_front(N_SINK, 30)
            seq.save_session("rope")
            assert ctx.session_tier("rope") == kvret.SessionTier.DISK
            with ctx.open_session("rope") as reopened:
                assert_same_sequence(seq, reopened, rng)
                k, v = random_kv(rng, 1)
                for s in (seq, reopened):  # the next token is rotated at the same position in both
                    s.append_decode(0, k[0], v[0])
                assert_same_sequence(seq, reopened, rng)


def test_the_shared_url_reaches_the_library():
    # Whether this build serves the shared tier or not, the URL crosses: the context has it, or the library refused it
    # by name (no server listens on port 1).
    url = "redis://127.0.0.1:1/0?prefix=kvret-python&timeout_ms=200"
    try:
        ctx = make_context(session_shared_url=url)
    except kvret.KvretError as error:
        assert "session_shared_url" in error.message, error
    else:
        with ctx:
            assert ctx.config["session_shared_url"] == url
    with make_context(session_shared_url=None) as ctx:
        assert ctx.config["session_shared_url"] is None


def test_session_tier_values():
    assert [tier.name for tier in kvret.SessionTier] == ["NONE", "DRAM", "DISK", "SHARED"]
    assert [int(tier) for tier in kvret.SessionTier] == [0, 1, 2, 3]


# ---- drop_front ----


def test_drop_front_keeps_the_first_tokens_and_moves_the_rest(rng):
    with make_context() as ctx, ctx.open_sequence() as seq:
        k0, v0 = random_kv(rng)
        k1, v1 = random_kv(rng, 10)
        seq.append_prefill(0, k0, v0)
        seq.append_prefill(1, k1, v1)
        seq.drop_front(N_SINK, 100)
        assert seq.length(0) == TOKENS - 100
        k, v = seq.read(0, 0, TOKENS - 100)
        np.testing.assert_array_equal(k, np.concatenate([k0[:N_SINK], k0[N_SINK + 100 :]]))
        np.testing.assert_array_equal(v, np.concatenate([v0[:N_SINK], v0[N_SINK + 100 :]]))
        assert seq.length(1) == N_SINK  # fewer than keep + count tokens: the rest is dropped
        np.testing.assert_array_equal(seq.read(1, 0, N_SINK)[0], k1[:N_SINK])
        q = rng.standard_normal((N_Q, D), dtype=np.float32)
        assert seq.select(0, q).shape[1] > 0  # the index was rebuilt for the keys it now has
        seq.drop_front(0, 0)  # count 0: nothing changes
        seq.drop_front(TOKENS, 5)  # every layer holds at most keep tokens: nothing changes
        seq.drop_front(2**70, 2**70)  # beyond every layer: nothing changes
        assert (seq.length(0), seq.length(1)) == (TOKENS - 100, N_SINK)
        seq.drop_front(0, 2**70)  # everything
        assert (seq.length(0), seq.length(1)) == (0, 0)


@pytest.mark.parametrize("rope_keys", [False, True])
def test_drop_front_equals_a_sequence_of_the_tokens_left(rng, rope_keys):
    # With pre-RoPE keys a token is rotated at the position it has now, so after drop_front the sequence holds
    # what a sequence given only the remaining tokens holds, whether or not kvret applies RoPE.
    with make_context(rope_keys=rope_keys) as ctx, ctx.open_sequence() as a, ctx.open_sequence() as b:
        assert ctx.config["rope_keys"] == int(rope_keys)
        k, v = random_kv(rng)
        a.append_prefill(0, k, v)
        a.append_prefill(1, k, v)
        a.drop_front(N_SINK, 50)
        left_k, left_v = np.concatenate([k[:N_SINK], k[N_SINK + 50 :]]), np.concatenate([v[:N_SINK], v[N_SINK + 50 :]])
        b.append_prefill(0, left_k, left_v)
        b.append_prefill(1, left_k, left_v)
        assert_same_sequence(a, b, rng)
        k1, v1 = random_kv(rng, 1)
        a.append_decode(0, k1[0], v1[0])  # decoding goes on after the drop
        b.append_decode(0, k1[0], v1[0])
        assert_same_sequence(a, b, rng)


# ---- bad input ----

BAD_IDS = [
    ("", kvret.Status.INVALID_ARGUMENT, "empty"),
    ("x" * 256, kvret.Status.INVALID_ARGUMENT, "256"),
    ("é" * 128, kvret.Status.INVALID_ARGUMENT, "256"),  # 128 characters, 256 bytes
    (b"a\0b", kvret.Status.INVALID_ARGUMENT, "NUL"),
    ("a\0b", kvret.Status.INVALID_ARGUMENT, "NUL"),
    ("\0", kvret.Status.INVALID_ARGUMENT, "NUL"),
    ("\ud800", kvret.Status.INVALID_ARGUMENT, "UTF-8"),  # a lone surrogate has no UTF-8
]
WRONG_ID_TYPES = [None, 5, 1.5, ["a"], object()]


def session_calls(ctx, seq):
    """(name, call taking an id) for every call that takes one."""
    return [
        ("save_session", lambda x: seq.save_session(x)),
        ("open_session", lambda x: ctx.open_session(x)),
        ("drop_session", lambda x: ctx.drop_session(x)),
        ("session_tier", lambda x: ctx.session_tier(x)),
        ("schedule_sessions", lambda x: ctx.schedule_sessions(["kept", x])),
    ]


def test_bad_session_ids_are_refused_and_change_nothing(rng):
    with make_context() as ctx, filled_sequence(ctx, rng, 40) as seq:
        seq.save_session("kept")
        before = ctx.stats()
        for name, call in session_calls(ctx, seq):
            for value, status, word in BAD_IDS:
                error = raised(lambda: call(value), status, word)
                assert "session_id" in error.message, (name, error)
            for value in WRONG_ID_TYPES:
                with pytest.raises(TypeError, match="session_id"):
                    call(value)
        assert ctx.stats() == before  # nothing saved, opened, missed or dropped
        assert ctx.session_tier("kept") == kvret.SessionTier.DRAM and seq.length(0) == 40


def test_schedule_takes_an_iterable_of_ids(context):
    for value in ("ab", b"ab", 5, None):
        with pytest.raises(TypeError, match="session_ids"):
            context.schedule_sessions(value)
    error = raised(lambda: context.schedule_sessions(["a", "b", ""]), kvret.Status.INVALID_ARGUMENT, "empty")
    assert "session_ids[2]" in error.message


def test_closed_sequences_and_contexts_are_refused(rng):
    ctx = make_context()
    seq = filled_sequence(ctx, rng, 40)
    seq.save_session("a")
    seq.close()
    raised(lambda: seq.save_session("b"), kvret.Status.INVALID_HANDLE, "closed")
    raised(lambda: seq.drop_front(0, 1), kvret.Status.INVALID_HANDLE, "closed")
    assert ctx.session_tier("b") == kvret.SessionTier.NONE
    ctx.close()
    for call in (
        lambda: ctx.open_session("a"),
        lambda: ctx.drop_session("a"),
        lambda: ctx.session_tier("a"),
        lambda: ctx.schedule_sessions(["a"]),
        lambda: ctx.flush_sessions(),
    ):
        raised(call, kvret.Status.INVALID_HANDLE, "closed")


def test_drop_front_refuses_negative_and_non_integer_counts(rng):
    with make_context() as ctx, filled_sequence(ctx, rng) as seq:
        before = contents(seq)
        for keep, count in ((-1, 1), (0, -1), (-(2**70), 0)):
            with pytest.raises(ValueError, match="keep|count"):
                seq.drop_front(keep, count)
        for keep, count in ((1.0, 1), (0, 2.5), ("1", 1), (None, 1), (0, None)):
            with pytest.raises(TypeError, match="keep|count"):
                seq.drop_front(keep, count)
        for (k, v), (bk, bv) in zip(contents(seq), before):
            np.testing.assert_array_equal(k, bk)
            np.testing.assert_array_equal(v, bv)


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"session_dram_bytes": -1}, "session_dram_bytes"),
        ({"session_disk_bytes": -1}, "session_disk_bytes"),
        ({"session_ttl_ms": -1}, "session_ttl_ms"),
        ({"session_policy": 3}, "session_policy"),
        ({"session_policy": -1}, "session_policy"),
        ({"rope_keys": 2}, "rope_keys"),
        ({"rope_keys": -1}, "rope_keys"),
        ({"rope_dims": 3}, "rope_dims"),
        ({"rope_dims": -2}, "rope_dims"),
        ({"rope_dims": D + 2}, "rope_dims"),
        ({"rope_layout": 2}, "rope_layout"),
        ({"rope_theta": 0.0}, "rope_theta"),
        ({"rope_theta": -1.0}, "rope_theta"),
        ({"rope_theta": float("nan")}, "rope_theta"),
        ({"rope_theta": float("inf")}, "rope_theta"),
        ({"rope_scale_factor": 0.5}, "rope_scale_factor"),
        ({"rope_scale_factor": -1.0}, "rope_scale_factor"),
        ({"rope_scale_factor": float("nan")}, "rope_scale_factor"),
        ({"rope_low_freq_factor": 0.0}, "rope_low_freq_factor"),
        ({"rope_low_freq_factor": float("inf")}, "rope_low_freq_factor"),
        ({"rope_high_freq_factor": 1.0}, "rope_high_freq_factor"),  # not above rope_low_freq_factor (1)
        ({"rope_high_freq_factor": float("nan")}, "rope_high_freq_factor"),
        ({"rope_original_max_positions": 0}, "rope_original_max_positions"),
        ({"rope_original_max_positions": -5}, "rope_original_max_positions"),
    ],
)
def test_invalid_session_and_rope_fields(overrides, field):
    error = raised(lambda: make_context(**overrides), kvret.Status.INVALID_ARGUMENT)
    assert field in error.message


def test_session_and_rope_fields_by_name():
    with pytest.raises(ValueError, match="session_policy"):
        make_context(session_policy="mru")
    with pytest.raises(ValueError, match="rope_layout"):
        make_context(rope_layout="llama")
    with make_context(session_policy="fifo", rope_layout="gptj", session_ttl_ms=60_000) as ctx:
        config = ctx.config
        assert config["session_policy"] == "fifo" and config["rope_layout"] == "gptj"
        assert config["session_ttl_ms"] == 60_000 and config["session_shared_url"] is None
        with kvret.Context(**config) as again:
            assert again.config == config


def test_the_extension_refuses_what_the_package_would_not_pass(rng):
    # The package always passes bytes without a NUL; the extension checks again and raises, never crashes.
    c = kvret.kvret_swig
    with make_context() as ctx, filled_sequence(ctx, rng, 40) as seq:
        for _ in range(20):
            with pytest.raises(TypeError):
                c.kvret_session_save(seq._handle, "a str")
            with pytest.raises(ValueError, match="NUL"):
                c.kvret_session_open(ctx._handle, b"a\0b")
            with pytest.raises(TypeError):
                c.kvret_session_schedule(ctx._handle, [b"a", 5])
            with pytest.raises(ValueError, match="NUL"):
                c.kvret_session_schedule(ctx._handle, [b"a", b"\0"])
            with pytest.raises(TypeError):
                c.kvret_session_schedule("not a handle", [b"a", b"b"])
            with pytest.raises(TypeError):
                c.kvret_session_schedule(ctx._handle, 5)
            with pytest.raises(TypeError):
                c.kvret_swig_create(None, None, "a str")
        c.kvret_session_schedule(ctx._handle, (b"a", b"b"))
        assert c.kvret_session_where(ctx._handle, b"a") == kvret.SessionTier.NONE


def test_disk_paths_are_utf8_both_ways(rng, tmp_path):
    directory = tmp_path / "café-🙂"
    with make_context(disk_path=directory, session_dram_bytes=1) as ctx, filled_sequence(ctx, rng, 40) as seq:
        assert ctx.config["disk_path"] == str(directory)
        seq.save_session("s")
        assert ctx.session_tier("s") == kvret.SessionTier.DISK and directory.is_dir()
