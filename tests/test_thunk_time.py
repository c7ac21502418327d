"""benchmarks/thunk_time.py's accounting of a trace: self times by what ran and where it ran."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from thunk_time import opcodes, parse_variant, self_times, without_collectives  # noqa: E402

HLO = """HloModule m

%fused (p: f32[]) -> f32[] {
  %p = f32[] parameter(0)
  ROOT %add.9 = f32[] add(%p, %p)
}

%bt (p: f32[]) -> f32[] {
  %p.1 = f32[] parameter(0)
  ROOT %fusion.2 = f32[] fusion(%p.1), kind=kLoop, calls=%fused
}

%bf (p: f32[]) -> f32[] {
  ROOT %p.2 = f32[] parameter(0)
}

%body (p: f32[]) -> f32[] {
  %p.3 = f32[] parameter(0)
  %fusion.1 = f32[] fusion(%p.3), kind=kLoop, calls=%fused
  %permute.1 = f32[] collective-permute(%fusion.1), source_target_pairs={{0,1}}
  ROOT %conditional.1 = f32[] conditional(%pred, %permute.1, %p.3), true_computation=%bt, false_computation=%bf
}

ENTRY %main (x: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %while.1 = f32[] while(%x), condition=%cond, body=%body
  ROOT %fusion.0 = f32[] fusion(%while.1), kind=kLoop, calls=%fused
}
"""


def test_each_event_counts_its_own_time_where_its_instruction_runs():
    op_of, where_of = opcodes(HLO)
    assert op_of["conditional.1"] == "conditional" and op_of["permute.1"] == "collective-permute"
    assert where_of == {
        "p": "outside",  # the fused computation's parameter: called by an instruction outside
        "add.9": "outside",
        "p.1": "branch",
        "fusion.2": "branch",
        "p.2": "branch",
        "p.3": "loop",
        "fusion.1": "loop",
        "permute.1": "loop",
        "conditional.1": "loop",
        "x": "outside",
        "while.1": "outside",
        "fusion.0": "outside",
    }
    events = [
        ("ThunkExecutor::Execute", 0, 100),  # the step: runs fusion.0 first, so outside
        ("fusion.0", 0, 10),
        ("ThunkExecutor::Execute", 20, 60),  # the loop body's run: its first instruction is in the loop
        ("fusion.1", 20, 10),
        ("permute.1", 30, 4),
        ("conditional.1", 35, 40),
        ("ThunkExecutor::Execute", 36, 38),  # the branch's run
        ("fusion.2", 40, 20),
        ("Wait: pending_threads=1/4", 85, 10),  # names no instruction: the place it runs in
        ("ThreadpoolListener::Record", 86, 0),  # the runtime's own: not counted
        ("ThunkExecutor::Execute (wait for completion)", 0, 200),  # the caller's wait: not counted
    ]
    times, counts = self_times([events], op_of, where_of)
    assert times == {
        ("kernels", "outside"): 10,
        ("kernels", "loop"): 10,
        ("kernels", "branch"): 20,
        ("collectives", "loop"): 4,
        ("collectives", "outside"): 10,
        ("control", "loop"): 40 - 38,
        ("dispatch", "outside"): 100 - 10 - 60 - 10,
        ("dispatch", "loop"): 60 - 10 - 4 - 40,
        ("dispatch", "branch"): 38 - 20,
    }
    assert counts[("dispatch", "loop")] == 1 and counts[("kernels", "branch")] == 1
    # By instruction kind (the name less its number): the same times, split further.
    kinds, _ = self_times([events], op_of, where_of, by_instruction=True)
    assert kinds[("kernels", "branch", "fusion")] == 20 and kinds[("collectives", "loop", "permute")] == 4
    summed = {}
    for (cat, where, _), ns in kinds.items():
        summed[(cat, where)] = summed.get((cat, where), 0) + ns
    assert summed == times


def test_a_variant_names_schedule_policy_and_microbatches():
    assert parse_variant("plain") is None
    assert parse_variant("zbv:save-all:32:split") == ("zbv", "save-all", 32, True, False)
    assert parse_variant("1f1b:selective:8") == ("1f1b", "selective", 8, False, False)
    assert parse_variant("zbv:save-all:32:split:nocomm") == ("zbv", "save-all", 32, True, True)
    assert parse_variant("1f1b:save-all:8:nocomm") == ("1f1b", "save-all", 8, False, True)
    for bad in ("zbv", "zbv:save-all:x", "zbv:save-all:8:fast", "zbv:save-all:8:nocomm:split"):
        try:
            parse_variant(bad)
        except SystemExit as e:
            assert "schedule:policy:M" in str(e)
        else:
            raise AssertionError(bad)


def test_a_nocomm_variant_has_no_collective_in_its_tick_loop():
    """The stand-ins take the tick loop's sends, gathers and sums out of the step, and only while it is
    traced; the gradients' sums after the loop stay."""
    from jaxmem.config import TrainConfig
    from jaxmem.train import Trainer

    def collectives():
        trainer = Trainer(
            TrainConfig(model="tiny", pipe=4, schedule="zbv", microbatches=4, batch_size=8, seq_len=16, steps=1)
        )
        text = trainer.lower(trainer.init_state()).as_text()
        return {op: text.count(f"stablehlo.{op}") for op in ("collective_permute", "all_reduce", "all_gather")}

    with without_collectives():
        stood_in = collectives()
    found = collectives()
    assert found["collective_permute"] and found["all_gather"], found
    assert stood_in["collective_permute"] == stood_in["all_gather"] == 0, stood_in
    assert 0 < stood_in["all_reduce"] < found["all_reduce"], (stood_in, found)
