"""mtds's one boundary to DeepSpeed's private and undocumented API.

Every use of a DeepSpeed name that starts with ``_`` or is not part of its documented API lives in this
package, one function per capability mtds needs (``pipeline.py``: mtds's schedules on DeepSpeed's
pipeline engine; ``patches.py``: methods replaced on a built engine; ``checkpointing.py``: checkpoint
internals; ``chunked_module.py``: the interleaved ``PipelineModule``; ``explicit_parts.py``: stages cut at a
pipeline layout's boundaries; ``config_schema.py``: the keys DeepSpeed's config parser reads, for checking
a user's JSON). ``tests/test_deepspeed_boundary.py``
holds the rest of mtds to it.

``capabilities.py`` lists what each capability rests on; the training run checks the installed
DeepSpeed against it at start-up (:func:`check_installed`), checks the built engine
(:func:`check_engine`) before the first step, and after the first step checks that every installed
patch ran (:func:`verify_ran`). A mismatch is one ``error:`` line naming the capability, the DeepSpeed
version found and the tested range.
"""
from mtds.deepspeed_compat.capabilities import (CAPABILITIES, TESTED, TESTED_SPEC, Capability, DeepSpeedMismatch, Target, check_engine,
                           check_installed, in_tested_range)
from mtds.deepspeed_compat.ledger import ledger, verify_ran

__all__ = ["CAPABILITIES", "TESTED", "TESTED_SPEC", "Capability", "DeepSpeedMismatch", "Target", "check_engine",
           "check_installed", "in_tested_range", "ledger", "verify_ran"]
