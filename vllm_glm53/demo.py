"""The main job, end to end on this machine: serve a tiny GLM-5.3 checkpoint with ``vllm serve`` and talk to it.

    python -m vllm_glm53.demo [--checkpoint DIR] [--port N] [--mtp N]

Serves the trained tiny checkpoint that ships in the package (``vllm_glm53.tiny_trained``: every layer kind of
GLM-5.3-Flash, trained on CPU to think, call tools and answer) with ``vllm serve``, the plugin's tokenizer mode
and parsers, and MTP speculative decoding. Then, through the ``openai`` client, streamed: a question that needs a
tool, the model's own tool call (``tool_choice=auto``) parsed by the ``glm47`` parsers, the tool's result, and
the model's final answer, reasoning split out; a question that needs no tool; the MTP acceptance and the
throughput from the server's ``/metrics``. Then it stops the server.
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
    r"init engine|Starting vLLM (API|server)|Application startup complete"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(checkpoint: Path, port: int, extra_args: tuple[str, ...] = (),
                  features: tuple[str, ...] = ()) -> tuple[list[str], dict[str, str]]:
    """The CPU recipe (``recipes/cpu-tiny.yaml``) for a local checkpoint: ``vllm serve`` argv and environment
    (``features``: recipe features such as ``mtp=2``)."""
    from vllm_glm53.recipes import cpu_plan

    # --shutdown-timeout: on SIGTERM vLLM's default (0) aborts the engine core and force-kills its worker; a drain
    # window lets them stop in order. (vLLM 0.32 may still log a spurious EngineDeadError traceback from its output
    # handler during a normal shutdown: a race in AsyncLLM.shutdown, vllm-project/vllm#48745; Server hides it.)
    launch = cpu_plan(checkpoint, port=port, features=features,
                      extra_args=("--served-model-name", SERVED_NAME, "--shutdown-timeout", "10",
                                  *extra_args)).serve_launches()[0]
    argv = [str(Path(sys.executable).with_name("vllm")), *launch.argv[1:]]  # this environment's vllm command
    return argv, dict(launch.env)


# vLLM 0.32's AsyncLLM.shutdown stops the engine core before it cancels its output handler; when the handler
# wakes first it logs this, with an EngineDeadError traceback (vllm-project/vllm#48745). After a stop we asked for,
# that one record is expected and says nothing about the run.
SHUTDOWN_RACE = "AsyncLLM output_handler failed"
SHUTDOWN_RACE_NOTE = ("vLLM 0.32 logged its known EngineDeadError from AsyncLLM's output handler during the requested "
                      "shutdown (vllm-project/vllm#48745): harmless, traceback not shown")
_LOG_RECORD = re.compile(r"\b(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")


class Server:
    """``vllm serve`` in a child process; echoes startup milestones and keeps the log for later lines.

    ``echo``: print the startup milestones and every error line (True), only error lines ("errors"), or nothing.
    ``errors`` collects every ERROR record and traceback line except vLLM's known shutdown race after a requested
    stop, which only sets ``shutdown_race_seen``."""

    def __init__(self, argv: list[str], env: dict[str, str], echo: bool | str = True) -> None:
        self.echo = echo
        self.lines: list[str] = []
        self.errors: list[str] = []
        self.stopping = False
        self.shutdown_race_seen = False
        self._in_race = False
        self.proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            line = line.rstrip()
            self.lines.append(line)
            if self.stopping and SHUTDOWN_RACE in line:
                self._in_race = self.shutdown_race_seen = True
                continue
            if self._in_race:
                # The traceback's lines carry the same ERROR prefix or none; the next other record ends it.
                record = _LOG_RECORD.search(line)
                if record is None or record.group(1) == "ERROR":
                    continue
                self._in_race = False
            error = "ERROR" in line or "Traceback" in line
            if error:
                self.errors.append(line)
            if (self.echo and error) or (self.echo is True and MILESTONES.search(line)):
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
        self.stopping = True
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



# ---------------------------------------------------------------------------------------------------------
# The conversation
# ---------------------------------------------------------------------------------------------------------


def metrics(url: str) -> dict[str, float]:
    """The server's Prometheus counters, summed over label sets."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            try:
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return out


class Turn:
    """One streamed assistant turn, as the parsers split it: reasoning, content, tool calls."""

    def __init__(self) -> None:
        self.reasoning = ""
        self.content = ""
        self.calls: dict[int, dict] = {}
        self.finish_reason = None
        self.completion_tokens = 0
        self.seconds = 0.0

    def tool_calls(self) -> list[dict]:
        """The calls in the form a client sends back in the next request's history."""
        return [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for _, c in sorted(self.calls.items())]


