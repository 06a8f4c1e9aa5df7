"""What a failing rank tells the user about the launcher's restarts (torchrun --max-restarts N)."""
from __future__ import annotations

import os


def restart_note() -> str:
    """"torchrun restarts the group (restart 2 of 3)…" / "no restarts left…" under torchrun; else the manual fix."""
    count, most = os.environ.get("TORCHELASTIC_RESTART_COUNT"), os.environ.get("TORCHELASTIC_MAX_RESTARTS")
    if count is None or most is None:
        return "restart from the last complete checkpoint (--load)"
    count, most = int(count), int(most)
    if count < most:
        return f"torchrun restarts the group from the last complete checkpoint (restart {count + 1} of {most})"
    return (f"no restarts left ({count} of torchrun's --max-restarts {most} used): relaunch the same command to "
            f"continue from the last complete checkpoint")


# what gloo (and NCCL) say when the rank at the other end of a connection died
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "ECONNRESET",
             "Connection refused", "remote process exited", "NCCL communicator was aborted")


def peer_lost(err: BaseException) -> bool:
    """A collective failed because another rank went away (killed, crashed)."""
    text = str(err)
    return isinstance(err, RuntimeError) and any(marker in text for marker in PEER_LOST)
