"""What the checkpoint flags may combine with."""
from __future__ import annotations

from mtds.rules.job import Job


def async_save_needs_save(job: Job) -> str | None:
    """--async-save says how checkpoints are written; without --save none are."""
    if job.async_save and not job.save:
        return "--async-save without --save: there is no checkpoint to write in the background; add --save DIR " \
               "or leave out --async-save"
    return None
