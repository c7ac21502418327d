"""Bad input to every command: a short error naming what is wrong, exit code 2, no traceback, and
nothing run (every case here is refused before a program is compiled or a worker started)."""

import pytest

from jaxmem.cli import main

CASES = [
    (["plan", "--devices", "0", "--budget", "1GiB"], "--devices: must be an integer >= 1, got 0"),
    (["plan", "--devices", "-2", "--budget", "1GiB"], "--devices: must be an integer >= 1, got -2"),
    (["plan", "--devices", "2", "--budget", "1GiB", "--batch-size", "0"], "--batch-size: must be an integer >= 1"),
    (["plan", "--devices", "2", "--budget", "1GiB", "--seq-len", "4096"], "--seq-len"),
    (["plan", "--devices", "2", "--budget", "lots"], "lots"),
    (["roam", "analyze", "--batch", "0"], "--batch: must be an integer >= 1, got 0"),
    (["schedule", "simulate", "1f1b", "--cost-comm", "nan"], "--cost-comm: must be a finite number >= 0, got nan"),
    (["schedule", "simulate", "1f1b", "--cost-f", "-1"], "--cost-f: must be a finite number >= 0"),
    (["schedule", "show", "1f1b", "--pipe", "0"], "--pipe/--stages/-p: must be an integer >= 1"),
    (["memory", "--microbatches", "0"], "--microbatches: must be an integer >= 1"),
    (["launch", "--nprocs", "2", "--heartbeat-seconds", "0", "--", "--steps", "2"], "--heartbeat-seconds: must be"),
    (["launch", "--nprocs", "2", "--max-restarts", "-1", "--", "--steps", "2"], "--max-restarts: must be"),
    (["launch", "--nprocs", "2", "--strategy", "teleport", "--", "--steps", "2"], "--strategy teleport is not one"),
    (["launch", "--nprocs", "2", "--strategy", "reroute", "--", "--steps", "2"], "--strategy reroute is not one"),
    (["launch", "--nprocs", "2", "--inject-failure", "rank=5,step=1", "--"], "the rank must be 0..1"),
    (["launch", "--nprocs", "2", "--inject-failure", "rank=1", "--"], "takes rank=R,step=K"),
    (["elastic", "recovery", "--devices", "4", "--failed", "-1"], "--failed: must be an integer >= 0"),
    (["sample", "ckpt", "--tokens", "0"], "--tokens: must be an integer >= 1"),
    (["train", "--checkpoint-every", "0"], "--checkpoint-every must be an integer >= 1, got 0"),
    (["train", "--devices", "0"], "--devices must be an integer >= 1, got 0"),
    (["train", "--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["train", "--csv", "s.csv", "--schedule", "zbv"], "drop --schedule (or --csv)"),
    (["train", "--schedule", "zbv", "--hand-recomputed"], "when the backward is split: set --split-backward too"),
    (["train", "--plan", "auto", "--budget", "1GiB", "--schedule", "zbv"], "--plan auto chooses --schedule"),
    (["train", "--plan", "auto", "--budget", "1GiB", "--pipe", "2"], "--plan auto chooses --pipe"),
    (["train", "--budget", "1GiB"], "drop --budget"),
    (["train", "--plan", "auto", "--budget", "1KiB", "--steps", "1"], "at least 1.67 MiB per device however"),
    (["train", "--seq-len-schedule", "8,16"], "set --adaptive and --budget"),
    (["train", "--adaptive", "--budget", "1GiB", "--run-dir", "x"], "drop --run-dir or --adaptive"),
    (["roam", "analyze", "--loss-chunks", "5", "--seq-len", "32"], "pick --loss-chunks dividing --seq-len"),
    (["roam", "analyze", "--accumulate", "2", "--loss-chunks", "2"], "give one of them"),
    (["train", "--mesh", "data=2,pipe"], "--mesh takes axis=size pairs"),
    (["train", "--mesh", "pipe=2", "--pipe", "2"], "--mesh sets pipe; drop --pipe (or --mesh)"),
    (["train", "--fsdp", "0"], "--fsdp must be an integer >= 1, got 0"),
    (["verify", "--mesh", "data=2,data=2"], "--mesh names data twice"),
    (["memory", "--mesh", "fsdp=2", "--fsdp", "2"], "--mesh sets fsdp; drop --fsdp (or --mesh)"),
    (["train", "--seed", "-1"], "--seed must be an integer >= 0, got -1"),
    (["train", "--seed", "99999999999999999999999"], "--seed must be below 2**63"),
    (["train", "--dtype", "float64"], "float64 needs JAX's 64-bit mode"),
    (["train", "--tensor", "0"], "--tensor must be an integer >= 1, got 0"),
    (["verify", "--mesh", "pipe=2,tensr=2"], "tensr"),
    (["train", "--layers-per-stage", "0,0,0,8"], "leaves a stage without layers"),
    (
        ["train", "--hardware", "nosuch"],
        "unknown --hardware nosuch; profiles: h100, tpu-v4, tpu-v5e, tpu-v5p, tpu-v6e, cpu",
    ),
    (["train", "--data-field", "nosuchfield"], "--data text has no columns. Drop --data-field"),
    (["schedule", "simulate", "1f1b", "--cost-f", "0", "--cost-i", "0", "--cost-w", "0"], "are all 0"),
    (["schedule", "simulate", "1f1b", "--pipe", "100000", "--microbatches", "100000"], "use fewer stages"),
    (["plan", "--mesh", "pipe=2,tensor=2", "--devices", "8", "--budget", "1GiB"], "--mesh takes 4 devices"),
    (["plan", "--budget", "1GiB"], "say how many devices to plan for: --devices N, a mesh with --mesh"),
    (["sample", "no-such-export", "--tokens", "1000000"], "--tokens 1,000,000 is more than 100,000"),
    (["elastic"], "jaxmem elastic needs an action; see jaxmem elastic --help"),
    # The policy and schedule are resolved with the settings, before the data (here missing) is read.
    (["train", "--data", "no/such.txt", "--policy", "nosuch"], "unknown policy preset 'nosuch'"),
    (["train", "--data", "no/such.txt", "--schedule", "nosuch"], "unknown schedule 'nosuch'"),
    (["train", "--data", "no/such.txt", "--policy", "no/such.toml"], "no/such.toml"),
    (["train", "--policy", "chronos-recomp"], "--policy chronos-recomp is generated for the run's schedule"),
    (["train", "--attention", "flash"], "argument --attention: invalid choice: 'flash'"),
    (["plan", "--attention", "flash", "--devices", "4", "--budget", "1GiB"], "invalid choice: 'flash'"),
    (["train", "--policy", "chronos-both", "--budget", "1MiB", "--adaptive"], "--adaptive picks the policy"),
    (["memory", "--policy", "chronos-recomp", "--budget", "1KiB", "--compile", "no"], "cannot fit tiny in"),
    (
        ["launch", "--nprocs", "2", "--", "--nosuchflag"],
        "the jaxmem train arguments: unrecognized arguments: --nosuchflag",
    ),
    # What is cheap to check is checked first: none of these builds a schedule, a device or a batch.
    (["train", "--model", "os.path:join"], "is the function 'join', which needs arguments"),
    (["train", "--steps", "2", "--batch-size", "1000000000"], "is more than the corpus pydoc topics holds"),
    (["train", "--microbatches", "1000000"], "is not divisible by --data-parallel (1) x --microbatches 1000000"),
    (["train", "--pipe", "100000"], "schedule of about 2,400,000 actions, more than 2,000,000"),
    (["memory", "--microbatches", "1000000", "--batch-size", "1000000"], "more than 2,000,000"),
    (["verify", "--microbatches", "1000000"], "more than 2,000,000"),
    (["train", "--devices", "100000", "--pipe", "2"], "at most 4,096 virtual CPU devices can be made here"),
    (["train", "--split-backward"], "1f1b has no I or W actions"),
    (["verify", "--budget", "1GiB"], "say what a chronos-* --policy is generated for"),
    (["sample", "x", "--seed", "-1"], "--seed: must be an integer >= 0, got -1"),
    (
        "elastic recovery --devices 4 --failed 1 --last-checkpoint 50 --steps-done 10 -- --pipe 4".split(),
        "--last-checkpoint 50 is after --steps-done 10",
    ),
]


@pytest.mark.timeout(120)  # a case that hangs (a schedule of a million actions built) fails, not waits
@pytest.mark.parametrize("argv,message", CASES, ids=[" ".join(a)[:60] for a, _ in CASES])
def test_bad_input_is_a_short_error(capsys, argv, message):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse refuses a malformed flag value itself
        code = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and "Warning" not in line]
    assert code == 2, err
    assert message in err and "Traceback" not in err
    assert len(lines) <= 2, err


def test_output_paths_that_cannot_be_written_are_refused_before_the_work(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    cases = [
        (["memory", "--compile", "no", "-o", str(tmp_path / "no" / "such" / "l.png")], "does not exist; create it"),
        (["memory", "--compile", "no", "-o", str(afile / "x.png")], "is a file, not a folder"),
        (["memory", "--compile", "no", "-o", str(tmp_path / "adir.png")], None),  # writable: runs
        (["schedule", "draw", "1f1b", "-o", str(tmp_path / "missing" / "s.png")], "does not exist; create it"),
        (["schedule", "export", "1f1b", "-o", str(tmp_path)], "is a directory"),
        (["export", "ckpt", "-o", str(afile)], "is a file; give a folder"),
        (["export", "ckpt", "-o", str(afile / "sub")], "which is a file"),
        (["launch", "--nprocs", "2", "--run-dir", str(afile), "--", "--steps", "1"], "is a file; give a folder"),
    ]
    for argv, message in cases:
        code = main(argv)
        err = capsys.readouterr().err
        if message is None:
            assert code == 0 and (tmp_path / "adir.png").exists(), err
            continue
        assert code == 2 and message in err and "Traceback" not in err, (argv, err)
        assert len([line for line in err.splitlines() if line.strip() and "Warning" not in line]) <= 2, err


def test_an_unwritable_checkpoint_or_run_directory_is_named(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    for flag in ("--checkpoint-dir", "--run-dir"):
        code = main(["train", "--pipe", "2", "--microbatches", "2", "--batch-size", "4", "--seq-len", "16",
                     "--steps", "1", "--quiet", flag, str(blocker / "sub")])  # fmt: skip
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err
        assert f"{flag} {blocker / 'sub'} is under {blocker}, which is a file; give a folder" in err


def test_data_that_cannot_be_read_as_asked_is_refused(tmp_path, capsys):
    garbage = tmp_path / "bad.parquet"
    garbage.write_bytes(b"not parquet")
    text = tmp_path / "a.txt"
    text.write_text("hello world")
    for argv, message in (
        (["train", "--data", str(garbage), "--steps", "1"], "not a readable Parquet file"),
        (["train", "--data", str(text), "--data-field", "body", "--steps", "1"], "is plain text files"),
        # A vocabulary the text cannot fill: the run could not resume or share under that name.
        (["train", "--data", str(text), "--tokenizer", "bpe:5000", "--steps", "1"], "use --tokenizer bpe:"),
        (["train", "--data", str(text), "--tokenizer", "bpe:99999999", "--steps", "1"], "pick e.g. bpe:32000"),
    ):
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 2 and message in err and "Traceback" not in err, (argv, err)


def test_files_that_are_not_what_they_claim_are_refused_in_one_line(tmp_path, capsys):
    garbage = b"\xff\xfe" + bytes(range(256)) * 4  # not UTF-8 from its first line
    (tmp_path / "garbage.jsonl").write_bytes(garbage)
    (tmp_path / "garbage.bin").write_bytes(garbage)
    for argv, message in (
        (["train", "--data", str(tmp_path / "garbage.jsonl"), "--steps", "1"], "garbage.jsonl:1: not UTF-8 text"),
        (["train", "--config", str(tmp_path / "garbage.bin")], "is not valid TOML: not UTF-8 text"),
        (["train", "--config", str(tmp_path)], "is a directory; give a TOML file"),
    ):
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 2 and message in err and "Traceback" not in err, (argv, err)
        assert len([line for line in err.splitlines() if line.strip() and "Warning" not in line]) == 1, err


def test_a_runs_output_files_are_checked_before_the_run_starts(tmp_path, capsys, monkeypatch):
    """--sample-log or --profile-report naming a folder was an IsADirectoryError after the run's work
    (the adaptive run's report lost at its end): now refused before a model is built."""
    import jaxmem.train._adaptive as adaptive
    import jaxmem.train._loop as loop

    def built(*args, **kwargs):
        pytest.fail("the run started before its output paths were checked")

    monkeypatch.setattr(loop, "Trainer", built)
    monkeypatch.setattr(adaptive, "Trainer", built, raising=False)
    monkeypatch.setattr(adaptive, "AdaptiveProfiler", built, raising=False)
    for argv, message in (
        (["train", "--steps", "1", "--sample-log", str(tmp_path)], f"--sample-log {tmp_path} is a directory"),
        (
            ["train", "--steps", "1", "--adaptive", "--budget", "1GiB", "--profile-report", str(tmp_path)],
            f"--profile-report {tmp_path} is a directory",
        ),
        (["train", "--steps", "1", "--sample-log", str(tmp_path / "no" / "log.jsonl")], "does not exist; create it"),
    ):
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 2 and message in err and "Traceback" not in err, (argv, err)
