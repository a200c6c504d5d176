"""The shared in-flight byte budget of the host runs: first come, first served, and giving bytes
back wakes only the takers that now fit (never every waiter)."""

from __future__ import annotations

import asyncio

from relay.ingest.budget import ByteBudget


async def test_takers_are_granted_in_arrival_order_and_only_when_they_fit() -> None:
    budget = ByteBudget(100)
    await budget.take(60)
    order: list[str] = []

    async def taker(name: str, n: int) -> None:
        await budget.take(n)
        order.append(name)

    big = asyncio.create_task(taker("big", 50))
    small = asyncio.create_task(taker("small", 10))  # would fit now, but waits behind "big"
    await asyncio.sleep(0)
    assert order == [] and budget.waiting == 2 and budget.used == 60
    budget.give(30)  # 30 used: "big" (50) fits, then "small" (10)
    await asyncio.gather(big, small)
    assert order == ["big", "small"] and budget.used == 90 and budget.waiting == 0


async def test_a_take_larger_than_the_budget_is_granted_when_nothing_else_is_taken() -> None:
    budget = ByteBudget(100)
    await budget.take(10)
    huge = asyncio.create_task(budget.take(500))
    await asyncio.sleep(0)
    assert not huge.done()
    budget.give(10)
    await huge
    assert budget.used == 500


async def test_a_cancelled_taker_leaves_the_line_and_lets_the_next_one_through() -> None:
    budget = ByteBudget(100)
    await budget.take(90)
    first = asyncio.create_task(budget.take(50))
    second = asyncio.create_task(budget.take(5))
    await asyncio.sleep(0)
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    await asyncio.wait_for(second, 5)  # 90 + 5 fits once the head of the line is gone
    assert budget.used == 95 and budget.waiting == 0


async def test_take_now_takes_only_what_fits_with_nobody_in_line() -> None:
    budget = ByteBudget(100)
    assert budget.take_now(60) and budget.used == 60
    assert not budget.take_now(50) and budget.used == 60  # does not fit: nothing taken
    waiting = asyncio.create_task(budget.take(50))
    await asyncio.sleep(0)  # (one turn of the loop: the take joins the line)
    assert budget.waiting == 1
    assert not budget.take_now(10) and budget.used == 60  # would fit, but "waiting" is first in line
    budget.give(60)
    await waiting
    assert budget.take_now(50) and budget.used == 100
    budget.give(100)
    assert budget.take_now(500) and budget.used == 500  # alone: granted, as ``take`` grants it
