"""aclose: an async generator left early is closed (its finally runs); an iterator without aclose is left be."""

from __future__ import annotations

from collections.abc import AsyncIterator

from mooncaked.runtime.aio import aclose


async def test_a_generator_left_early_is_closed() -> None:
    ended: list[str] = []

    async def numbers() -> AsyncIterator[int]:
        try:
            for n in range(10):
                yield n
        finally:
            ended.append("closed")

    stream = numbers()
    assert await anext(stream) == 0
    await aclose(stream)
    assert ended == ["closed"]


async def test_an_iterator_without_aclose_has_nothing_to_end() -> None:
    class Countdown:
        def __init__(self) -> None:
            self.left = 2

        def __aiter__(self) -> Countdown:
            return self

        async def __anext__(self) -> int:
            if not self.left:
                raise StopAsyncIteration
            self.left -= 1
            return self.left

    countdown = Countdown()
    await aclose(countdown)
    assert [n async for n in countdown] == [1, 0]
