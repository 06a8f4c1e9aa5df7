"""Which of mtds's patches on DeepSpeed objects have run.

A patch replaces a method DeepSpeed is expected to call (``engine.clip_fp32_gradients = ...``) or
overrides one in a subclass. If DeepSpeed renames the caller's target, assigning the patch still
succeeds and nothing ever calls it: the run goes on with DeepSpeed's behaviour and a silently wrong
number. Every patch therefore registers here when installed and marks itself when it runs; after the
first training step :func:`verify_ran` turns a patch that never ran into one error line.
"""
from __future__ import annotations

from mtds.deepspeed_compat.capabilities import TESTED_SPEC, DeepSpeedMismatch, version


class PatchLedger:
    """Per patched object (an engine, a pipeline module): patch name -> ran yet."""

    def __init__(self):
        self.ran: dict[str, bool] = {}

    def expect(self, name: str) -> None:
        self.ran.setdefault(name, False)

    def mark(self, name: str) -> None:
        self.ran[name] = True

    def not_run(self) -> list[str]:
        return [name for name, ran in self.ran.items() if not ran]


def ledger(obj) -> PatchLedger:
    """The ledger attached to ``obj`` (created on first use; stored outside ``nn.Module``'s registries)."""
    found = obj.__dict__.get("mtds_patches")
    if found is None:
        found = PatchLedger()
        object.__setattr__(obj, "mtds_patches", found)
    return found


def verify_ran(*objects) -> None:
    """Raise :class:`DeepSpeedMismatch` naming every installed patch that has not run."""
    missing = [name for obj in objects if obj is not None and "mtds_patches" in obj.__dict__
               for name in obj.__dict__["mtds_patches"].not_run()]
    if missing:
        raise DeepSpeedMismatch(
            f"DeepSpeed {version()} never called mtds's patch{'es' if len(missing) > 1 else ''} "
            f"{', '.join(missing)} during the first step (it no longer calls the method mtds replaces, so the "
            f"numbers it reports would be wrong); mtds is tested with {TESTED_SPEC}: pip install '{TESTED_SPEC}'")
