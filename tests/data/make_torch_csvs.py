"""Regenerate the torch-format schedule CSVs in this folder (needs torch; not run by the tests).

    pip install torch==2.13.0 && python tests/data/make_torch_csvs.py

Each file is written by torch.distributed.pipelining's own ``_dump_csv`` of a real schedule class, in
both of its formats (compute-only, and compute + communication actions). Stage objects are stand-ins
that carry only the attributes the schedule constructors read; no process group is created.
"""

import torch
from torch.distributed.pipelining import schedules as S
from torch.distributed.pipelining.stage import _PipelineStageBase


class _StandInStage(_PipelineStageBase):
    def __init__(self, stage_index, num_stages, group_size, group_rank):
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = group_rank
        self.stage_index_to_group_rank = {}
        self.submod = torch.nn.Linear(1, 1)
        self.has_backward = True
        self.dw_builder = None

    @property
    def is_first(self):
        return self.stage_index == 0

    @property
    def is_last(self):
        return self.stage_index == self.num_stages - 1


_StandInStage.__abstractmethods__ = frozenset()


def _stages(rank, pipe, virtual, v_shape):
    total = pipe * virtual
    indices = [rank, 2 * pipe - 1 - rank] if v_shape else [rank + v * pipe for v in range(virtual)]
    return [_StandInStage(i, total, pipe, rank) for i in indices]


CASES = [
    (S.ScheduleInterleaved1F1B, 4, 8, 2, False, "interleaved1f1b_p4_m8"),
    (S.ScheduleInterleavedZeroBubble, 4, 8, 2, False, "interleavedzb_p4_m8"),
    (S.ScheduleZBVZeroBubble, 4, 8, 2, True, "zbv_p4_m8"),
    (S.ScheduleLoopedBFS, 2, 4, 2, False, "loopedbfs_p2_m4"),
]

if __name__ == "__main__":
    for cls, pipe, microbatches, virtual, v_shape, name in CASES:
        schedule = cls(_stages(0, pipe, virtual, v_shape), microbatches, loss_fn=lambda a, b: a)
        schedule._dump_csv(f"torch_{name}_compute_comms.csv", format="compute_comms")
        schedule._dump_csv(f"torch_{name}_compute.csv", format="compute_only")
