"""A run on your own data: text files, JSONL and Parquet read into a packed corpus, a BPE tokenizer
trained on it, warmup + cosine AdamW with clipping, eval on held-out data, metrics in JSONL, CSV and
TensorBoard events, bit-exact resume, export to safetensors and back, sampling."""

import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import numpy as np
import optax
import pytest

from jaxmem import JaxmemError
from jaxmem.data import Corpus, DataIterator, get_tokenizer, list_files, load_corpus
from jaxmem.models import GPTConfig, sample
from jaxmem.train import (
    TrainConfig,
    Trainer,
    TrainingError,
    export_checkpoint,
    learning_rate,
    load_exported,
    load_model,
    read_metrics,
    train,
)
from jaxmem.train._trainer import _decay_mask

MODEL = GPTConfig(n_layers=4, d_model=32, n_heads=2, max_seq_len=32)
SHAPE = dict(model=MODEL, pipe=2, microbatches=2, batch_size=4, seq_len=32)
RUN = dict(
    **SHAPE,
    tokenizer="bpe:300",
    eval_fraction=0.1,
    eval_every=3,
    eval_batches=2,
    lr_schedule="cosine",
    warmup_steps=2,
    weight_decay=0.1,
    grad_clip=1.0,
    checkpoint_every=3,
    hardware="h100",  # MFU against a fixed profile: no CPU calibration compile in the test
)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    from pydoc_data import topics

    root = tmp_path_factory.mktemp("corpus")
    keys = sorted(topics.topics)[:30]
    for i, key in enumerate(keys):
        sub = root / ("a" if i % 2 else "b")
        sub.mkdir(exist_ok=True)
        (sub / f"{key}.txt").write_text(topics.topics[key])
    (root / "notes.bin").write_text("not read: not a text suffix")
    return str(root)


def _run(config, **kw):
    states = []
    summary = train(config, progress=False, on_step=lambda state, loss: states.append(state), **kw)
    return summary, states[-1] if states else None


@pytest.fixture(scope="module")
def straight(corpus_dir, tmp_path_factory):
    """Six steps in one go, with metrics and checkpoints."""
    root = tmp_path_factory.mktemp("straight")
    config = TrainConfig(**RUN, data=corpus_dir, steps=6, run_dir=str(root / "run"), checkpoint_dir=str(root / "ckpt"))
    trainer = Trainer(config)
    summary, state = _run(config, trainer=trainer)
    return config, trainer, summary, state


# ------------------------------------------------------------------ data without compiling
def test_a_folder_is_read_in_sorted_order_and_only_text_suffixes(corpus_dir):
    files = list_files(corpus_dir)
    assert len(files) == 30 and files == sorted(files)
    assert not any(f.endswith(".bin") for f in files)
    assert list_files(os.path.join(corpus_dir, "a", "*.txt")) == [f for f in files if "/a/" in f]


def test_jsonl_and_parquet_documents(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"body": f"document number {i} says hello"} for i in range(5)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.table({"body": [r["body"] for r in rows]}), tmp_path / "d.parquet")
    jsonl = load_corpus(str(tmp_path / "d.jsonl"), field="body")
    parquet = load_corpus(str(tmp_path / "d.parquet"), field="body")
    assert jsonl.documents == parquet.documents == 5
    np.testing.assert_array_equal(jsonl.tokens, parquet.tokens)
    text = "\n\n".join(r["body"] for r in rows)
    np.testing.assert_array_equal(jsonl.tokens, np.frombuffer(text.encode(), np.uint8))
    with pytest.raises(JaxmemError, match="no field 'text'.*data_field"):
        load_corpus(str(tmp_path / "d.jsonl"))
    with pytest.raises(JaxmemError, match="no column 'text'"):
        load_corpus(str(tmp_path / "d.parquet"))
    # A .json file is read as JSON lines (as the docs and --data's help say), and not-UTF-8 bytes in
    # one are named by file and line.
    (tmp_path / "d.json").write_text((tmp_path / "d.jsonl").read_text())
    assert load_corpus(str(tmp_path / "d.json"), field="body").documents == 5
    (tmp_path / "bad.json").write_bytes(b'{"body": "ok"}\n\xff\xfe\n')
    with pytest.raises(JaxmemError, match=r"bad.json:2: not UTF-8 text"):
        load_corpus(str(tmp_path / "bad.json"), field="body")


