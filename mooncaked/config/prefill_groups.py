"""A worker's place in a prefill group (chunked pipeline parallelism, `cluster.prefill_groups`).

1. `group_stage(config, instance, num_layers)` finds the group that names this instance (None for a single
   instance) and splits the model's layers over its members: `layer_splits`, or an even split.
2. The worker loads only its stage's layers (model/loader.py) and holds KV pages for them only; the first stage
   takes PREFILL and drives the pipeline (roles/worker/group/head.py), the others serve CPP_STAGE and CPP_CHUNK
   (roles/worker/group/stage.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from mooncaked.config import Config, ConfigError, InstanceConfig, PrefillGroupConfig
from mooncaked.config.schema import ConfigIssue
from mooncaked.model.config import LayerRange, split_layers

# Hidden-state buffers per direction: one chunk being filled (or computed) while the one before it is in flight.
NUM_HIDDEN_SLOTS = 2


@dataclass(frozen=True)
class GroupStage:
    """Stage `index` of `group`; `stage_layers[s]` are the layers of stage s."""

    group: PrefillGroupConfig
    index: int
    stage_layers: tuple[LayerRange, ...]

    @property
    def layers(self) -> LayerRange:
        return self.stage_layers[self.index]

    @property
    def num_stages(self) -> int:
        return len(self.group.members)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def next_member(self) -> str:
        """The member that takes this stage's hidden states ("" for the last stage)."""
        return "" if self.is_last else self.group.members[self.index + 1]

    @property
    def downstream(self) -> list[str]:
        return self.group.members[self.index + 1:]

    def describe(self) -> str:
        layers = self.layers
        return (f"stage {self.index} of {self.num_stages} of prefill group {self.group.name!r} "
                f"(layers {layers.start}..{layers.end - 1})")


def group_stage(config: Config, instance: InstanceConfig, num_layers: int) -> GroupStage | None:
    """This instance's stage, or None when no group names it; ConfigError when the split does not fit the model."""
    group = config.prefill_group_of(instance.name)
    if group is None:
        return None
    index = config.cluster.prefill_groups.index(group)
    try:
        stage_layers = split_layers(num_layers, len(group.members), group.layer_splits)
    except ValueError as exc:
        raise ConfigError([ConfigIssue(f"cluster.prefill_groups[{index}].layer_splits",
                                       f"{exc} (the model has {num_layers} layers)")]) from None
    stage = group.stage_of(instance.name)
    assert stage is not None
    return GroupStage(group, stage, tuple(stage_layers))
