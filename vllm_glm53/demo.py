"""The main job, end to end on this machine: serve a tiny GLM-5.3 checkpoint with ``vllm serve`` and talk to it.

    python -m vllm_glm53.demo [--checkpoint DIR] [--port N] [--keep-checkpoint]

Builds (or reuses) a tiny random checkpoint, starts ``vllm serve`` on 127.0.0.1 with the plugin's tokenizer
mode and parsers, waits until it is healthy, sends a chat request with a tool and ``reasoning_effort`` through
the ``openai`` client, prints the split reply (reasoning, content, tool calls) and the server's throughput
line, then stops the server. The weights are random, so the words are nonsense; the plumbing is real.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

SERVED_NAME = "glm-5.3-tiny"
MILESTONES = re.compile(
    r"vllm-glm53 .* registered|Resolved architecture|Loading weights took|model weights took|KV cache size|"
    r"init engine|Starting vLLM (API|server)|Application startup complete|Avg prompt throughput|ERROR|Error"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(checkpoint: Path, port: int, extra_args: tuple[str, ...] = ()) -> tuple[list[str], dict[str, str]]:
    """The CPU recipe (``recipes/cpu-tiny.yaml``) for a local checkpoint: ``vllm serve`` argv and environment."""
    from vllm_glm53.recipes import cpu_plan

    # --shutdown-timeout: on SIGTERM vLLM's default (0) aborts the engine core and force-kills its worker; a drain
    # window lets them stop in order. (vLLM 0.32 may still log a spurious EngineDeadError traceback from its output
    # handler during a normal shutdown: a race in AsyncLLM.shutdown, vllm-project/vllm#48745.)
    launch = cpu_plan(checkpoint, port=port,
                      extra_args=("--served-model-name", SERVED_NAME, "--shutdown-timeout", "10",
                                  *extra_args)).serve_launches()[0]
    argv = [str(Path(sys.executable).with_name("vllm")), *launch.argv[1:]]  # this environment's vllm command
    return argv, dict(launch.env)


class Server:
    """``vllm serve`` in a child process; echoes startup milestones and keeps the log for later lines."""

    def __init__(self, argv: list[str], env: dict[str, str], echo: bool = True) -> None:
        self.echo = echo
        self.lines: list[str] = []
        self.proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            line = line.rstrip()
            self.lines.append(line)
            if self.echo and MILESTONES.search(line):
                print(f"  [server] {line[-160:]}", flush=True)

    def wait_healthy(self, url: str, timeout: float = 600) -> None:
        import urllib.request

        start = time.time()
        while time.time() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError("vllm serve exited during startup:\n" + "\n".join(self.lines[-40:]))
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise TimeoutError(f"server not healthy after {timeout:.0f} s")

    def wait_for_line(self, pattern: str, timeout: float) -> str | None:
        rx = re.compile(pattern)
        start = time.time()
        while time.time() - start < timeout:
            for line in reversed(self.lines):
                if rx.search(line):
                    return line
            time.sleep(0.5)
        return None

    def stop(self) -> int:
        if self.proc.poll() is None:
            # SIGTERM to the API server alone: it shuts its engine processes down in order. Signalling the whole
            # process group would kill the engine core under it first.
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._reader.join(timeout=10)  # the log's last lines, for callers that read them
        return self.proc.returncode


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}


def show_reply(title: str, reply) -> None:
    msg = reply.choices[0].message
    reasoning = getattr(msg, "reasoning", None) or getattr(msg, "reasoning_content", None)
    calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in (msg.tool_calls or [])]
    print(f"== {title}")
    print(f"  reasoning : {reasoning!r}")
    print(f"  content   : {msg.content!r}")
    print(f"  tool calls: {json.dumps(calls)}")
    print(f"  finish    : {reply.choices[0].finish_reason}, usage: {reply.usage.prompt_tokens} prompt + "
          f"{reply.usage.completion_tokens} completion tokens")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_glm53.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=Path(".demo/tiny-glm53"))
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)

    t0 = time.time()
    if not (args.checkpoint / "config.json").exists():
        print(f"== building the tiny checkpoint in {args.checkpoint}", flush=True)
        from vllm_glm53.tiny import build_checkpoint

        build_checkpoint(args.checkpoint)
    else:
        print(f"== reusing the tiny checkpoint in {args.checkpoint}", flush=True)

    port = args.port or free_port()
    cmd, env = serve_command(args.checkpoint, port)
    print("== starting: " + " ".join(f"{k}={v}" for k, v in env.items()) + " " + " ".join(cmd), flush=True)
    server = Server(cmd, env)
    url = f"http://127.0.0.1:{port}"
    try:
        server.wait_healthy(url)
        print(f"== server healthy after {time.time() - t0:.0f} s; sending a chat request with a tool", flush=True)
        from openai import OpenAI

        client = OpenAI(base_url=url + "/v1", api_key="unused")
        reply = client.chat.completions.create(
            model=SERVED_NAME,
            messages=[{"role": "user", "content": "What is the weather like in Paris?"}],
            tools=[WEATHER_TOOL],
            reasoning_effort="high",
            max_tokens=48,
            temperature=0,
        )
        show_reply("reply (reasoning_effort=high, tool_choice=auto)", reply)
        # A random model never closes its reasoning on its own; end it at once and require a call, so that the
        # tool-call grammar and the glm47 parser show a parsed call.
        from transformers import AutoTokenizer

        end_think = AutoTokenizer.from_pretrained(str(args.checkpoint)).convert_tokens_to_ids("</think>")
        forced = client.chat.completions.create(
            model=SERVED_NAME,
            messages=[{"role": "user", "content": "What is the weather like in Paris?"}],
            tools=[WEATHER_TOOL], tool_choice="required", logit_bias={str(end_think): 100},
            max_tokens=64, temperature=0,
        )
        show_reply("reply (tool_choice=required)", forced)
        line = server.wait_for_line(r"Avg prompt throughput", timeout=20)
        print("== server throughput: " + (line.split("] ", 1)[-1] if line else "(no stats line logged yet)"))
    finally:
        rc = server.stop()
        print(f"== server stopped (exit code {rc}); total {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
