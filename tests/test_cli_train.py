"""`jaxmem train` and `jaxmem verify` from the command line (in-process; conftest gave 8 devices)."""

import json
import os

import pytest

from jaxmem._errors import JaxmemError
from jaxmem.cli import main
from jaxmem.config import TrainConfig

SMALL = ["--pipe", "2", "--microbatches", "2", "--batch-size", "4", "--seq-len", "16"]


def test_train_json_summary(capsys):
    code = main(["train", *SMALL, "--steps", "4", "--json", "--quiet"])
    out = capsys.readouterr().out
    assert code == 0
    summary = json.loads(out)
    for key in (
        "steps",
        "loss_first",
        "loss_last",
        "tokens_per_second",
        "schedule",
        "pipe",
        "microbatches",
        "devices",
    ):
        assert key in summary
    assert summary["steps"] == 4 and summary["devices"] == 2 and summary["schedule"] == "1f1b"


def test_config_file_and_flag_override(tmp_path, capsys):
    cfg = tmp_path / "run.toml"
    cfg.write_text('schedule = "gpipe"\nstages = 2\nmicrobatches = 2\nbatch-size = 4\nseq-len = 16\nsteps = 9\n')
    code = main(["train", "--config", str(cfg), "--steps", "2", "--json", "--quiet"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["schedule"] == "gpipe" and summary["steps"] == 2


@pytest.mark.parametrize(
    "argv,message",
    [
        (["train", "--model", "gpt5"], "unknown model preset 'gpt5'"),
        (["train", "--pipe", "3", "--microbatches", "3", "--batch-size", "6"], "e.g. --layers-per-stage 3,3,2"),
        (["train", "--batch-size", "30"], "not divisible"),
        (["train", "--schedule", "2f2b"], "unknown schedule"),
        (["train", "--steps", "0"], "--steps must be an integer >= 1"),
        (["train", "--layers-per-stage", "a,b"], "--layers-per-stage takes comma-separated integers"),
        (["train", "--schedule", "1f1b", "--virtual", "2"], "drop --virtual 2"),
        (
            ["train", "--lr-schedule", "cosine", "--warmup-steps", "5", "--steps", "3"],
            "--warmup-steps 5 leaves no steps of the cosine decay (--steps 3)",
        ),
    ],
)
def test_train_bad_input(capsys, argv, message):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def test_the_library_names_a_setting_as_its_caller_wrote_it(capsys):
    """The same check, from Python and from the command line: each error speaks its caller's words."""
    from jaxmem._errors import setting

    with pytest.raises(JaxmemError, match=r"warmup_steps=5 leaves no steps of the cosine decay \(steps=3\)"):
        TrainConfig(lr_schedule="cosine", warmup_steps=5, steps=3)
    assert main(["train", "--policy", "chronos-recomp"]) == 2
    err = capsys.readouterr().err
    assert "--policy chronos-recomp is generated" in err and "set --budget" in err and "policy=" not in err
    assert setting("budget") == "budget"  # the command's phrasing ended with the command


def test_unknown_config_key(tmp_path, capsys):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("stagez = 4\n")
    assert main(["train", "--config", str(cfg)]) == 2
    assert "unknown setting 'stagez'" in capsys.readouterr().err


def test_verify_json(capsys):
    # A jaxmem plan pick verifies by the words of its train command: a chronos-* policy under --budget.
    code = main(["verify", "--schedule", "zb-h1", "--pipe", "2", "--microbatches", "4", "--policy", "chronos-recomp",
                 "--budget", "29MiB", "--hardware", "cpu", "--split-backward", "--json"])  # fmt: skip
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    for key in ("ok", "max_abs_diff", "max_rel_diff", "schedule"):
        assert key in result
    assert result["ok"] is True and result["policy"] == "chronos-recomp"


def test_progress_is_plain_lines_when_stderr_is_not_a_terminal(capsys):
    # Under capsys stderr is not a terminal: no bar that appears only at the end, a line every N steps.
    code = main(["train", *SMALL, "--steps", "4", "--log-every", "2"])
    err = capsys.readouterr().err
    assert code == 0
    assert "step 2/4  loss" in err and "step 4/4  loss" in err and "step 3/4" not in err
    # The rate is the steps' own (4 x 16 tokens each), not diluted by the first step's compile.
    import re

    rate, median = re.search(r"step 4/4  loss \S+  ([\d,]+) tok/s  ([\d.]+) s/step", err).groups()
    assert 0.5 < float(rate.replace(",", "")) * float(median) / 64 < 2.0


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--devices", "2", "--pipe", "2", "--steps", "1"],
        ["verify", "--devices", "2", "--pipe", "2"],
        ["memory", "--pipe", "2", "--compile", "no"],
    ],
    ids=lambda argv: argv[0],
)
def test_the_device_count_is_set_before_anything_imports_jax(argv):
    """`--devices N` (and the mesh's own count) only takes effect while JAX is not yet imported: a
    command that imported it first (as `train` did through the launcher's worker hook) runs on one CPU
    device whatever the user asked for. Checked in a fresh process without XLA_FLAGS, at the moment
    each command sets the count."""
    import subprocess
    import sys

    script = f"""
import sys
import jaxmem.cli.{argv[0]} as command

def check(count):
    print("jax imported" if "jax" in sys.modules else f"ok {{count}}")
    raise SystemExit(0)

command.setup_devices = check
from jaxmem._errors import JaxmemError
from jaxmem.cli import main
from jaxmem.config import TrainConfig
main({argv!r})
"""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["ok", "2"], proc.stdout


_USER_MODEL = """
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jaxmem.models import from_nnx, token_loss


class Block(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, x):
        return x + nnx.tanh(checkpoint_name(self.lin(x), "hidden"))


class LM(nnx.Module):
    def __init__(self, rngs):
        self.tok = nnx.Embed(256, 16, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(4)])
        self.out = nnx.Linear(16, 256, rngs=rngs)


def build():
    return from_nnx(
        LM,
        layers="blocks",
        embed=lambda m, b: m.tok(b["tokens"]),
        head_loss=lambda m, x, b: token_loss(m.out(x), b),
        tags=("hidden",),
        name="user-lm",
        vocab_size=256,
    )
"""


def test_a_model_of_your_own_is_named_on_the_command_line(tmp_path, monkeypatch, capsys):
    """``--model package.module:attr`` (a factory here) gets verify, memory, plan and train from the
    CLI, imported from the directory the command runs in; a wrong name says what is wrong."""
    (tmp_path / "user_models.py").write_text(_USER_MODEL)
    monkeypatch.chdir(tmp_path)
    spec = "user_models:build"
    assert main(["verify", "--model", spec, *SMALL[:4], "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"]
    assert main(["memory", "--model", spec, *SMALL, "--compile", "no", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "user-lm"
    plan = ["plan", "--model", spec, "--devices", "2", "--budget", "1GiB", "--batch-size", "4", "--seq-len", "16"]
    assert main([*plan, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)
    assert main(["roam", "analyze", "--model", spec, "--batch", "2", "--seq-len", "16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == "user-lm train step (batch 2, seq 16)"
    assert main(["train", "--model", spec, *SMALL, "--steps", "2", "--json", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 2
    for bad, message in (
        ("user_models:nothing", "has no attribute 'nothing'"),
        ("no_such_module:build", "cannot import 'no_such_module'"),
        ("user_models:Block", "it must be a StagedModel or a function returning one"),
    ):
        assert main(["memory", "--model", bad, *SMALL, "--compile", "no"]) == 2
        assert message in capsys.readouterr().err
