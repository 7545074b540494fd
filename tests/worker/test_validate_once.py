"""Each prompt is checked once on the engine's side of the boundary: a bad
prompt in a batch queues nothing, and a good one is not checked again."""

from __future__ import annotations

import pytest

from worker import SamplingParams


def counting_validate(engine) -> list:
    calls = []
    validate = engine.validate

    def counted(prompt, params):
        calls.append(tuple(prompt))
        validate(prompt, params)

    engine.validate = counted
    return calls


def test_generate_batch_checks_every_prompt_once_before_queueing_any(make_engine):
    engine = make_engine()
    calls = counting_validate(engine)
    with pytest.raises(ValueError, match="prompt token 0"):
        engine.generate_batch([[5, 6, 7], [10**6]], max_new_tokens=2)
    assert not engine.has_work()  # the good prompt was not queued either
    calls.clear()
    assert len(engine.generate_batch([[5, 6, 7], [8, 9]], max_new_tokens=2)) == 2
    assert calls == [(5, 6, 7), (8, 9)]


def test_add_request_checks_its_prompt(make_engine):
    engine = make_engine()
    calls = counting_validate(engine)
    engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=1))
    assert calls == [(1, 2, 3)]
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams())


def test_the_async_engine_checks_on_submit_and_its_thread_queues_without_another(make_async_engine):
    import asyncio

    async def main():
        engine = make_async_engine()
        calls = counting_validate(engine.engine)
        result = await engine.generate([4, 5, 6], SamplingParams(max_new_tokens=2, ignore_eos=True))
        assert len(result.token_ids) == 2 and calls == [(4, 5, 6)]
        with pytest.raises(ValueError, match="prompt token 1"):
            await engine.generate([4, -1], SamplingParams())
        await engine.shutdown()

    asyncio.run(main())
