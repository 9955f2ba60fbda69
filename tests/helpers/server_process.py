"""``gqa serve`` as a child process on a free port of 127.0.0.1, and plain HTTP calls to it (tests/serve)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import closing

MODEL = "SmolLM2-135M-Instruct"  # the embedded model's name in the API
HERMES_KEY = "sk-test-hermes"  # the API key of tests/serve's shared Hermes server (conftest.hermes_server)
# A Hermes-style template (as Qwen2.5's, shortened): tools in the system turn, calls as <tool_call> JSON
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def free_port() -> int:
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``gqa serve`` in a child process on a free port; ready once ``/health`` answers. ``kv_cache_mib``: the pool
    (``None``: the server's default)."""

    def __init__(self, *flags: str, kv_cache_mib: str | None = "64") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        pool = [] if kv_cache_mib is None else ["--kv-cache-mib", kv_cache_mib]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gqa", "serve", "--port", str(self.port), *pool, *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"},
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gqa serve exited {self.proc.returncode}: {self.proc.stdout.read()}")
            try:
                if get(self.url + "/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("gqa serve did not start in 120 s")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def metrics(self) -> dict[str, float]:
        text = get(self.url + "/metrics")[1]
        return {k: float(v) for k, v in (line.split() for line in text.splitlines() if not line.startswith("#"))}


def get(url: str, headers: dict | None = None) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def post(url: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)
