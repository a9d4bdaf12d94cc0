"""`hf-moe-offload serve` under load and faults, with and without continuous batching: 32 concurrent streaming
clients each get their greedy answer, a client that disconnects mid-stream leaves nothing held, a failed expert read
fails its request and nothing else, SIGTERM lets an answer in flight finish and exits cleanly. Every server runs
on 127.0.0.1 at a free port, in its own process, model copy and TMPDIR; every request has a timeout."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from hf_moe_offload.demo import DEMO_MODEL
from serve_helpers import Reference, served_model_copy, start_server

CLIENTS = 32
NEW_TOKENS = 10
LONG_TOKENS = 300          # a stream long enough to be cut off in the middle
REQUEST_TIMEOUT_S = 120
IDLE_WAIT_S = 15
# Continuous batching with a KV cache of 12 blocks of 64 tokens: fewer than 32 requests fit at once (the others
# wait for blocks), and the --cb-* fields must reach the live manager.
CB_FLAGS = ("--continuous-batching", "--cb-num-blocks", "12", "--cb-block-size", "64")


def _prompts() -> list[str]:
    """32 distinct prompts from the demo model's held-out texts (a few words each)."""
    with open(os.path.join(DEMO_MODEL, "heldout.jsonl")) as f:
        texts = [json.loads(line)["text"] for line in f]
    words = " ".join(texts).split()
    return [" ".join(words[i * 7:i * 7 + 4 + i % 5]) for i in range(CLIENTS)]


PROMPTS = _prompts()
# A prompt long enough that its prefill routes to more experts than the cache holds: it reads from the checkpoint.
LONG_PROMPT = " ".join(" ".join(PROMPTS).split()[:60])


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Reference:
    return Reference(served_model_copy(tmp_path_factory.mktemp("reference")))


@pytest.fixture(scope="module")
def expected(reference) -> list[str]:
    """The greedy answer of each prompt: even ones as chat, odd ones as completions."""
    return [reference.chat(p) if i % 2 == 0 else reference.completion(p) for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module", params=["continuous_batching", "sequential"])
def server(request, tmp_path_factory):
    """A server of its own model copy: with continuous batching (`CB_FLAGS`), or one request at a time."""
    flags = CB_FLAGS if request.param == "continuous_batching" else ()
    folder = tmp_path_factory.mktemp(request.param)
    tmp = folder / "tmp"
    tmp.mkdir()
    server = start_server(served_model_copy(folder), tmp, *flags)
    server.continuous_batching = bool(flags)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)


def _stream(client: openai.OpenAI, model: str, i: int, prompt: str, new_tokens: int = NEW_TOKENS) -> str:
    """The streamed answer to `prompt`: a chat for even `i`, a completion for odd."""
    if i % 2 == 0:
        chunks = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=new_tokens, temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    chunks = client.completions.create(model=model, prompt=prompt, max_tokens=new_tokens, temperature=0, stream=True)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def _wait_idle(server) -> dict | None:
    """The batching state once no request runs, waits, holds KV blocks or has a result callback (continuous
    batching), or after `IDLE_WAIT_S`."""
    deadline = time.monotonic() + IDLE_WAIT_S
    while True:
        state = server.batching()
        if state is None or _held(state) == (0, 0, 0, 0) or time.monotonic() > deadline:
            return state
        time.sleep(0.2)


def _held(state: dict) -> tuple[int, int, int, int]:
    return state["running"], state["waiting"], state["kv_blocks_held"], state["result_handlers"]


def _assert_idle(server) -> None:
    state = _wait_idle(server)
    if server.continuous_batching:
        assert state is not None and state["alive"], state
        assert _held(state) == (0, 0, 0, 0), state


def test_32_concurrent_streaming_clients_each_get_their_own_greedy_answer(server, client, expected):
    with ThreadPoolExecutor(CLIENTS) as pool:
        answers = list(pool.map(lambda i: _stream(client, server.model, i, PROMPTS[i]), range(CLIENTS)))
    assert answers == expected
    _assert_idle(server)


def test_the_cb_flags_are_the_live_managers_sizes(server):
    if not server.continuous_batching:
        pytest.skip("--cb-* flags need --continuous-batching")
    config = server.batching()["config"]
    assert (config["num_blocks"], config["page_size"]) == (12, 64), config
    assert isinstance(config["safety_margin"], float), config     # left unset: the scheduler's own value


