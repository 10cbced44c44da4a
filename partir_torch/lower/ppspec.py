"""What a plan's pipeline is: PipelineSpec (the pipeline tactic's decisions, tactics/pipeline.py) or NO_PIPELINE
(a plan without one: every rank runs the whole step). Plan.pipeline is always one of them, so lowering, the
runtime, the reports and the simulator ask it (`staged`, `axis`, `holders`, `rank_of`, its `schedule`) instead of
testing for None."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import ClassVar

from .ppschedules import Schedule


@dataclass(frozen=True)
class PipelineSpec:
    """What the pipeline tactic decided (Plan.pipeline): read by lowering, the runtime, summary and simulate."""

    staged: ClassVar[bool] = True     # the step is cut into stages on `axis`
    axis: str
    schedule: Schedule            # one of ppschedules.SCHEDULES
    n_stages: int                 # stages in all (ranks x chunks per rank)
    ranks: int                    # the axis size
    microbatches: int
    stage_of: MappingProxyType    # captured node name -> stage (absent: the node belongs to no stage)
    modules: tuple                # per stage: the module FQN globs (as given, or as the balanced cut chose)
    params: tuple                 # per stage: the parameter FQNs it owns
    name: str = "PP"              # the tactic's name (the pipeline axis's collectives record it)
    # tied weights: a parameter read by several stages (and its optimizer state) -> the stages that hold it, the
    # first its owner (stage_of); views of it that read nothing else (views), made on each stage that reads them
    tied: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    views: frozenset = frozenset()

    def holders(self, name: str) -> tuple:
        """The coordinates on the axis that hold state value `name` (tied weights: several)."""
        if name in self.tied:
            return tuple(sorted({self.rank_of(s) for s in self.tied[name]}))
        return ()

    def rank_of(self, stage: int) -> int:
        """The coordinate on the axis that runs `stage` (the schedule places it: Schedule.rank_of)."""
        return self.schedule.rank_of(stage, self.ranks)

    def stages_on(self, rank: int) -> tuple:
        """The stages `rank` runs, in increasing order."""
        return tuple(s for s in range(self.n_stages) if self.rank_of(s) == rank)

    @property
    def chunks(self) -> int:
        return self.n_stages // self.ranks


@dataclass(frozen=True)
class NoPipeline:
    """The pipeline of a plan without a pipeline tactic: one stage, which every rank runs whole."""

    staged: ClassVar[bool] = False
    axis: ClassVar[None] = None
    ranks: ClassVar[int] = 1
    n_stages: ClassVar[int] = 1
    tied: ClassVar[MappingProxyType] = MappingProxyType({})
    stage_of: ClassVar[MappingProxyType] = MappingProxyType({})

    def holders(self, name: str) -> tuple:
        return ()

    def rank_of(self, stage: int) -> int:
        return 0


NO_PIPELINE = NoPipeline()
