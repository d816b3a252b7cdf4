"""The shared session tier (session_shared_url): two contexts on one Redis server, as two nodes of a serving stack.
Each test starts its own redis-server on a free port (skipped where none is installed)."""

import contextlib
import shutil
import socket
import subprocess
import time

import numpy as np
import pytest
from conftest import GEOMETRY, TOKENS, make_context, random_kv

import kvret

LAYERS = GEOMETRY["n_layers"]


@contextlib.contextmanager
def redis_server(tmp_path, *extra):
    """A redis-server on a free loopback port (extra: more arguments); yields the port."""
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    args = [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *extra]
    process = subprocess.Popen(args + ["--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    pytest.skip("redis-server did not start")
                time.sleep(0.05)
        yield port
    finally:
        process.terminate()
        process.wait()


@pytest.fixture
def redis_url(tmp_path):
    with redis_server(tmp_path) as port:
        yield f"redis://127.0.0.1:{port}/0?prefix=kvret-python-{port}"


def filled_sequence(ctx, rng):
    seq = ctx.open_sequence()
    for layer in range(LAYERS):
        seq.append_prefill(layer, *random_kv(rng))
    return seq


def test_another_context_opens_what_one_saved(redis_url, rng):
    with make_context(session_shared_url=redis_url) as a, make_context(session_shared_url=redis_url) as b:
        assert a.config["session_shared_url"] == redis_url
        with filled_sequence(a, rng) as seq:
            seq.save_session("shared-1")
            a.flush_sessions()
            assert b.session_tier("shared-1") == kvret.SessionTier.SHARED
            with b.open_session("shared-1") as reopened:
                assert reopened.context is b
                for layer in range(LAYERS):
                    assert reopened.length(layer) == TOKENS
                    for got, want in zip(reopened.read(layer, 0, TOKENS), seq.read(layer, 0, TOKENS)):
                        np.testing.assert_array_equal(got, want)
                q = rng.standard_normal((GEOMETRY["n_q_heads"], GEOMETRY["head_dim"]), dtype=np.float32)
                np.testing.assert_array_equal(reopened.select(0, q), seq.select(0, q))
        assert b.open_session("never-saved") is None
        assert b.drop_session("shared-1") is True
        assert b.session_tier("shared-1") == kvret.SessionTier.NONE


def test_malformed_urls_are_refused_by_name():
    for url in ("http://127.0.0.1:6379", "redis://127.0.0.1:99999", "redis://"):
        with pytest.raises(kvret.KvretError) as info:
            make_context(session_shared_url=url)
        assert info.value.status == kvret.Status.INVALID_ARGUMENT, info.value
        assert "session_shared_url" in info.value.message


def test_the_config_masks_the_password_and_the_context_still_authenticates(tmp_path):
    with redis_server(tmp_path, "--requirepass", "py-s3cret@pw") as port:
        url = f"redis://:py-s3cret%40pw@127.0.0.1:{port}/0?prefix=masked"
        with make_context(session_shared_url=url) as a, make_context(session_shared_url=url) as b:
            shown = a.config["session_shared_url"]
            assert "s3cret" not in shown
            assert shown == f"redis://:***@127.0.0.1:{port}/0?prefix=masked"
            assert "s3cret" not in repr(a.config)
            with filled_sequence(a, np.random.default_rng(5)) as seq:
                seq.save_session("masked")
            a.flush_sessions()
            assert b.session_tier("masked") == kvret.SessionTier.SHARED
