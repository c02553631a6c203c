"""The low-rank entry of every checkpoint (`lowrank`), and the check that a resumed run trains
in the mode its checkpoints were written in: a factorized model, or PowerSGD's error feedback,
cannot be carried into another mode."""

from __future__ import annotations

from typing import Any, Optional

from workbench.errors import ConfigError

KEY = "lowrank"


def saved_state(ckpt: Any, mode: str) -> Optional[dict[str, Any]]:
    """This mode's entry in the newest checkpoint (None: the run has no checkpoint yet)."""
    state = ckpt.peek(KEY)
    if state is None and ckpt.steps():
        raise ConfigError("lowrank.mode", mode, "the checkpoint was written with mode off")
    if state is not None and state.get("mode", mode) != mode:
        raise ConfigError("lowrank.mode", mode,
                          f"the checkpoint was written with mode {state['mode']}")
    return state