def test_a_client_that_disconnects_mid_stream_frees_its_request_and_stalls_nobody(server, client, expected):
    passes_before = server.stats()["models"][server.model]["forward_calls"]
    body = {"model": server.model, "prompt": PROMPTS[1], "max_tokens": LONG_TOKENS, "temperature": 0, "stream": True}
    connection = http.client.HTTPConnection(server.base.removeprefix("http://"), timeout=REQUEST_TIMEOUT_S)
    with ThreadPoolExecutor(4) as pool:
        try:
            connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            response = connection.getresponse()
            assert response.status == 200
            for _ in range(3):                     # a few tokens in: the request is running
                while not response.readline().startswith(b"data:"):
                    pass
            # others arrive while it runs (without continuous batching they wait for it)
            others = [pool.submit(_stream, client, server.model, i, PROMPTS[i]) for i in range(4)]
            # Short: the cut-off request generates meanwhile, and a fast machine must stay well under its length.
            time.sleep(0.1)
        finally:
            connection.close()                     # the client goes away mid-stream
        assert [f.result(timeout=REQUEST_TIMEOUT_S) for f in others] == expected[:4]
    _assert_idle(server)
    started = time.monotonic()
    assert _stream(client, server.model, 5, PROMPTS[5]) == expected[5]
    assert time.monotonic() - started < 30
    # The cut-off request stopped: its remaining tokens would have taken one forward pass each.
    passes = server.stats()["models"][server.model]["forward_calls"] - passes_before
    assert passes < LONG_TOKENS - 50, passes


def test_a_failed_expert_read_fails_that_request_and_the_server_goes_on(server, client, reference):
    """The checkpoint file changes under the server (its mtime moves): every expert read is refused with an
    IntegrityError naming it. The requests then get an error (an error event in the stream, a 500 otherwise); once
    the file is back as indexed, the next requests get their greedy answers."""
    shard = os.path.join(server.model, "model.safetensors")
    st = os.stat(shard)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    try:
        with pytest.raises(openai.APIError):
            _stream(client, server.model, 1, LONG_PROMPT)
        with pytest.raises(openai.InternalServerError, match="changed since it was indexed"):
            client.completions.create(model=server.model, prompt=LONG_PROMPT + " again", max_tokens=NEW_TOKENS,
                                      temperature=0)
    finally:
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert _stream(client, server.model, 1, LONG_PROMPT) == reference.completion(LONG_PROMPT)
    answer = client.completions.create(model=server.model, prompt=PROMPTS[3], max_tokens=NEW_TOKENS, temperature=0)
    assert answer.choices[0].text == reference.completion(PROMPTS[3])
    with urllib.request.urlopen(server.base + "/health", timeout=10) as health:
        assert health.status == 200
    _assert_idle(server)
    if server.continuous_batching:
        assert server.batching()["failed_passes"] >= 1


def test_a_request_longer_than_the_kv_cache_fails_alone_and_the_server_goes_on(tmp_path, reference):
    """`--max-seq-len 64` sizes a KV cache of one 256-token block: a prompt of about 300 tokens can never be
    scheduled. It gets an error naming the sizes; the loop stays alive and the next request gets its answer."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    server = start_server(served_model_copy(tmp_path), tmp, "--continuous-batching", "--max-seq-len", "64")
    try:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S,
                               max_retries=0)
        words = " ".join(PROMPTS).split()
        too_long = " ".join((words * 4)[:300])
        assert len(reference.tokenizer(too_long)["input_ids"]) > 256
        with pytest.raises(openai.InternalServerError, match="needs more KV cache than the server has"):
            client.completions.create(model=server.model, prompt=too_long, max_tokens=NEW_TOKENS, temperature=0)
        answer = client.completions.create(model=server.model, prompt=PROMPTS[3], max_tokens=NEW_TOKENS,
                                           temperature=0)
        assert answer.choices[0].text == reference.completion(PROMPTS[3])
        with urllib.request.urlopen(server.base + "/health", timeout=10) as health:
            assert health.status == 200
        state = server.batching()
        assert state["alive"] and _held(state) == (0, 0, 0, 0), state
    finally:
        server.stop()


def test_zz_sigterm_lets_the_answer_in_flight_finish_then_exits_cleanly(server, client, reference):
    """Runs last for each server (name order): SIGTERM during a stream; the stream still ends with the whole greedy
    answer, and the process exits within seconds with SIGTERM's status (uvicorn re-raises it after the app's
    shutdown), no traceback, no generation thread left behind, and nothing in its temp folder."""
    long_answer = {}

    def stream() -> None:
        long_answer["text"] = _stream(client, server.model, 1, PROMPTS[7], new_tokens=60)

    reader = threading.Thread(target=stream)
    reader.start()
    time.sleep(0.5)
    server.proc.send_signal(signal.SIGTERM)
    reader.join(timeout=REQUEST_TIMEOUT_S)
    started = time.monotonic()
    out = server.output()
    assert time.monotonic() - started < 30
    assert long_answer.get("text") == reference.completion(PROMPTS[7], new_tokens=60)
    assert server.proc.returncode in (0, -signal.SIGTERM), out[-3000:]
    shutdown = out[out.index("Shutting down"):]     # earlier tests logged the failed reads' tracebacks
    assert "Application shutdown complete" in shutdown and "Traceback" not in shutdown, shutdown[-3000:]
    assert "did not exit" not in shutdown
    assert list(server.tmp.iterdir()) == []
