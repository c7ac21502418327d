"""Malformed invocations of every subcommand, each run as a user would run it, tallied.

    python benchmarks/bad_input_sweep.py [--json] [--out benchmarks/results/bad_input_sweep.json]
        [--workers 2] [--timeout 180] [--only train]

Each case is a ``jaxmem`` command line that must be refused: exit code 2 (1 for a plan nothing fits),
one clear line on stderr -- an ``error:`` line, or argparse's usage error and its pointer to --help --
and no traceback, no hang (a timeout per case), no crash (a signal). A case that exits 0 was accepted:
that counts as silently accepting input that should change what a run does, or be refused. The cases
need no network and write only under a temporary folder; each runs in its own process (a crash or a
hang cannot take the sweep with it), two at a time.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (command line after `jaxmem`, words its error must contain). {tmp} is the sweep's folder; files it
# names are made by _fixtures().
CASES = [
    # ------------------------------------------------------------ train: numbers
    ("train --steps 0", "--steps"),
    ("train --steps -3", "--steps"),
    ("train --steps two", "--steps"),
    ("train --batch-size 0", "--batch-size"),
    ("train --batch-size 30", "not divisible"),
    ("train --batch-size 1000000000 --steps 2", "more than the corpus"),
    ("train --batch-size 1000000000 --steps 2 --data synthetic", "GiB on the host"),
    ("train --seq-len 0", "--seq-len"),
    ("train --seq-len 100000", "max_seq_len"),
    ("train --microbatches 0", "--microbatches"),
    ("train --microbatches 3", "not divisible"),
    ("train --microbatches 1000000", "not divisible"),
    ("train --microbatches 1000000 --batch-size 1000000 --data synthetic", "more than 2,000,000"),
    ("train --pipe 0", "--pipe"),
    ("train --pipe 100000", "more than 2,000,000"),
    ("train --pipe 3", "layers"),
    ("train --devices 100000 --pipe 2", "at most 4,096 virtual CPU devices"),
    ("train --devices 0", "--devices"),
    ("train --data-parallel 0", "--data-parallel"),
    ("train --fsdp -1", "--fsdp"),
    ("train --tensor 0", "--tensor"),
    ("train --virtual 0 --schedule interleaved-1f1b", "--virtual"),
    ("train --virtual 2", "does not take --virtual"),
    ("train --lr 0", "--lr"),
    ("train --lr -1", "--lr"),
    ("train --lr nan", "--lr"),
    ("train --lr inf", "--lr"),
    ("train --warmup-steps -1", "--warmup-steps"),
    ("train --warmup-steps 300 --lr-schedule cosine", "no steps of the cosine"),
    ("train --min-lr-ratio 2", "--min-lr-ratio"),
    ("train --weight-decay -0.1", "--weight-decay"),
    ("train --grad-clip 0", "--grad-clip"),
    ("train --grad-clip nan", "--grad-clip"),
    ("train --seed -1", "--seed"),
    ("train --seed 99999999999999999999999", "--seed"),
    ("train --eval-fraction 1", "--eval-fraction"),
    ("train --eval-fraction -0.1", "--eval-fraction"),
    ("train --eval-every 10", "held-out data"),
    ("train --eval-batches 0 --eval-fraction 0.1", "--eval-batches"),
    ("train --log-every 0", "--log-every"),
    ("train --checkpoint-every 0", "--checkpoint-every"),
    ("train --keep-checkpoints 0", "--keep-checkpoints"),
    ("train --restore-step 5", "--checkpoint-dir"),
    ("train --restore-step -1 --checkpoint-dir {tmp}/ck", "--restore-step"),
    ("train --layer-drop 1.5", "--layer-drop"),
    ("train --layer-drop -0.1", "--layer-drop"),
    ("train --vocab-size 0", "--vocab-size"),
    ("train --margin 0.5", "--margin"),
    ("train --plan auto --budget 1GiB --margin 2", "--margin"),
    # ------------------------------------------------------------ train: names and choices
    ("train --model nosuch", "nosuch"),
    ("train --model os.path:join", "needs arguments"),
    ("train --model os.path:sep", "StagedModel"),
    ("train --model nosuchmodule:thing", "cannot import"),
    ("train --model os:nosuchattr", "no attribute"),
    ("train --model :x", "package.module:attr"),
    ("train --schedule nosuch", "nosuch"),
    ("train --schedule zbv --pipe 3 --microbatches 6 --batch-size 30", "layers"),
    ("train --policy nosuch", "nosuch"),
    ("train --policy {tmp}/nosuch.toml", "nosuch.toml"),
    ("train --policy {tmp}/garbage.toml", "TOML"),
    ("train --policy chronos-recomp", "--budget"),
    ("train --dtype float64", "64-bit"),
    ("train --dtype int8", "floating"),
    ("train --dtype nosuch", "unknown dtype"),
    ("train --param-dtype nosuch", "unknown dtype"),
    ("train --attention nosuch", "invalid choice"),
    ("train --tokenizer nosuch", "tokenizer"),
    ("train --tokenizer bpe:0", "bpe"),
    ("train --tokenizer bpe:x", "bpe"),
    ("train --data synthetic --tokenizer bpe:300", "synthetic"),
    ("train --data-field x", "no columns"),
    ("train --hardware nosuch", "unknown --hardware nosuch"),
    ("train --target nosuch", "unknown target"),
    ("train --target h100:12", "hosts of 8"),
    ("train --target tpu-v5e:4x4x4", "2 dimensions"),
    ("train --target tpu-v5e --hardware h100", "two machines"),
    ("train --lr-schedule nosuch", "invalid choice"),
    ("train --seq-len-order nosuch", "invalid choice"),
    ("train --seq-len-schedule 8,16", "--adaptive"),
    ("train --seq-len-schedule 0,16 --adaptive --budget 1GiB", "lengths >= 1"),
    ("train --seq-len-schedule a,b --adaptive --budget 1GiB", "integers"),
    ("train --layers-per-stage 0,0,0,8", "without layers"),
    ("train --layers-per-stage 1,1", "layers"),
    ("train --layers-per-stage a", "integers"),
    ("train --mesh data=2,pipe", "axis=size"),
    ("train --mesh pipe=2 --pipe 2", "drop --pipe"),
    ("train --mesh data=0", "axis=size"),
    ("train --mesh nosuch=2", "axis=size"),
    ("train --mesh pipe=2,pipe=2", "twice"),
    # ------------------------------------------------------------ train: combinations
    ("train --csv {tmp}/sched.csv --schedule zbv", "drop --schedule"),
    ("train --csv {tmp}/nosuch.csv", "nosuch.csv"),
    ("train --csv {tmp}/garbage.csv", "is not an action"),
    ("train --csv {tmp}/sched.csv --pipe 2", "ranks"),
    ("train --schedule zbv --hand-recomputed", "--split-backward"),
    ("train --split-backward", "no I or W"),
    ("train --schedule gpipe --split-backward", "no I or W"),
    ("train --plan auto --budget 1GiB --schedule zbv", "--plan auto chooses"),
    ("train --plan auto --budget 1GiB --pipe 2", "--plan auto chooses"),
    ("train --plan auto --budget 1GiB --policy selective", "--plan auto chooses"),
    ("train --plan auto", "--budget"),
    ("train --plan auto --budget 1KiB --steps 1", "at least"),
    ("train --plan nosuch --budget 1GiB", "invalid choice"),
    ("train --budget 1GiB", "drop --budget"),
    ("train --budget lots --plan auto", "lots"),
    ("train --budget -1GiB --plan auto", "budget"),
    ("train --budget 0 --plan auto", "budget"),
    ("train --adaptive", "--budget"),
    ("train --adaptive --budget 1GiB --plan auto", "not both"),
    ("train --adaptive --budget 1GiB --run-dir {tmp}/r", "drop --run-dir"),
    ("train --adaptive --budget 1GiB --policy chronos-recomp", "picks the policy itself"),
    ("train --init-from {tmp}/nosuch", "no config.json"),
    ("train --init-from {tmp}/notjson", "not JSON"),
    ("train --init-from {tmp}/wrongkind", "model_type"),
    ("train --init-from {tmp}/wrongkind --model llama-tiny", "drop --model"),
    ("train --data {tmp}/nosuch.txt", "no such file"),
    ("train --data {tmp}/empty_dir", "no .txt"),
    ("train --data {tmp}/garbage.jsonl", "garbage.jsonl:1:"),
    ("train --data {tmp}/garbage.txt", "not UTF-8"),
    ("train --data {tmp}/bad.jsonl", "not a JSON line"),
    ("train --data {tmp}/nofield.jsonl", "no field"),
    ("train --data {tmp}/garbage.parquet", "Parquet"),
    ("train --data hf:", "hf:NAME"),
    ("train --data hf:a:b:c:d", "hf:NAME"),
    ("train --data hf:nosuch-dataset-x", "offline"),
    ("train --samples nosuch:x", "cannot import"),
    ("train --samples os.path:join", "needs arguments"),
    ("train --samples os.path:sep", "Samples"),
    ("train --config {tmp}/nosuch.toml", "does not exist"),
    ("train --config {tmp}/garbage.bin", "not UTF-8"),
    ("train --config {tmp}/garbage.toml", "not valid TOML"),
    ("train --config {tmp}/unknown.toml", "unknown setting"),
    ("train --config {tmp}/empty_dir", "is a directory"),
    ("train --sample-log {tmp}/empty_dir", "is a directory"),
    ("train --sample-log {tmp}/nosuchdir/x.log", "does not exist"),
    ("train --sample-log {tmp}/afile/x.log", "is a file"),
    ("train --profile-report {tmp}/empty_dir --adaptive --budget 12MiB", "is a directory"),
    ("train --run-dir {tmp}/afile", "is a file"),
    ("train --checkpoint-dir {tmp}/afile", "is a file"),
    ("train --checkpoint-dir {tmp}/ck --steps 5", "past its last step", 0),  # said, and nothing to do: exit 0
    ("train --checkpoint-dir {tmp}/ck --steps 20 --seed 3", "--seed"),
    ("train --checkpoint-dir {tmp}/ck --steps 20 --seq-len 32", "--seq-len"),
    ("train --checkpoint-dir {tmp}/ck --steps 20 --param-dtype bfloat16", "other dtypes"),
    ("train --checkpoint-dir {tmp}/ck --steps 20 --model llama-tiny", "different model"),
    ("train --checkpoint-dir {tmp}/ck --steps 20 --restore-step 7", "no checkpoint step 7"),
    ("train --unknown-flag", "unrecognized"),
    ("train extra_positional", "unrecognized"),
    # ------------------------------------------------------------ verify
    ("verify --pipe 0", "--pipe"),
    ("verify --microbatches 0", "--microbatches"),
    ("verify --schedule nosuch", "nosuch"),
    ("verify --csv {tmp}/nosuch.csv", "nosuch.csv"),
    ("verify --csv {tmp}/sched.csv --schedule zbv", "not both"),
    ("verify --model nosuch", "nosuch"),
    ("verify --model os.path:join", "needs arguments"),
    ("verify --policy nosuch", "nosuch"),
    ("verify --policy chronos-recomp", "--budget"),
    ("verify --budget 1GiB", "chronos-*"),
    ("verify --hand-recomputed", "--split-backward"),
    ("verify --drop-layers x", "integers"),
    ("verify --mesh data=2,data=2", "twice"),
    ("verify --mesh pipe=2,tensr=2", "tensr"),
    ("verify --dtype nosuch", "dtype"),
    ("verify --devices 0", "--devices"),
    ("verify --pipe 100000", "more than 2,000,000"),
    ("verify --microbatches 1000000", "more than 2,000,000"),
    ("verify --schedule 1f1b --split-backward", "no I or W"),
    # ------------------------------------------------------------ memory
    ("memory --microbatches 0", "--microbatches"),
    ("memory --pipe 0", "--pipe"),
    ("memory --model nosuch", "nosuch"),
    ("memory --policy nosuch", "nosuch"),
    ("memory --policy chronos-recomp --compile no", "--budget"),
    ("memory --budget lots", "lots"),
    ("memory --compile maybe", "invalid choice"),
    ("memory -o {tmp}/ledger.txt", ".png"),
    ("memory -o {tmp}/empty_dir", ".png"),
    ("memory -o {tmp}/nosuchdir/x.png", "does not exist"),
    ("memory --mesh fsdp=2 --fsdp 2", "drop --fsdp"),
    ("memory --batch-size 30", "not divisible"),
    ("memory --seq-len 100000", "max_seq_len"),
    ("memory --microbatches 1000000", "not divisible"),
    ("memory --pipe 100000", "more than 2,000,000"),
    ("memory --split-backward", "no I or W"),
    ("memory --target nosuch", "unknown target"),
    ("memory --target tpu-v5e --hardware h100", "two machines"),
    ("memory --hardware nosuch", "unknown --hardware"),
    ("memory --csv {tmp}/garbage.csv", "is not an action"),
    # ------------------------------------------------------------ plan
    ("plan --devices 0 --budget 1GiB", "--devices"),
    ("plan --devices -2 --budget 1GiB", "--devices"),
    ("plan --devices 2 --budget lots", "lots"),
    ("plan --devices 2 --budget 0", "budget"),
    ("plan --devices 2", "--budget"),
    ("plan --budget 1GiB", "how many devices"),
    ("plan --devices 2 --budget 1GiB --batch-size 0", "--batch-size"),
    ("plan --devices 2 --budget 1GiB --seq-len 4096", "--seq-len"),
    ("plan --devices 2 --budget 1GiB --model nosuch", "nosuch"),
    ("plan --devices 2 --budget 1GiB --hardware nosuch", "unknown hardware"),
    ("plan --devices 2 --budget 1GiB --target nosuch", "unknown target"),
    ("plan --devices 2 --budget 1GiB --target tpu-v5e --hardware h100", "two machines"),
    ("plan --mesh pipe=2,tensor=2 --devices 8 --budget 1GiB", "--mesh takes 4 devices"),
    ("plan --mesh pipe=2 --pipe 2 --budget 1GiB", "drop --pipe"),
    ("plan --mesh x=2 --budget 1GiB", "axis=size"),
    ("plan --devices 2 --budget 1GiB --margin 1.5", "--margin"),
    ("plan --devices 2 --budget 1GiB --host-bandwidth 0", "--host-bandwidth"),
    ("plan --devices 2 --budget 1GiB --dtype nosuch", "dtype"),
    ("plan --devices 4 --budget 1KiB --hardware h100", "nothing fits 1.00 KiB per device", 1),  # its report
    # ------------------------------------------------------------ schedule
    ("schedule show nosuch", "nosuch"),
    ("schedule show 1f1b --pipe 0", "--pipe"),
    ("schedule show 1f1b --microbatches 0", "--microbatches"),
    ("schedule show 1f1b --pipe 100000 --microbatches 100000", "fewer stages"),
    ("schedule show interleaved-1f1b --pipe 4 --microbatches 6 --virtual 2", "divisible"),
    ("schedule show 1f1b --virtual 2", "does not take"),
    ("schedule show", "name a schedule"),
    ("schedule simulate 1f1b --cost-comm nan", "--cost-comm"),
    ("schedule simulate 1f1b --cost-f -1", "--cost-f"),
    ("schedule simulate 1f1b --cost-f 0 --cost-i 0 --cost-w 0", "are all 0"),
    ("schedule simulate --csv {tmp}/nosuch.csv", "nosuch.csv"),
    ("schedule simulate 1f1b --csv {tmp}/sched.csv", "not both"),
    ("schedule check {tmp}/nosuch.csv", "nosuch.csv"),
    ("schedule check {tmp}/garbage.csv", "is not an action"),
    ("schedule check {tmp}/badaction.csv", "badaction"),
    ("train --csv {tmp}/incomplete.csv --pipe 1 --microbatches 1", "runs forwards only"),
    ("schedule draw 1f1b -o {tmp}/x.txt", ".png"),
    ("schedule draw 1f1b -o {tmp}/nosuchdir/x.png", "does not exist"),
    ("schedule draw 1f1b -o {tmp}/empty_dir", "directory"),
    ("schedule export 1f1b -o {tmp}/empty_dir", "directory"),
    ("schedule export 1f1b -o {tmp}/nosuchdir/x.csv", "does not exist"),
    ("schedule nosuch", "invalid choice"),
    ("schedule", "needs an action"),
    # ------------------------------------------------------------ roam
    ("roam analyze --batch 0", "--batch"),
    ("roam analyze --loss-chunks 5 --seq-len 32", "dividing --seq-len"),
    ("roam analyze --accumulate 2 --loss-chunks 2", "give one of them"),
    ("roam analyze --model nosuch", "nosuch"),
    ("roam analyze --model os.path:join", "needs arguments"),
    ("roam analyze --compile maybe", "invalid choice"),
    ("roam nosuch", "invalid choice"),
    ("roam", "needs an action"),
    # ------------------------------------------------------------ launch
    ("launch --nprocs 0 -- --steps 2", "--nprocs"),
    ("launch --nprocs 2 --heartbeat-seconds 0 -- --steps 2", "--heartbeat-seconds"),
    ("launch --nprocs 2 --max-restarts -1 -- --steps 2", "--max-restarts"),
    ("launch --nprocs 2 --strategy teleport -- --steps 2", "is not one"),
    ("launch --nprocs 2 --strategy reroute -- --steps 2", "is not one"),
    ("launch --nprocs 2 --inject-failure rank=5,step=1 --", "0..1"),
    ("launch --nprocs 2 --inject-failure rank=1 --", "rank=R,step=K"),
    ("launch --nprocs 2 --inject-failure x --", "rank=R,step=K"),
    ("launch --nprocs 2 --spares -1 -- --steps 2", "--spares"),
    ("launch --nprocs 2 --devices-per-proc 0 -- --steps 2", "--devices-per-proc"),
    ("launch --nprocs 2 --run-dir {tmp}/afile -- --steps 2", "is a file"),
    ("launch --nprocs 2 -- --steps 0", "--steps"),
    ("launch --nprocs 2 -- --model nosuch", "nosuch"),
    ("launch --nprocs 2 -- --pipe 3", "devices"),
    ("launch", "--nprocs"),
    # ------------------------------------------------------------ elastic
    ("elastic recovery --devices 4 --failed -1 -- --pipe 4", "--failed"),
    ("elastic recovery --devices 4 --failed 9 -- --pipe 4", "0..3"),
    ("elastic recovery --devices 8 --failed 1 -- --pipe 4", "does not match"),
    ("elastic recovery --devices 4 --devices-per-proc 3 --failed 1 -- --pipe 4", "multiple"),
    ("elastic recovery --devices 4 --failed 1 --last-checkpoint 50 --steps-done 10 -- --pipe 4", "after --steps-done"),
    ("elastic recovery --devices 4 --failed 1 --steps-done 500 -- --pipe 4", "past the job's last step"),
    ("elastic recovery --devices 4 --failed 1 --budget lots -- --pipe 4", "lots"),
    ("elastic recovery --devices 4 --failed 1 --hardware nosuch -- --pipe 4", "nosuch"),
    ("elastic recovery --devices 4 --failed 1 --step-seconds 0 -- --pipe 4", "--step-seconds"),
    ("elastic recovery --devices 4 --failed 1 -- --pipe 4 --steps 0", "--steps"),
    ("elastic recovery --failed 1 -- --pipe 4", "--devices"),
    ("elastic", "needs an action"),
    # ------------------------------------------------------------ export and sample
    ("export {tmp}/nosuch -o {tmp}/out1", "nosuch"),
    ("export {tmp}/ck -o {tmp}/ck", "the checkpoint folder"),
    ("export {tmp}/ck -o {tmp}/ck/10", "inside the checkpoint folder"),
    ("export {tmp}/ck -o {tmp}/datadir", "not an export"),
    ("export {tmp}/ck -o {tmp}/afile", "is a file"),
    ("export {tmp}/ck -o {tmp}/exported", "already holds an export"),
    ("export {tmp}/ck -o {tmp}/out2 --step 7", "7"),
    ("export {tmp}/ck -o {tmp}/out3 --format nosuch", "invalid choice"),
    ("export {tmp}/ck", "-o"),
    ("export {tmp}/afile -o {tmp}/out4", "afile"),
    ("sample {tmp}/nosuch", "nosuch"),
    ("sample {tmp}/exported --tokens 0", "--tokens"),
    ("sample {tmp}/exported --tokens 1000000", "more than 100,000"),
    ("sample {tmp}/exported --seed -1", "--seed"),
    ("sample {tmp}/exported --temperature -1", "--temperature"),
    ("sample {tmp}/exported --top-k 0", "--top-k"),
    ("sample {tmp}/exported --step 3", "--step"),
    ("sample {tmp}/datadir", "datadir"),
    # ------------------------------------------------------------ the command itself
    ("nosuch", "invalid choice"),
    ("--nosuch", "unrecognized"),
]


def _fixtures(tmp: str) -> None:
    """The files and folders the cases name: a small checkpoint and its export, broken inputs."""
    os.makedirs(f"{tmp}/empty_dir", exist_ok=True)
    os.makedirs(f"{tmp}/datadir", exist_ok=True)
    with open(f"{tmp}/datadir/a.txt", "w") as f:
        f.write("some text\n")
    with open(f"{tmp}/afile", "w") as f:
        f.write("x")
    garbage = bytes(range(256)) * 4
    for name in ("garbage.bin", "garbage.jsonl", "garbage.txt", "garbage.parquet"):
        with open(f"{tmp}/{name}", "wb") as f:
            f.write(garbage)
    for name, text in {
        "garbage.toml": "this is = = not toml [",
        "unknown.toml": "nosuchsetting = 3\n",
        "garbage.csv": "not,a\nschedule\n",
        "badaction.csv": "rank,0,1\n0,0F0,0X9\n",
        "incomplete.csv": "0F0\n",
        "bad.jsonl": '{"text": "ok"}\nnot json\n',
        "nofield.jsonl": '{"body": "x"}\n',
    }.items():
        with open(f"{tmp}/{name}", "w") as f:
            f.write(text)
    os.makedirs(f"{tmp}/notjson", exist_ok=True)
    with open(f"{tmp}/notjson/config.json", "w") as f:
        f.write("{not json")
    os.makedirs(f"{tmp}/wrongkind", exist_ok=True)
    with open(f"{tmp}/wrongkind/config.json", "w") as f:
        json.dump({"model_type": "bert"}, f)
    env = _env()
    run = [sys.executable, "-m", "jaxmem"]
    subprocess.run([*run, "schedule", "export", "1f1b", "--pipe", "4", "--microbatches", "8", "-o", f"{tmp}/sched.csv"],
                   check=True, capture_output=True, env=env)  # fmt: skip
    subprocess.run([*run, "train", "--steps", "10", "--checkpoint-dir", f"{tmp}/ck", "--quiet"],
                   check=True, capture_output=True, env=env)  # fmt: skip
    subprocess.run([*run, "export", f"{tmp}/ck", "-o", f"{tmp}/exported"], check=True, capture_output=True, env=env)


def _env() -> dict:
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def judge(words: str, expect: str, tmp: str, timeout: float, code: int = 2) -> dict:
    """Run one case and say whether it was refused in one clear line (``code`` 0: a case that has
    nothing to do, which must say so and exit 0; 1: jaxmem plan's report of a plan nothing fits, on
    stdout after its progress lines, which must say so and exit 1)."""
    argv = [w.replace("{tmp}", tmp) for w in words.split()]
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "jaxmem", *argv], capture_output=True, text=True, timeout=timeout, env=_env(),
            cwd=tmp,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"case": words, "verdict": "hang", "seconds": timeout}
    seconds = time.perf_counter() - start
    err = done.stderr
    lines = [line for line in err.splitlines() if line.strip()]
    # argparse's usage errors are two lines: "prog: error: ..." and the pointer to --help.
    # jaxmem plan's progress lines ("planning: 10/102 schedules ...") are progress, not the error.
    meaningful = [line for line in lines if not line.startswith(("(see `jaxmem", "planning: "))]
    if done.returncode < 0:
        verdict = "crash"
    elif done.returncode == 0 and code != 0:
        verdict = "accepted"
    elif done.returncode != 0 and code == 0:
        verdict = "refused"
    elif "Traceback" in err:
        verdict = "traceback"
    elif done.returncode != code:
        verdict = f"exit {done.returncode}"
    elif len(meaningful) != 1 and code == 2:
        verdict = "several lines"
    elif expect.lower() not in (err + (done.stdout if code == 1 else "")).lower():
        verdict = "unclear"
    else:
        verdict = "ok"
    return {
        "case": words,
        "verdict": verdict,
        "exit": done.returncode,
        "stderr_first_line": (meaningful or [""])[0][:300],
        "stderr_lines": len(lines),
        "seconds": round(seconds, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=180)
    parser.add_argument("--only", help="only the cases of this subcommand")
    parser.add_argument(
        "--case", action="append", help="only this case (its words as listed, {tmp} and all); repeatable"
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    cases = [c for c in CASES if args.only is None or c[0].split()[0] == args.only]
    cases = [c for c in cases if not args.case or c[0] in args.case]
    with tempfile.TemporaryDirectory(prefix="jaxmem-sweep-") as tmp:
        print(f"preparing fixtures in {tmp} ...", file=sys.stderr, flush=True)
        _fixtures(tmp)
        rows = []
        # Runs that open the fixture's checkpoint folder take its lock: one at a time, in one queue.
        locking = [c for c in cases if c[0].startswith("train") and "--checkpoint-dir {tmp}/ck" in c[0]]

        def in_turn():
            return [judge(*case[:2], tmp, args.timeout, *case[2:]) for case in locking]

        with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
            futures = [pool.submit(in_turn)]
            futures += [pool.submit(judge, *c[:2], tmp, args.timeout, *c[2:]) for c in cases if c not in locking]
            for future in concurrent.futures.as_completed(futures):
                for row in (lambda r: r if isinstance(r, list) else [r])(future.result()):
                    rows.append(row)
                    if row["verdict"] != "ok":
                        first = row.get("stderr_first_line", "")
                        print(f"[{len(rows)}/{len(cases)}] {row['verdict']}: jaxmem {row['case']}\n    {first}",
                              file=sys.stderr, flush=True)  # fmt: skip
    order = {case[0]: i for i, case in enumerate(cases)}
    rows.sort(key=lambda r: order[r["case"]])
    tally = {}
    for row in rows:
        tally[row["verdict"]] = tally.get(row["verdict"], 0) + 1
    record = {
        "benchmark": "bad_input_sweep",
        "command": "python benchmarks/bad_input_sweep.py " + " ".join(sys.argv[1:]),
        "cases": len(rows),
        "ok": tally.get("ok", 0),
        "ok_fraction": tally.get("ok", 0) / len(rows) if rows else None,
        "tally": tally,
        "rows": rows,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        print(f"{record['ok']}/{record['cases']} refused in one clear line ({record['ok_fraction']:.1%}); {tally}")


if __name__ == "__main__":
    main()
