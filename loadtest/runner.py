"""Replays a trace against a running deployment: sessions in parallel, turns in order."""

import asyncio
import time
from collections import defaultdict

import aiohttp
from tqdm import tqdm

from loadtest.client import RequestRecord, auth_headers, stream_chat
from loadtest.trace import TraceTurn

SYSTEM = "You are a careful coding agent. Answer briefly."


async def run_trace(
    base_url: str,
    trace: list[TraceTurn],
    *,
    concurrency: int = 0,
    open_loop: bool = False,
    progress: bool = True,
    model: str | None = None,
) -> tuple[list[RequestRecord], float]:
    """Replay ``trace``; return the records and the wall time in seconds.

    ``model`` is the name sent in every request (default: the first one ``/models`` lists).

    Closed loop: at most ``concurrency`` sessions at once. Open loop: each session starts at
    its ``start_s``. Within a session every turn waits for the previous answer, which joins
    the history (so follow-ups re-send the growing context).
    """
    sessions = _by_session(trace)
    limit = asyncio.Semaphore(concurrency if concurrency > 0 else len(sessions))
    bar = tqdm(total=len(trace), desc="requests", disable=not progress, leave=False)
    records: list[RequestRecord] = []
    async with aiohttp.ClientSession() as http:
        if model is None:
            model = await _first_model(http, base_url)
        started = time.perf_counter()

        async def run_session(turns: list[TraceTurn]):
            if open_loop:
                await asyncio.sleep(max(0.0, turns[0].start_s - (time.perf_counter() - started)))
            async with limit:
                history = [{"role": "system", "content": SYSTEM}]
                for turn in sorted(turns, key=lambda t: t.turn):
                    history.append({"role": "user", "content": turn.content})
                    record = await stream_chat(
                        http,
                        base_url,
                        model,
                        history,
                        turn.max_tokens,
                        RequestRecord(turn.session, turn.turn, turn.kind),
                    )
                    records.append(record)
                    bar.update()
                    history.append({"role": "assistant", "content": record.text})

        await asyncio.gather(*(run_session(t) for t in sessions.values()))
    bar.close()
    return records, time.perf_counter() - started


def _by_session(trace: list[TraceTurn]) -> dict[int, list[TraceTurn]]:
    """The trace's turns grouped by session, sessions and turns in trace order."""
    sessions = defaultdict(list)
    for turn in trace:
        sessions[turn.session].append(turn)
    return sessions


async def _first_model(http: aiohttp.ClientSession, base_url: str) -> str:
    """The first model the deployment's ``/models`` lists."""
    async with http.get(base_url + "/models", headers=auth_headers()) as response:
        return (await response.json())["data"][0]["id"]