def stream_turn(client, messages: list[dict], tools, out=print, **kwargs) -> Turn:
    """Send one chat request with ``stream=True`` and print the reasoning and the answer as they arrive."""
    turn = Turn()
    start = time.time()
    section = None

    def show(kind: str, text: str) -> None:
        nonlocal section
        if section != kind:
            out(("\n" if section else "") + f"  {kind:<9} | ", end="")
            section = kind
        out(text, end="")

    stream = client.chat.completions.create(model=SERVED_NAME, messages=messages, tools=tools, stream=True,
                                            stream_options={"include_usage": True}, temperature=0, **kwargs)
    for chunk in stream:
        if chunk.usage:
            turn.completion_tokens = chunk.usage.completion_tokens
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        reasoning = getattr(delta, "reasoning", None) or getattr(delta, "reasoning_content", None)
        if reasoning:
            turn.reasoning += reasoning
            show("reasoning", reasoning)
        if delta.content:
            turn.content += delta.content
            show("answer", delta.content)
        for call in delta.tool_calls or ():
            entry = turn.calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = call.id or entry["id"]
            if call.function and call.function.name:
                entry["name"] += call.function.name
            if call.function and call.function.arguments:
                entry["arguments"] += call.function.arguments
        if choice.finish_reason:
            turn.finish_reason = choice.finish_reason
    turn.seconds = time.time() - start
    if section:
        out("")
    for _, call in sorted(turn.calls.items()):
        out(f"  tool call | {call['name']}({call['arguments']})")
    out(f"  ({turn.finish_reason}; {turn.completion_tokens} tokens in {turn.seconds:.1f} s)")
    return turn


def converse(client, question: str, tools, effort: str | None, out=print) -> list[Turn]:
    """A user question; while the model calls tools, run them and send the results back; return its turns."""
    from vllm_glm53.tiny_trained import call_tool, tool_result_text

    messages: list[dict] = [{"role": "user", "content": question}]
    turns = []
    kwargs = {"reasoning_effort": effort} if effort else {}
    out(f"== user: {question!r}  (tools: {', '.join(t['function']['name'] for t in tools or ()) or 'none'}; "
        f"reasoning_effort={effort or 'unset (max)'})")
    for _ in range(3):  # a tool round, the answer, and one spare round
        turn = stream_turn(client, messages, tools, out=out, max_tokens=160, **kwargs)
        turns.append(turn)
        if not turn.calls:
            break
        messages.append({"role": "assistant", "content": turn.content or None, "reasoning_content": turn.reasoning,
                         "tool_calls": turn.tool_calls()})
        for call in turn.tool_calls():
            result = tool_result_text(call_tool(call["function"]["name"], json.loads(call["function"]["arguments"])))
            out(f"== tool {call['function']['name']} returned {result}")
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return turns


def main(argv: list[str] | None = None) -> int:
    from vllm_glm53.tiny_trained import TIME_TOOL, WEATHER_TOOL, shipped_checkpoint

    parser = argparse.ArgumentParser(prog="python -m vllm_glm53.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="a checkpoint directory (default: the trained tiny checkpoint in the package)")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--mtp", type=int, default=2, help="draft tokens per step from the MTP layer (0: off)")
    args = parser.parse_args(argv)

    t0 = time.time()
    checkpoint = args.checkpoint or shipped_checkpoint()
    print(f"== checkpoint: {checkpoint}", flush=True)
    port = args.port or free_port()
    cmd, env = serve_command(checkpoint, port, features=(f"mtp={args.mtp}",) if args.mtp else ())
    print("== starting: " + " ".join(f"{k}={v}" for k, v in env.items()) + " " + " ".join(cmd), flush=True)
    server = Server(cmd, env)
    url = f"http://127.0.0.1:{port}"
    try:
        server.wait_healthy(url)
        print(f"== server healthy after {time.time() - t0:.0f} s", flush=True)
        server.echo = "errors"  # from here on the conversation has the screen
        from openai import OpenAI

        client = OpenAI(base_url=url + "/v1", api_key="unused")
        before = metrics(url)
        tools = [WEATHER_TOOL, TIME_TOOL]
        turns = converse(client, "What is the weather like in Paris?", tools, "high")
        turns += converse(client, "What is the capital of Japan?", tools, "low")
        turns += converse(client, "What time is it in Tokyo?", tools, None)
        after = metrics(url)
        show_speed(turns, before, after, args.mtp)
    finally:
        rc = server.stop()
        if server.shutdown_race_seen:
            print("  [server] " + SHUTDOWN_RACE_NOTE)
        print(f"== server stopped (exit code {rc}); total {time.time() - t0:.0f} s")
    return 1 if server.errors or rc else 0


def show_speed(turns: list[Turn], before: dict, after: dict, mtp: int) -> None:
    tokens = sum(t.completion_tokens for t in turns)
    seconds = sum(t.seconds for t in turns)
    print(f"== throughput: {tokens} completion tokens in {seconds:.1f} s = {tokens / seconds:.1f} tokens/s "
          f"(one stream at a time, first token included{', MTP on' if mtp else ''})")
    if not mtp:
        return

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    drafts = delta("vllm:spec_decode_num_drafts_total")
    drafted = delta("vllm:spec_decode_num_draft_tokens_total")
    accepted = delta("vllm:spec_decode_num_accepted_tokens_total")
    if drafts:
        print(f"== MTP: {int(accepted)} of {int(drafted)} drafted tokens accepted ({accepted / drafted:.0%}); "
              f"{1 + accepted / drafts:.2f} tokens per step on average with {mtp} drafts")


if __name__ == "__main__":
    sys.exit(main())
