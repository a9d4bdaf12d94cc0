"""What the `hf-moe-offload serve` tests share: the served demo model (with a chat template), a server process on
127.0.0.1 at a free port, and the greedy answers of plain `generate` on the model loaded without offloading."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_moe_offload.demo import DEMO_MODEL

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}"
                 "{% else %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
PROMPT = "The import statement"
NEW_TOKENS = 10
STARTUP_S = 90
# The policy every test server runs with: experts read from the checkpoint on a cache miss.
POLICY_ARGS = ("--device", "cpu", "--store", "disk", "--expert-cache", "50%", "--dtype", "float32")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 10) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def served_model_copy(folder: Path) -> Path:
    """The demo model copied to `folder`/model, with a chat template (it ships none)."""
    path = folder / "model"
    shutil.copytree(DEMO_MODEL, path)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return path


@dataclass
class Server:
    """A `hf-moe-offload serve` process, its address, temp folder and served model (its name in requests)."""

    proc: subprocess.Popen
    base: str
    tmp: Path
    model: str

    def stats(self) -> dict:
        return get_json(self.base + "/v1/offload/stats")

    def batching(self) -> dict | None:
        """The continuous-batching state the stats endpoint reports for the served model."""
        return self.stats()["batching"][self.model]

    def output(self) -> str:
        """Everything the process printed (once it has exited)."""
        return self.proc.communicate(timeout=30)[0].decode()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def start_server(model_dir: Path, tmp: Path, *flags: str) -> Server:
    """Start `hf-moe-offload serve model_dir` with the test policy and `flags`, in its own TMPDIR; return once
    /health answers ok (the model is loaded before the server listens)."""
    port = free_port()
    env = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "hf_moe_offload.cli", "serve", str(model_dir), "--port", str(port),
                             *POLICY_ARGS, *flags], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    server = Server(proc, f"http://127.0.0.1:{port}", tmp, str(model_dir))
    deadline = time.monotonic() + STARTUP_S
    while True:
        try:
            if get_json(server.base + "/health")["status"] == "ok":
                return server
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"server did not start: {proc.communicate()[0].decode()[-3000:]}")
        time.sleep(0.3)


class Reference:
    """Greedy continuations of plain `generate` on the model loaded without offloading."""

    def __init__(self, model_dir: Path):
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def _greedy(self, inputs, new_tokens: int) -> str:
        with torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
        return self.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)

    def chat(self, prompt: str, new_tokens: int = NEW_TOKENS) -> str:
        inputs = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                    return_dict=True, return_tensors="pt")
        return self._greedy(inputs, new_tokens)

    def completion(self, prompt: str, new_tokens: int = NEW_TOKENS) -> str:
        return self._greedy(self.tokenizer(prompt, return_tensors="pt"), new_tokens)
