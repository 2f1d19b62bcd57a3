"""AsyncEngine: its engine thread builds the core and steps it, so every torch op runs on that one
thread (one compute pool); a load failure is raised by the constructor."""

from __future__ import annotations

import asyncio
import sys
import threading

import pytest

from pagoda import SamplingParams
from pagoda.engine.args import EngineArgs
from pagoda.engine.async_engine import GIL_SWITCH_INTERVAL_S, AsyncEngine
from pagoda.errors import ConfigError
from tests.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from pagoda.model_files import load_tokenizer

    return str(write_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama", load_tokenizer(None)))


def test_the_engine_thread_builds_and_steps_the_core(tiny_llama):
    engine = AsyncEngine(EngineArgs(model=tiny_llama, kv_cache_memory=0.01, threads=1))
    owner = engine.core.runner.threads.owner
    assert owner == engine._thread.ident != threading.get_ident()
    stepped_on: list[int] = []
    step = engine.core.step

    def recording_step():
        stepped_on.append(threading.get_ident())
        return step()

    engine.core.step = recording_step

    async def run() -> list[int]:
        engine.start()
        try:
            params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            updates = [u async for u in engine.generate("r1", [5, 6, 7, 8], params)]
            return updates[-1].token_ids
        finally:
            await asyncio.to_thread(engine.shutdown)

    switch_interval = sys.getswitchinterval()
    try:
        assert len(asyncio.run(run())) == 4
        # started, the engine shortens the GIL's switch interval (the engine thread waits less for it)
        assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_INTERVAL_S)
        assert GIL_SWITCH_INTERVAL_S < switch_interval
    finally:
        sys.setswitchinterval(switch_interval)
    assert stepped_on and set(stepped_on) == {owner}
    assert not engine._thread.is_alive()


def test_a_load_failure_is_raised_by_the_constructor(tiny_llama):
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ConfigError, match="cannot hold one sequence"):
        AsyncEngine(EngineArgs(model=tiny_llama, kv_cache_memory=1e-6))
    assert "pagoda-engine" not in {t.name for t in threading.enumerate()} - before


def test_shutdown_before_start_ends_the_thread(tiny_llama):
    engine = AsyncEngine(EngineArgs(model=tiny_llama, kv_cache_memory=0.01, threads=1))
    engine.shutdown()
    assert not engine._thread.is_alive()