def test_hugging_face_datasets_from_the_hub_cache_and_local_directories(tmp_path):
    """``hf:NAME[:SPLIT]`` reads a hub dataset from the hub cache offline (a snapshot laid out as the
    hub writes it), a ``save_to_disk`` directory, and names what is wrong otherwise. In a subprocess:
    the hub cache's location is read when huggingface_hub is imported."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    revision = "0" * 40
    repo = tmp_path / "home" / "hub" / "datasets--someone--toy"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    files = repo / "snapshots" / revision / "data"
    files.mkdir(parents=True)
    pq.write_table(pa.table({"body": [f"train doc {i}" for i in range(4)]}), files / "train-00000-of-00001.parquet")
    pq.write_table(pa.table({"body": ["test doc 0", "test doc 1"]}), files / "test-00000-of-00001.parquet")
    script = textwrap.dedent(
        f"""
        import datasets, json
        from jaxmem import JaxmemError
        from jaxmem.data import load_corpus
        saved = {str(tmp_path / "saved")!r}
        datasets.Dataset.from_dict({{"body": ["saved a", "saved b"]}}).save_to_disk(saved)
        out = {{}}
        for spec in ["hf:someone/toy", "hf:someone/toy:test", "hf:" + saved]:
            c = load_corpus(spec, field="body")
            out[spec] = [c.name, c.documents, bytes(c.tokens.astype("uint8")).decode()]
        for spec, field in [("hf:someone/missing", "body"), ("hf:someone/toy:dev", "body"),
                            ("hf:someone/toy", "text"), ("hf:a:b:c:d", "body")]:
            try:
                load_corpus(spec, field=field)
            except JaxmemError as e:
                out[spec + "|" + field] = str(e)
        print(json.dumps(out))
        """
    )
    env = {**os.environ, "HF_HOME": str(tmp_path / "home")}
    env.pop("HF_DATASETS_OFFLINE", None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["hf:someone/toy"] == ["someone/toy (train)", 4, "\n\n".join(f"train doc {i}" for i in range(4))]
    assert out["hf:someone/toy:test"][1:] == [2, "test doc 0\n\ntest doc 1"]
    assert out["hf:" + str(tmp_path / "saved")][1:] == [2, "saved a\n\nsaved b"]
    assert "must already be in the local cache" in out["hf:someone/missing|body"]
    assert "dev" in out["hf:someone/toy:dev|body"] and "train" in out["hf:someone/toy:dev|body"]
    assert "no column 'text' (has: body); name it with data_field" in out["hf:someone/toy|text"]
    assert "hf:NAME:CONFIG:SPLIT" in out["hf:a:b:c:d|body"]


@pytest.mark.parametrize(
    "spec,message",
    [("/nonexistent/x.txt", "no such file"), ("/nonexistent/*.txt", "no file matches"), ("", "names no files")],
)
def test_bad_data_paths(spec, message):
    with pytest.raises(JaxmemError, match=message):
        load_corpus(spec)


def test_bpe_is_trained_saved_and_reloaded_identically(corpus_dir, tmp_path):
    corpus = load_corpus(corpus_dir, tokenizer="bpe:300")
    tok = corpus.tokenizer
    assert tok.vocab_size == 300 and tok.eos_id is not None
    assert len(corpus) < 0.8 * sum(os.path.getsize(f) for f in list_files(corpus_dir))  # 44 merges compress
    sample = "The for statement is used to iterate"
    assert tok.decode(tok.encode(sample)) == sample
    tok.save(str(tmp_path))
    again = load_corpus(corpus_dir, tokenizer="bpe:300", saved=str(tmp_path))
    assert again.fingerprint == corpus.fingerprint
    with pytest.raises(JaxmemError, match="holds a tokenizer of 300 ids"):
        get_tokenizer("bpe:400", saved=str(tmp_path))


def test_eval_split_is_held_out_and_iteration_is_exactly_once(corpus_dir):
    corpus = load_corpus(corpus_dir)
    train_part, eval_part = corpus.split(0.1)
    assert len(train_part) + len(eval_part) == len(corpus)
    np.testing.assert_array_equal(eval_part.tokens, corpus.tokens[len(train_part) :])
    it = DataIterator(source=train_part, batch_size=3, seq_len=16, seed=5)
    windows = [it.window_of(i) for i in range(it.num_windows)]
    assert sorted(windows) == list(range(it.num_windows))  # one epoch: every window once
    second = [it.window_of(i + it.num_windows) for i in range(it.num_windows)]
    assert sorted(second) == sorted(windows) and second != windows  # reshuffled per epoch
    with pytest.raises(JaxmemError, match="has 256 ids but the model's vocabulary is 100"):
        DataIterator(source=corpus, batch_size=1, seq_len=8, vocab_size=100)


def test_learning_rate_schedule_warms_up_and_decays():
    config = TrainConfig(steps=100, lr=1e-3, lr_schedule="cosine", warmup_steps=10, min_lr_ratio=0.1)
    lr = learning_rate(config)
    assert float(lr(0)) == 0.0 and float(lr(5)) == pytest.approx(5e-4)
    assert float(lr(10)) == pytest.approx(1e-3) and float(lr(100)) == pytest.approx(1e-4)
    assert float(lr(55)) == pytest.approx(1e-4 + 0.5 * 9e-4, rel=1e-3)
    constant = learning_rate(TrainConfig(steps=100, lr=1e-3, warmup_steps=4))
    assert float(constant(2)) == pytest.approx(5e-4) and float(constant(50)) == pytest.approx(1e-3)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(lr=float("nan")), "finite number > 0"),
        (dict(lr_schedule="linear"), "constant or cosine"),
        (dict(warmup_steps=300, lr_schedule="cosine"), "leaves no steps"),
        (dict(grad_clip=0.0), "grad_clip must be > 0"),
        (dict(weight_decay=-1.0), "weight_decay must be >= 0"),
        (dict(eval_every=5), "eval_every needs held-out data"),
        (dict(eval_fraction=1.0), "fraction in \\[0, 1\\)"),
        (dict(log_every=0), "log_every must be an integer >= 1"),
        (dict(checkpoint_every=0), "checkpoint_every must be an integer >= 1"),
        (dict(data="synthetic", tokenizer="bpe:300"), "synthetic data draws token ids"),
        (dict(devices=0), "devices must be an integer >= 1"),
        (dict(seq_len_schedule=(16, 32)), "set adaptive and budget"),
        (dict(adaptive=True, budget=2**24, run_dir="x"), "write no run_dir metrics"),
        (dict(budget=2**24), "budget is used by"),
    ],
)
def test_bad_run_settings(kwargs, message):
    with pytest.raises(JaxmemError, match=message):
        TrainConfig(**kwargs)


# ------------------------------------------------------------------ a whole run
def test_the_run_trains_on_the_files_with_the_bpe_vocabulary(straight):
    config, trainer, summary, state = straight
    assert trainer.model.vocab_size == 300 and summary["tokenizer"] == "bpe:300"
    assert summary["steps"] == 6 and np.isfinite(summary["losses"]).all()
    assert [step for step, _ in summary["eval_losses"]] == [3, 6]
    # AdamW decays matrices but not biases or norm scales; clipping wraps it.
    decayed = {jax.tree_util.keystr(p): m for p, m in jax.tree_util.tree_leaves_with_path(_decay_mask(state.params))}
    for name, decays in decayed.items():
        assert decays == (name.endswith(("kernel']", "embedding']")) or ".vocab[" in name), name


def test_metrics_are_written_and_tensorboard_reads_them_back(straight):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config, trainer, summary, state = straight
    records = read_metrics(config.run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in records] == pytest.approx(summary["losses"])
    assert "step_seconds" not in records[0]  # the compiling step is not timed as a step
    for r in records[1:]:
        assert r["tokens_per_second"] > 0 and 0 < r["mfu"] and r["grad_norm"] > 0
        assert r["compiled_device_bytes"] > 0
    assert records[0]["lr"] == 0.0 and records[2]["lr"] == pytest.approx(config.lr)
    assert [r.get("eval_loss") is not None for r in records] == [False, False, True, False, False, True]
    events = EventAccumulator(config.run_dir)
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4, 5, 6]
    assert [e.value for e in loss] == pytest.approx(summary["losses"], rel=1e-6)
    assert [e.step for e in events.Scalars("eval/loss")] == [3, 6]
    assert {"train/mfu", "train/tokens_per_second", "train/lr", "train/grad_norm"} <= set(events.Tags()["scalars"])
    with open(os.path.join(config.run_dir, "metrics.csv")) as f:
        header = f.readline().strip().split(",")
    assert header[:3] == ["step", "loss", "eval_loss"]
    assert os.path.getsize(os.path.join(config.run_dir, "metrics.png")) > 10_000


def test_resume_is_bit_exact_and_metrics_are_not_duplicated(straight, corpus_dir, tmp_path):
    config, _, summary, state = straight
    half = TrainConfig(
        **RUN, data=corpus_dir, steps=6, run_dir=str(tmp_path / "run"), checkpoint_dir=str(tmp_path / "ckpt")
    )
    first, _ = _run(dataclasses.replace(half, steps=3))
    second, resumed = _run(half)
    assert second["resumed_from"] == 3
    assert first["losses"] + second["losses"] == summary["losses"]  # bit-exact, not approximately
    for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert [r["step"] for r in read_metrics(half.run_dir)] == [1, 2, 3, 4, 5, 6]


def test_resuming_on_other_data_is_refused(straight, corpus_dir, tmp_path):
    config, *_ = straight
    import shutil

    changed = tmp_path / "changed"
    shutil.copytree(corpus_dir, changed)
    (changed / "a" / "extra.txt").write_text("a new document changes the token stream")
    other = TrainConfig(**RUN, data=str(changed), steps=9, checkpoint_dir=str(tmp_path / "ckpt"))
    shutil.copytree(config.checkpoint_dir, other.checkpoint_dir)
    with pytest.raises(JaxmemError, match="trained on other data"):
        train(other, progress=False)


def test_export_loads_back_identical_parameters_and_samples(straight, tmp_path):
    config, trainer, _, state = straight
    out = str(tmp_path / "export")
    written = export_checkpoint(config.checkpoint_dir, out)
    assert written["step"] == 6 and written["tokenizer"] == "tokenizer.json"
    exported = load_exported(out)
    expected = jax.device_get(trainer.pipeline.to_model_params(state.params))
    assert jax.tree.structure(exported.params) == jax.tree.structure(expected)
    for (name, a), b in zip(jax.tree_util.tree_leaves_with_path(exported.params), jax.tree.leaves(expected)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(name))
    # Into the Flax module of the same model.
    from flax import nnx

    from jaxmem.models import GPT

    module = GPT(exported.model.config, rngs=nnx.Rngs(1))
    nnx.update(module, nnx.State(exported.params))
    tokens = exported.tokenizer.encode("The for statement")[None, :]
    np.testing.assert_allclose(
        np.asarray(module(tokens)),
        np.asarray(exported.model.logits(exported.params, {"tokens": tokens, "targets": tokens})),
        rtol=1e-6,
    )
    # Sampling: greedy continuation is the argmax of the logits; sampling is seeded.
    greedy = sample(exported.model, exported.params, list(tokens[0]), max_new_tokens=1, temperature=0)
    assert greedy == [int(np.argmax(np.asarray(module(tokens))[0, -1]))]
    text = exported.sample("The for", max_new_tokens=8, seed=3)
    assert text == load_model(config.checkpoint_dir).sample("The for", max_new_tokens=8, seed=3)
    with pytest.raises(JaxmemError, match="already holds an export"):
        export_checkpoint(config.checkpoint_dir, out)
    # The export names the saved state, not the exporting machine's paths ...
    with open(os.path.join(out, "config.json")) as f:
        text = f.read()
    assert str(tmp_path) not in text and os.path.abspath(config.checkpoint_dir) not in text
    assert written["checkpoint"]["step"] == 6 and len(written["checkpoint"]["manifest_sha256"]) == 64
    again = export_checkpoint(config.checkpoint_dir, str(tmp_path / "again"))
    assert again["checkpoint"] == written["checkpoint"]
    # ... and reads no tokenizer from outside its directory.
    secret = tmp_path / "secret.json"
    secret.write_text("{}")
    edited = {**json.loads(text), "tokenizer": "../secret.json"}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(edited, f)
    with pytest.raises(JaxmemError, match="not a file name inside the export"):
        load_exported(out)


def test_a_non_finite_loss_stops_the_run_at_its_step_and_saves_nothing_of_it(tmp_path):
    config = TrainConfig(**SHAPE, steps=6, checkpoint_every=1, checkpoint_dir=str(tmp_path / "ckpt"))
    trainer = Trainer(config, optimizer=optax.sgd(float("nan")))  # the first update makes every weight nan
    with pytest.raises(TrainingError, match="loss is nan at step 2"):
        train(config, trainer=trainer, progress=False)
    saved = sorted(n for n in os.listdir(config.checkpoint_dir) if n != ".jaxmem.lock")  # the run's lock stays
    assert saved == ["1", "jaxmem_checkpoints.json"]


def test_cli_export_and_sample(straight, tmp_path, capsys, caplog):
    import logging

    from jaxmem.cli import main

    config, *_ = straight
    with caplog.at_level(logging.INFO):
        assert main(["export", config.checkpoint_dir, "-o", str(tmp_path / "x"), "--json"]) == 0
    # Reading a checkpoint is read-only by design: Orbax's warnings about that are not for the user.
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "orbax" in r.pathname]
    assert json.loads(capsys.readouterr().out)["step"] == 6
    assert main(["sample", str(tmp_path / "x"), "--prompt", "The ", "--tokens", "5", "--seed", "1"]) == 0
    assert capsys.readouterr().out.startswith("The ")
    assert main(["sample", str(tmp_path / "nothing")]) == 2
    assert "no such checkpoint directory" in capsys.readouterr().err


def test_corpus_fingerprint_tracks_content():
    from jaxmem.data import ByteTokenizer

    a = Corpus(np.arange(10, dtype=np.int32), ByteTokenizer(), "a")
    b = Corpus(np.arange(10, dtype=np.int32), ByteTokenizer(), "b")
    c = Corpus(np.arange(1, 11, dtype=np.int32), ByteTokenizer(), "c")
    assert a.fingerprint == b.fingerprint != c.fingerprint


@pytest.mark.timeout(400)
def test_sigterm_saves_the_current_step_and_the_run_resumes_with_no_lost_step(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    ckpt, samples = tmp_path / "ckpt", tmp_path / "samples.log"
    argv = [sys.executable, "-m", "jaxmem", "train", "--pipe", "2", "--microbatches", "2", "--batch-size", "4"]
    argv += ["--seq-len", "16", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1000"]
    argv += ["--sample-log", str(samples), "--quiet"]
    proc = subprocess.Popen([*argv, "--steps", "500"], stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if samples.exists() and len(samples.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    done = len(samples.read_text().splitlines())
    assert 3 <= done < 500
    assert f"stopped by SIGTERM after step {done} of 500" in err and "Traceback" not in err
    assert sorted(p.name for p in ckpt.iterdir() if p.name.isdigit()) == [str(done)]  # saved at that very step
    resumed = subprocess.run([*argv, "--steps", str(done + 2)], capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    lines = [line.split() for line in samples.read_text().splitlines()]
    assert [int(x[0]) for x in lines] == list(range(1, done + 3))
    assert sorted(int(i) for x in lines for i in x[1:]) == list(range(4 * (done + 2)))


@pytest.mark.timeout(400)
def test_a_failed_background_save_stops_the_run_at_once_and_the_last_step_restores(tmp_path):
    """A save that cannot be written (here the file-size limit, as a full disk would) is reported
    at the step after it, in one line, and the step committed before it resumes the run."""
    import subprocess
    import sys

    ckpt, samples = tmp_path / "ckpt", tmp_path / "samples.log"
    argv = [sys.executable, "-m", "jaxmem", "train", "--pipe", "2", "--microbatches", "2", "--batch-size", "4"]
    argv += ["--seq-len", "16", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "5", "--quiet"]
    argv += ["--sample-log", str(samples)]
    first = subprocess.run([*argv, "--steps", "5"], capture_output=True, text=True, timeout=240)
    assert first.returncode == 0, first.stderr[-2000:]

    # Each array file of a step is > 64 KiB, the sample log stays under it. (The limit is set in a
    # small wrapper that then execs the run: a preexec_fn would fork this multithreaded JAX process.)
    limited = [sys.executable, "-c", "import os, resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, "
               "(65536, 65536)); os.execv(sys.executable, [sys.executable, *sys.argv[1:]])", *argv[1:]]  # fmt: skip
    env = {**os.environ, "JAX_ENABLE_COMPILATION_CACHE": "false"}  # no cache writes under the size limit
    failed = subprocess.run([*limited, "--steps", "400", "--checkpoint-every", "10"], capture_output=True,
                            text=True, timeout=240, env=env)  # fmt: skip
    err = failed.stderr
    assert failed.returncode == 2, err[-2000:]
    assert "saving checkpoint step 10" in err and "File too large" in err, err[:3000]
    assert "the last committed step, 5, is intact" in err
    assert "Traceback" not in err and len([line for line in err.splitlines() if line.strip()]) == 1, err[-2000:]
    assert 10 <= len(samples.read_text().splitlines()) < 20  # stopped at once, not at the next save (20)
    assert sorted(p.name for p in ckpt.iterdir() if p.name.isdigit()) == ["5"]
    resumed = subprocess.run([*argv, "--steps", "7"], capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    lines = [line.split() for line in samples.read_text().splitlines()]  # resumed at 5: each sample once
    assert [int(x[0]) for x in lines] == list(range(1, 8))
    assert sorted(int(i) for x in lines for i in x[1:]) == list(range(4 * 7))


def test_low_free_space_is_warned_about_before_a_save(tmp_path, monkeypatch):
    import shutil

    import jax.numpy as jnp

    from jaxmem.train import _checkpoint

    lines = []
    ckpt = _checkpoint.Checkpointer(tmp_path / "ckpt", every=1, log=lines.append)
    state = {"w": jnp.ones((1024, 256))}  # 1 MiB
    ckpt.save(1, state, {})
    assert lines == []
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(_checkpoint.shutil, "disk_usage", lambda path: usage._replace(free=3 * 2**19))
    ckpt.save(2, state, {})
    ckpt.close()
    assert len(lines) == 1 and "1.5 MiB free" in lines[0] and "about 1.0 MiB" in lines[0], lines
    assert ckpt.steps() == [1, 2]  # a warning, not a refusal


def test_a_diverged_loss_is_not_checkpointed_and_saves_resume_when_it_comes_back(tmp_path):
    """#34 item 8: a finite but diverged loss (4.7e12 after ~5) falls due for a save: the guard keeps
    that state out of the checkpoints, says so once, saves again once the loss is back, and at the end
    leaves the last good step to resume from."""
    from jaxmem.train import CheckpointHook, StepInfo

    trainer = Trainer(TrainConfig(pipe=2, microbatches=2, batch_size=4, seq_len=16))
    state = trainer.init_state()
    lines = []
    hook = CheckpointHook(str(tmp_path / "ckpt"), every=5, keep=10, log=lines.append)
    state = hook.on_start(trainer, state)

    def step(k, loss):
        hook.on_step(trainer, dataclasses.replace(state, step=k), StepInfo(k, loss, None, 0.1, (), {}))

    for k in range(1, 23):
        step(k, 5.0 - 0.01 * k)
    for k in range(23, 27):  # diverged: step 25 falls due
        step(k, 4.7e12)
    for k in range(27, 31):
        step(k, 4.7)
    step(31, 4.7e12)
    hook.on_end(trainer, dataclasses.replace(state, step=31))
    assert hook.checkpointer.steps() == [5, 10, 15, 20, 30] and hook.skipped == [25, 31]
    said = "\n".join(lines)
    assert said.count("is not checkpointed") == 2 and "the last saved step, 20, stays" in said
    assert "saving again" in said and "step 31 is not saved; resume from step 30" in said


def test_export_writes_only_where_it_was_asked_and_all_or_nothing(straight, corpus_dir, tmp_path, monkeypatch):
    import shutil

    import jaxmem.train._export as export

    config, *_ = straight
    data = tmp_path / "data"
    shutil.copytree(corpus_dir, data)
    before = sorted(p.name for p in data.rglob("*"))
    for out, message in (
        (config.checkpoint_dir, "is the checkpoint folder"),
        (os.path.join(config.checkpoint_dir, "6"), "is inside the checkpoint folder"),
        (str(data), "holds files that are not an export (a, b, notes.bin)"),
    ):
        with pytest.raises(JaxmemError, match=re.escape(message)):
            export_checkpoint(config.checkpoint_dir, out)
    assert sorted(p.name for p in data.rglob("*")) == before
    # A full disk while the weights are written: no file of the export is left, in either format, and
    # an earlier export in the folder stays whole.
    earlier = tmp_path / "earlier"
    export_checkpoint(config.checkpoint_dir, str(earlier))
    kept = {p.name: p.read_bytes() for p in earlier.iterdir()}
    real = export._import_safetensors()

    class FullDisk:
        @staticmethod
        def save_file(flat, path, metadata=None):
            with open(path, "wb") as f:
                f.write(b"\0" * 1000)  # a part, then the disk is full
            raise RuntimeError('serializing: IoError(Os { code: 28, message: "No space left on device" })')

        load_file = real.load_file

    monkeypatch.setattr(export, "_import_safetensors", lambda: FullDisk)
    for fmt in ("jaxmem", "hf"):
        for out, force in ((tmp_path / f"new-{fmt}", False), (earlier, True)):
            with pytest.raises(
                JaxmemError, match="could not write model.safetensors .*No space left.*ulimit -f.*nothing was written"
            ):
                export_checkpoint(config.checkpoint_dir, str(out), format=fmt, force=force)
    assert not (tmp_path / "new-jaxmem").exists() and not (tmp_path / "new-hf").exists()
    assert {p.name: p.read_bytes() for p in earlier.iterdir()} == kept
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".jaxmem-export-")]


def test_a_run_resumed_past_its_last_step_says_so(straight, tmp_path, capsys):
    import shutil

    config, *_ = straight
    shutil.copytree(config.checkpoint_dir, tmp_path / "ckpt")
    done = dataclasses.replace(config, steps=4, run_dir=None, checkpoint_dir=str(tmp_path / "ckpt"))
    summary = train(done, progress=True)
    err = " ".join(capsys.readouterr().err.split())
    assert summary["losses"] == [] and summary["resumed_from"] == 6
    assert "the run is already past its last step: it resumed at step 6" in err and "Give a larger steps" in err
