"""The warning for a run that learns nothing: every sample's reward 0 for `ZERO_REWARD_ROLLOUTS` rollouts in a row.

Owns counting such rollouts and saying so once, loudly (a log warning, which the driver also puts on stderr
between the progress lines; status's `warnings`).
All-zero rewards give zero advantages under GRPO: the run trains on nothing while it looks healthy. Usual
causes: labels the reward type cannot read (a list or null `label` for deepscaler/math/dapo: refused at submit
since issue 37, but a custom reward or a later row can still do it), a wrong `rm_type` or `label_key`, a
response length that cuts every answer off. Rollouts without a reward (SFT) are not counted.
"""

from __future__ import annotations

import logging
from typing import Any

from hpc_rl.data.samples import Group

log = logging.getLogger(__name__)

ZERO_REWARD_ROLLOUTS = 10
"""Rollouts in a row with every reward 0 before the warning: a hard task starts near 0 for a few rollouts
(the tiny run's untrained policy scores 0.05-0.5 per rollout of 128 samples), ten in a row of exact zeros is
a run that cannot score."""


class ZeroRewardWatch:
    """`see(rollout_id, metrics, groups)` after each rollout; `warning` is set once the streak reaches the bound."""

    def __init__(self, after: int = ZERO_REWARD_ROLLOUTS) -> None:
        self.after = after
        self.streak = 0
        self.warning = ""

    def see(self, rollout_id: int, metrics: dict[str, Any], groups: list[Group]) -> None:
        if "rollout/reward_mean" not in metrics:
            return
        rewards = [sample.reward for group in groups for sample in group]
        if rewards and all(reward is not None and float(reward) == 0.0 for reward in rewards):
            self.streak += 1
        else:
            self.streak = 0
        if self.streak == self.after and not self.warning:
            self.warning = (f"every reward was 0 in rollouts {rollout_id - self.after + 1}-{rollout_id} "
                            f"({self.after} in a row): nothing is learned (zero advantages). Check that the "
                            "data's label fits the reward type (rollout.rm_type, rollout.label_key) and that "
                            "responses are not cut off (rollout.rollout_max_response_len)")
            log.warning("%s", self.warning)  # the driver sends warnings to stderr too, between the progress lines
