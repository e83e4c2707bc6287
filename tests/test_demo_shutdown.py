"""The demo's server wrapper on a stand-in process that logs like ``vllm serve``: vLLM 0.32's known shutdown race
(an EngineDeadError traceback from AsyncLLM's output handler, vllm-project/vllm#48745) is recognised only after a
stop we asked for; every other ERROR record or traceback is kept. No engine: the race cannot be produced on demand."""

from __future__ import annotations

import sys
import textwrap

import pytest

# Each record line carries vLLM's prefix; the traceback lines too (vLLM's formatter repeats it on every line).
_PREFIX = "(APIServer pid=1) {level} 11-30 23:00:00 [{where}] "
_RACE = [
    _PREFIX.format(level="ERROR", where="async_llm.py:906") + "AsyncLLM output_handler failed.",
    _PREFIX.format(level="ERROR", where="async_llm.py:906") + "Traceback (most recent call last):",
    _PREFIX.format(level="ERROR", where="async_llm.py:906") + '  File "async_llm.py", line 850, in output_handler',
    _PREFIX.format(level="ERROR", where="async_llm.py:906") + "vllm.v1.engine.exceptions.EngineDeadError: dead",
    "    plain continuation line of the same traceback",
]
_AFTER = _PREFIX.format(level="INFO", where="launcher.py:110") + "Shutting down FastAPI HTTP server."


def _stand_in(before_stop: list[str], after_stop: list[str]) -> list[str]:
    """argv of a process that prints ``before_stop``, waits for SIGTERM, prints ``after_stop`` and exits 0."""
    script = textwrap.dedent(f"""
        import signal, sys, time
        def stop(*_):
            for line in {after_stop!r}:
                print(line, flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
        for line in {before_stop!r}:
            print(line, flush=True)
        print("READY", flush=True)
        while True:
            time.sleep(0.05)
    """)
    return [sys.executable, "-c", script]


def _run(before_stop, after_stop):
    from vllm_glm53.demo import Server

    srv = Server(_stand_in(before_stop, after_stop), {}, echo=False)
    assert srv.wait_for_line("READY", timeout=30)
    assert srv.stop() == 0
    return srv


def test_known_race_after_a_requested_stop_is_one_note_not_an_error():
    srv = _run([], [*_RACE, _AFTER])
    assert srv.shutdown_race_seen
    assert srv.errors == []
    assert _AFTER in srv.lines  # the log itself is kept whole


@pytest.mark.parametrize("case", ["race before stop", "other error after race"])
def test_other_errors_are_kept(case):
    other = _PREFIX.format(level="ERROR", where="serving.py:12") + "something else failed"
    if case == "race before stop":
        srv = _run(_RACE, [_AFTER])
        assert not srv.shutdown_race_seen and srv.errors == [line for line in _RACE if "ERROR" in line]
    else:
        srv = _run([], [*_RACE, _AFTER, other])
        assert srv.shutdown_race_seen and srv.errors == [other]
