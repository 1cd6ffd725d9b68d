"""What the transfer driver posts in one turn: round robin, batches, chunks (no I/O).

:func:`plan_turn` decides and marks each job's progress; the driver
(``_driver``) makes the NIXL calls. One turn posts up to one chunk's worth
of bytes, so a large pull cannot hold the driver's thread for more than a
chunk while a small one waits:

* a notify-only job (no blocks) is sent once;
* whole small jobs (one chunk or less) waiting for the same remote agent
  are gathered into batches of up to a chunk and :data:`JOBS_PER_BATCH`
  jobs, each posted as one READ with one notification that names every
  request;
* a larger job gets its next chunk, with at most
  :data:`CHUNKS_IN_FLIGHT_PER_JOB` of its chunks running at once.

The jobs are visited round robin from the front of the deque (new jobs are
put at the front), which is rotated as they are visited.
"""

from __future__ import annotations

import collections
from typing import Literal

import attrs

from trio_pd._transfer._nixl._jobs import Job

CHUNKS_IN_FLIGHT_PER_JOB = 4
"""Chunks of one job running at once (on TCP, where ``transfer()`` returns
before the copy, several let UCX pipeline them)."""

JOBS_PER_BATCH = 128
"""The most jobs posted as one transfer (their notification names each)."""


@attrs.frozen
class Post:
    """One thing to post: a notification alone, whole jobs as one READ (a
    batch), or descriptors ``[start, stop)`` of one job (a chunk)."""

    kind: Literal["notify", "batch", "chunk"]
    jobs: list[Job]
    start: int = 0
    stop: int = 0


def plan_turn(jobs: collections.deque[Job], budget: int) -> list[Post]:
    """What to post this turn, in order, up to ``budget`` bytes; marks
    ``job.posted`` of every job planned (-1 for a notification sent)."""
    posts: list[Post] = []
    batches: dict[tuple[int, int], tuple[list[Job], int]] = {}  # (jobs, descriptors)
    for _ in range(len(jobs)):
        if budget <= 0:
            break
        job = jobs[0]
        jobs.rotate(-1)
        if job.stopping is not None:
            continue
        if job.size == 0:
            if job.posted == 0:
                job.posted = -1
                posts.append(Post("notify", [job]))
        elif job.posted == 0 and job.size <= job.chunk:
            key = (id(job.local_dlist), id(job.remote_dlist))
            batch, size = batches.get(key, ([], 0))
            if batch and (size + job.size > job.chunk or len(batch) >= JOBS_PER_BATCH):
                posts.append(_whole(batch))
                batch, size = [], 0
            batch.append(job)
            batches[key] = (batch, size + job.size)
            budget -= job.size * job.descriptor_bytes
        elif 0 <= job.posted < job.size and job.running < CHUNKS_IN_FLIGHT_PER_JOB:
            start, stop = job.posted, min(job.size, job.posted + job.chunk)
            job.posted = stop
            posts.append(Post("chunk", [job], start, stop))
            budget -= (stop - start) * job.descriptor_bytes
    posts.extend(_whole(batch) for batch, _ in batches.values())
    return posts


def _whole(batch: list[Job]) -> Post:
    for job in batch:
        job.posted = job.size
    return Post("batch", batch)
