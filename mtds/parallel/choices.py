"""The words a layout is spoken in, once, for the trainer (``train.py``'s flags and checks) and the planner
(``mtds-plan``'s search and flags) alike: a schedule or recompute mode exists for both or for neither."""
from __future__ import annotations

# --pipeline-schedule: each proven against HF in the suite. 1f1b is DeepSpeed's PipelineEngine, dualpipev
# its DualPipeVEngine; the OWN_ENGINE ones run on mtds.pipe.engine.ScheduledPipelineEngine.
PIPELINE_SCHEDULES = ("1f1b", "interleaved", "zb-h1", "dualpipev")
OWN_ENGINE = ("interleaved", "zb-h1")

# --recompute: none, selective (the attention core), full (whole blocks, --recompute-interval at a time)
RECOMPUTE_MODES = ("none", "selective", "full")

# --cp-comm-type: p2p = ring attention (mtds.cp.ring), a2a = Ulysses all-to-all (mtds.cp.ulysses)
CP_COMM_TYPES = ("p2p", "a2a")
