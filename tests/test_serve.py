"""`hf-moe-offload serve`: transformers' server with an offloaded model, driven by the openai client and curl over
127.0.0.1; greedy answers equal plain `generate` on the model loaded without offloading."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import urllib.error
import urllib.request

import openai
import pytest

from hf_moe_offload.cli import build_parser
from hf_moe_offload.serving.cli import cb_overrides
from hf_moe_offload.serving.hook import check_transformers
from serve_helpers import NEW_TOKENS, PROMPT, Reference, get_json as _get, served_model_copy, start_server


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The demo model with a chat template (it ships none)."""
    return served_model_copy(tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """One server for the module, with continuous batching, in its own process and temp folder."""
    server = start_server(model_dir, tmp_path_factory.mktemp("server_tmp"), "--continuous-batching")
    yield {"base": server.base, "proc": server.proc, "tmp": server.tmp, "model": server.model}
    server.stop()


@pytest.fixture(scope="module")
def reference(model_dir):
    """Greedy continuations of plain `generate` on the model loaded without offloading: (chat, completion)."""
    ref = Reference(model_dir)
    return ref.chat(PROMPT), ref.completion(PROMPT)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key="unused", timeout=60, max_retries=0)


def test_chat_completion_equals_plain_generate(server, client, reference):
    messages = [{"role": "user", "content": PROMPT}]
    answer = client.chat.completions.create(model=server["model"], messages=messages, max_tokens=NEW_TOKENS,
                                            temperature=0)
    assert answer.choices[0].message.content == reference[0]
    chunks = client.chat.completions.create(model=server["model"], messages=messages, max_tokens=NEW_TOKENS,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference[0]


def test_completion_equals_plain_generate(server, client, reference):
    answer = client.completions.create(model=server["model"], prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0)
    assert answer.choices[0].text == reference[1]
    chunks = client.completions.create(model=server["model"], prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference[1]


def test_curl_and_the_stats_endpoint_count_the_requests_experts(server, reference):
    curl = shutil.which("curl")
    if curl is None:
        pytest.fail("curl is needed for this test")
    before = _get(server["base"] + "/v1/offload/stats")["models"][server["model"]]
    body = json.dumps({"prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0})
    out = subprocess.run([curl, "-sS", "--max-time", "60", server["base"] + "/v1/completions", "-H",
                          "Content-Type: application/json", "-d", body], capture_output=True, check=True, timeout=90)
    assert json.loads(out.stdout)["choices"][0]["text"] == reference[1]
    after = _get(server["base"] + "/v1/offload/stats")["models"][server["model"]]
    # every new token and the prompt route through top-2 of 8 experts in each of the 4 layers
    assert after["experts_used"] - before["experts_used"] >= NEW_TOKENS * 4 * 2
    assert after["hits"] + after["misses"] > before["hits"] + before["misses"]
    models = _get(server["base"] + "/v1/models")["data"]
    assert [m["id"] for m in models] == [server["model"]]


def test_bad_requests_get_a_4xx_and_the_server_keeps_serving(server, client, reference):
    for body in ({"prompt": 3, "max_tokens": 2}, {"model": "another/model", "prompt": PROMPT, "max_tokens": 2}):
        request = urllib.request.Request(server["base"] + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=30)
        assert 400 <= err.value.code < 500, body
    # Malformed fields transformers would fail on with a 500: a 400 in OpenAI's shape naming the field.
    chat = {"model": server["model"], "messages": [{"role": "user", "content": "Hi"}]}
    for route, body, named in (("/v1/chat/completions", {**chat, "messages": []}, "messages must be a non-empty"),
                               ("/v1/chat/completions", {**chat, "messages": "hi"}, "messages must be"),
                               ("/v1/chat/completions", {**chat, "messages": [{"content": "x"}]}, "messages[0]"),
                               ("/v1/chat/completions", {**chat, "max_tokens": "abc"}, "max_tokens must be"),
                               ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens must be"),
                               ("/v1/completions", {"prompt": PROMPT, "temperature": "hot"}, "temperature must"),
                               ("/v1/completions", {"prompt": PROMPT, "stop": 5}, "stop must be")):
        request = urllib.request.Request(server["base"] + route, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=30)
        error = json.loads(err.value.read())["error"]
        assert err.value.code == 400 and error["type"] == "invalid_request_error", body
        assert named in error["message"], (body, error)
    answer = client.completions.create(model=server["model"], prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0)
    assert answer.choices[0].text == reference[1]


def test_zz_sigterm_stops_the_server_cleanly(server):
    """Runs last in the module (name order): SIGTERM shuts the app down (uvicorn then re-raises the signal, so the
    status is that of SIGTERM) within seconds, leaving nothing in its temp folder."""
    proc = server["proc"]
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=30)[0].decode()
    assert proc.returncode in (0, -signal.SIGTERM), out[-3000:]
    assert "Application shutdown complete" in out and "Traceback" not in out
    assert list(server["tmp"].iterdir()) == []


def test_transformers_still_has_what_the_hook_relies_on():
    check_transformers()


def test_flags_keep_transformers_names_and_the_cb_flags_win():
    args = build_parser().parse_args(["serve", "m", "--cb-num-blocks", "8", "--continuous-batching",
                                      "--store", "disk", "--log-level", "info"])
    assert (args.host, args.port, args.continuous_batching) == ("127.0.0.1", 8000, True)
    assert cb_overrides(args) == {"num_blocks": 8}


def test_bad_arguments_get_one_error_line(tmp_path, capsys, model_dir):
    from hf_moe_offload.cli import main

    assert main(["serve", str(tmp_path / "missing")]) == 2
    assert "error: MODEL" in capsys.readouterr().err
    assert main(["serve", str(model_dir), "--cb-num-blocks", "4"]) == 2
    assert "need --continuous-batching" in capsys.readouterr().err


@pytest.mark.parametrize("flags, named", [(["--port", "70000"], "--port: '70000' is out of range"),
                                          (["--chat-template-kwargs", "{bad"], "--chat-template-kwargs: not JSON"),
                                          (["--chat-template-kwargs", "[1]"], "expected a JSON object"),
                                          (["--continuous-batching", "--cb-block-size", "0"], "--cb-block-size: '0'"),
                                          (["--continuous-batching", "--cb-max-memory-percent", "2"],
                                           "between 0 and 1")])
def test_bad_server_flags_are_refused_before_the_model_loads(model_dir, capsys, flags, named):
    """Values transformers serve would fail on with a traceback (a port out of range, kwargs that are not a JSON
    object) or accept and misbehave with (a KV cache block of 0 tokens): argparse's one line, status 2."""
    from hf_moe_offload.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", str(model_dir), *flags])
    assert exit_.value.code == 2 and named in capsys.readouterr().err
