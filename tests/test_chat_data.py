"""Chat data for fine-tuning: conversations rendered with a chat template, a loss mask on the assistant's tokens in
the bundles, labels -100 elsewhere through the loader, and no gradient from masked tokens through the real model and
loss; Parquet and save_to_disk inputs."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from data_helpers import EOS, write_dataset

CHATS = [
    {"messages": [{"role": "user", "content": "Who speaks first?"},
                  {"role": "assistant", "content": "The ghost, my lord."}]},
    {"messages": [{"role": "system", "content": "Answer in verse."},
                  {"role": "user", "content": "Thy name?"},
                  {"role": "assistant", "content": "Call me Hamlet; 𝄞 é"},
                  {"role": "user", "content": "And then?"},
                  {"role": "assistant", "content": "  The rest is silence.\n"}]},
]


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    from data_helpers import gemma_like_tokenizer

    return gemma_like_tokenizer(tmp_path_factory.mktemp("gemma"))


def _prepare(tmp_path, inputs, tokenizer, name="chat", **options):
    from zaya.data.bundle import PreparedDataset
    from zaya.data.prepare import PrepareOptions, prepare

    logs = []
    prepare(PrepareOptions(inputs=[str(i) for i in inputs], out=str(tmp_path / name), tokenizer=str(tokenizer),
                           format="chat", val_fraction=0.0, **options), log=logs.append)
    return PreparedDataset(tmp_path / name), logs


def _documents(ds):
    bundle = ds.split("train").bundles[0]
    for i in range(bundle.num_documents):
        a, b = int(bundle.index[i]), int(bundle.index[i + 1])
        yield np.asarray(bundle.tokens[a:b]), np.asarray(bundle.mask[a:b])


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


def test_the_checkpoint_template_gives_transformers_ids_and_masks_the_replies(tmp_path, gemma_dir):
    """Gemma's template (it writes <bos> itself: no second one): ids equal transformers' apply_chat_template; the
    targets are exactly each reply, its <end_of_turn> and newline, and the eos after a final reply."""
    from transformers import AutoTokenizer

    ds, logs = _prepare(tmp_path, [_jsonl(tmp_path / "c.jsonl", CHATS)], gemma_dir)
    assert ds.loss_mask and ds.manifest["tokenizer"]["prefix_ids"] == [2]
    assert set(ds.manifest["tokenizer"]["files"]) == {"tokenizer.json", "tokenizer_config.json"}
    assert (ds.directory / "tokenizer_config.json").read_bytes() == (gemma_dir / "tokenizer_config.json").read_bytes()
    assert "tokenizer_config.json (chat_template)" in logs[0]
    hf = AutoTokenizer.from_pretrained(str(gemma_dir))
    tok = ds.tokenizer()
    for chat, (ids, mask) in zip(CHATS, _documents(ds)):
        expected = hf.apply_chat_template(chat["messages"], tokenize=True, return_dict=True)["input_ids"]
        assert ids.tolist() == expected + [EOS - 1]  # Gemma's eos is 1
        replies = [m["content"].strip() + "<end_of_turn>\n" for m in chat["messages"] if m["role"] == "assistant"]
        assert tok.decode(ids[:-1][mask[:-1] == 1].tolist()) == "".join(replies)
        assert mask[-1] == 1  # the conversation ends with a reply: its eos is a target
        assert mask[0] == 0 and ids[0] == 2


def test_the_default_template_starts_with_prefix_ids_and_keeps_special_spellings_as_text(tmp_path, gemma_dir):
    """Without a template in the tokenizer's directory: zaya's default, the document led by <bos> (prefix_ids),
    text spelling a special token encoded as text, the targets " reply\\n\\n" and the final eos."""
    from zaya.data.chat_template import DEFAULT_TEMPLATE, DefaultRenderer

    plain = tmp_path / "plain"
    plain.mkdir()
    shutil.copy(gemma_dir / "tokenizer.json", plain / "tokenizer.json")
    chats = [{"messages": [{"role": "user", "content": "say <eos>"}, {"role": "assistant", "content": "<eos> it"}]}]
    ds, logs = _prepare(tmp_path, [_jsonl(tmp_path / "c.jsonl", chats)], plain)
    assert "zaya's default chat template" in logs[0]
    (ids, mask), = _documents(ds)
    tok = ds.tokenizer()
    text = DefaultRenderer().render({"messages": chats[0]["messages"], "add_generation_prompt": False})
    assert "{{ '\\n\\n' }}" in DEFAULT_TEMPLATE and text == "User: say <eos>\n\nAssistant: <eos> it\n\n"
    assert ids.tolist() == [2] + tok.encode(text) + [1]
    assert tok.decode(ids[mask == 1][:-1].tolist()) == " <eos> it\n\n" and mask[-1] == 1


def test_malformed_conversations_are_skipped_and_counted_or_refused_with_strict(tmp_path, gemma_dir):
    bad = [{"text": "no messages"}, {"messages": []}, {"messages": [{"role": "robot", "content": "x"}]},
           {"messages": [{"role": "user", "content": 3}]}, {"messages": [{"role": "user", "content": "hi"}]}]
    path = _jsonl(tmp_path / "c.jsonl", CHATS[:1] + bad)
    ds, logs = _prepare(tmp_path, [path], gemma_dir)
    assert ds.manifest["stats"]["bad_lines"] == 5 and ds.split("train").num_documents == 1
    text = "\n".join(logs)
    for line, words in ((2, "'messages' is not a non-empty list"), (4, "message 0 has role 'robot'"), (5, "message 0 has a int content"),
                        (6, "no assistant message")):
        assert f"c.jsonl:{line}: skipped, {words}" in text
    from zaya.data.sources import InputError

    with pytest.raises(InputError, match=r"c.jsonl:2: 'messages' is not a non-empty list; a chat record is"):
        _prepare(tmp_path, [path], gemma_dir, name="strict", strict=True)


def test_a_template_that_is_not_prefix_stable_is_refused(tmp_path, gemma_dir):
    """A template that renders earlier replies differently once more follow (here: only the last one's content)
    cannot have its replies marked exactly."""
    from zaya.data.chat_template import NotPrefixStable

    d = tmp_path / "tok"
    d.mkdir()
    shutil.copy(gemma_dir / "tokenizer.json", d / "tokenizer.json")
    (d / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] if loop.last else '...' }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}")
    with pytest.raises(NotPrefixStable, match="chat_template.jinja: the chat template renders .* differently"):
        _prepare(tmp_path, [_jsonl(tmp_path / "c.jsonl", CHATS[1:])], d)


def test_parquet_and_save_to_disk_inputs(tmp_path, gemma_dir):
    """Parquet files and datasets' save_to_disk folders, text (a column chosen by name; an unknown one lists the
    columns) and chat ('messages'), give the documents JSON Lines would."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from zaya.data.bundle import PreparedDataset
    from zaya.data.prepare import PrepareOptions, prepare
    from zaya.data.sources import InputError

    texts = ["first document", "", "second, with é and 𝄞", None]
    pq.write_table(pa.table({"body": texts, "n": [1, 2, 3, 4]}), tmp_path / "t.parquet")
    datasets.Dataset.from_dict({"body": texts}).save_to_disk(str(tmp_path / "saved"))
    _jsonl(tmp_path / "t.jsonl", [{"body": t} for t in texts if t])

    def text_ids(source, name, column="body"):
        prepare(PrepareOptions(inputs=[str(source)], out=str(tmp_path / name), tokenizer=str(gemma_dir),
                               text_field=column, val_fraction=0.0), log=lambda m: None)
        ds = PreparedDataset(tmp_path / name)
        assert not ds.loss_mask and ds.manifest["stats"]["empty_documents"] in (0, 2)
        return [d.tolist() for d in ds.split("train").documents()]

    reference = text_ids(tmp_path / "t.jsonl", "j")
    tok = PreparedDataset(tmp_path / "j").tokenizer()
    assert reference[0] == [2] + tok.encode("first document") + [1]  # prefix_ids, text, eos
    assert text_ids(tmp_path / "t.parquet", "p") == reference == text_ids(tmp_path / "saved", "s")
    with pytest.raises(InputError, match="no column 'text'; its columns: body, n .choose one with --text-column"):
        text_ids(tmp_path / "t.parquet", "x", column="text")

    pq.write_table(pa.Table.from_pylist(CHATS), tmp_path / "c.parquet")
    datasets.Dataset.from_list(CHATS).save_to_disk(str(tmp_path / "chats"))
    chat_ids = [[(i.tolist(), m.tolist()) for i, m in _documents(_prepare(tmp_path, [src], gemma_dir, name=name)[0])]
                for src, name in ((_jsonl(tmp_path / "c.jsonl", CHATS), "cj"), (tmp_path / "c.parquet", "cp"),
                                  (tmp_path / "chats", "cs"))]
    assert chat_ids[0] == chat_ids[1] == chat_ids[2]


# --- the loader -----------------------------------------------------------------------------------------------------
def _masked_dataset(path, masks_on: bool = True):
    """Two documents of consecutive ids; the first's second half and the second's first third are targets."""
    docs = [np.arange(3, 23), np.arange(23, 53)]
    masks = [np.r_[np.zeros(10), np.ones(10)], np.r_[np.ones(10), np.zeros(20)]]
    return write_dataset(path, {"train": [docs]}, masks={"train": [masks]} if masks_on else None), docs, masks


def test_the_loader_turns_masked_positions_into_ignored_labels(tmp_path):
    """Labels are -100 where the token is no target, through packing and window cuts; the target counts are those
    of the rows (this rank) and of every rank's rows (what the loss is averaged over); a plain dataset mixed in
    keeps every label; resuming from a state gives the same batches; masked data without document masks is an
    error naming the keys."""
    from zaya.data.bundle import DatasetError
    from zaya.data.loader import DataLoader, Stage

    ds, docs, masks = _masked_dataset(tmp_path / "m")
    plain = write_dataset(tmp_path / "p", {"train": [[np.arange(100, 157)]]})
    stream = np.concatenate([np.r_[d, EOS] for d in docs])
    keep = np.concatenate([np.r_[m, m[-1]] for m in masks]).astype(bool)
    L = 8
    windows = {tuple(stream[s:s + L]): s for s in range(0, len(stream) - L, L)}
    stage = Stage("s", seq_len=L, micro_batch_size=2, weights={"m": 1.0, "p": 1.0}, tokens=0)
    with pytest.raises(DatasetError, match=r"m hold chat data.*data.document_positions = true and "
                                           r"data.document_mask = true"):
        DataLoader({"m": ds, "p": plain}, [stage], document_positions=True, prefetch=0)

    def loader(rank, world=2):
        return DataLoader({"m": ds, "p": plain}, [stage], rank=rank, world_size=world, seed=3,
                          document_positions=True, document_mask=True, prefetch=0)

    ranks = [loader(0), loader(1)]
    seen = {"m": 0, "p": 0}
    for _ in range(6):
        batches = [next(r) for r in ranks]
        assert batches[0].global_targets == batches[1].global_targets == sum(b.num_targets for b in batches)
        for batch in batches:
            assert batch.num_targets == int((batch.labels != -100).sum())
            for x, y in zip(batch.input_ids.numpy(), batch.labels.numpy()):
                if tuple(x) in windows:  # the masked dataset's: the next tokens where kept, -100 elsewhere
                    s = windows[tuple(x)]
                    assert (y == np.where(keep[s + 1:s + L + 1], stream[s + 1:s + L + 1], -100)).all()
                    seen["m"] += 1
                else:  # the plain dataset's: every label a target
                    assert (y == x + 1).all() and x[0] >= 100
                    seen["p"] += 1
    assert min(seen.values()) > 5
    state = ranks[0].state_dict()
    after = [next(ranks[0]) for _ in range(3)]
    resumed = loader(0)
    resumed.load_state_dict(state)
    for a in after:
        b = next(resumed)
        assert (a.labels == b.labels).all() and a.global_targets == b.global_targets


def test_validation_batches_ignore_masked_labels(tmp_path):
    from zaya.data.loader import validation_batches

    ds, docs, masks = _masked_dataset(tmp_path / "m")
    shutil.copytree(tmp_path / "m", tmp_path / "v")
    manifest = json.loads((tmp_path / "v" / "manifest.json").read_text())
    manifest["splits"]["val"] = manifest["splits"].pop("train")
    (tmp_path / "v" / "manifest.json").write_text(json.dumps(manifest))
    x, y, pos = next(validation_batches(str(tmp_path / "v"), 12, 1))
    assert x[0].tolist() == list(range(3, 15)) and y[0].tolist() == [-100] * 9 + [13, 14, 15]
    assert pos[0].tolist() == list(range(12))  # masked data carries document positions, as in training


def test_evaluation_of_masked_data_counts_targets_only_and_keeps_documents_apart(tmp_path):
    """zaya eval's and validation's loss on chat data: the mean over target tokens of the document-masked model's
    loss, as training computes it (a batch with no target adds nothing)."""
    import torch

    from model_helpers import tiny_model
    from zaya.data.loader import validation_batches
    from zaya.eval.perplexity import evaluate_loss

    docs = [np.arange(3, 13), np.arange(13, 33), np.arange(33, 41)]
    masks = [np.zeros(10), np.r_[np.zeros(12), np.ones(8)], np.r_[np.ones(4), np.zeros(4)]]
    ds = write_dataset(tmp_path / "v", {"val": [docs]}, masks={"val": [masks]})
    model = tiny_model().eval()
    result = evaluate_loss(model, ds, seq_len=8, batch_size=1, dtype="float32")
    loss_sum = count = 0.0
    with torch.no_grad():
        for x, y, pos in validation_batches(ds, 8, 1):
            logits = model(x, position_ids=pos, document_mask=True).logits
            keep = y != -100
            loss_sum += torch.nn.functional.cross_entropy(logits[keep].double(), y[keep], reduction="sum").item()
            count += int(keep.sum())
    assert result["tokens"] == count and 0 < count < result["batches"] * 8  # masked labels are not counted
    assert result["loss"] == pytest.approx(loss_sum / count, rel=1e-5)  # fp32 logits summed in float64


def test_masked_tokens_contribute_no_gradient(tmp_path):
    """Through bundle, loader, the real model and its loss: changing the window's last token (a target only) when
    it is masked leaves every parameter's gradient as it was; when it is a target, they change."""
    import torch

    from model_helpers import tiny_model
    from zaya.data.loader import DataLoader, Stage

    def gradients(last_id: int, last_kept: int):
        directory = tmp_path / f"d{last_id}-{last_kept}"
        doc = np.arange(3, 3 + 17)
        doc[16] = last_id
        mask = np.ones(17)
        mask[16] = last_kept
        ds = write_dataset(directory, {"train": [[doc]]}, masks={"train": [[mask]]})
        loader = DataLoader({"d": ds}, [Stage("s", 16, 1, {"d": 1.0})], document_positions=True,
                            document_mask=True, prefetch=0)
        batch = next(loader)
        model = tiny_model()
        out = model(batch.input_ids, labels=batch.labels, position_ids=batch.position_ids, document_mask=True)
        out.loss.backward()
        assert batch.num_targets == 15 + last_kept
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    same = [torch.equal(a, b) for a, b in zip(gradients(40, 0), gradients(41, 0))]
    assert all(same)
    changed = [torch.equal(a, b) for a, b in zip(gradients(40, 1), gradients(41, 1))]
    assert not all(changed)


def test_a_micro_batch_without_targets_adds_nothing_and_no_nan():
    """A rank's micro-batch whose labels are all masked (a long user turn) has a NaN mean loss; the step's
    objective for it is a zero that still runs a backward (the gradient reduction waits on every rank's)."""
    from types import SimpleNamespace

    import torch

    from model_helpers import tiny_model
    from zaya.train.step import weighted_objective

    model = tiny_model()
    x = torch.arange(3, 19).reshape(1, 16)
    labels = torch.full_like(x, -100)
    out = model(x, labels=labels)
    assert torch.isnan(out.loss)
    targets, objective = weighted_objective(out, SimpleNamespace(num_targets=0), labels, 16, 1,
                                            SimpleNamespace(cp_size=1, grad_size=1))
    objective.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert targets == 0 and objective.item() == 0 and grads and all(torch.all(g == 0) for g in grads)
    # Under context parallelism the count is a device tensor: the shard's objective is a zero with a zero gradient.
    model.zero_grad()
    out = model(x, labels=labels)
    targets, objective = weighted_objective(out, SimpleNamespace(num_targets=0), labels, 16, 1,
                                            SimpleNamespace(cp_size=2, grad_size=2))
    objective.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert int(targets) == 0 and objective.item() == 0 and grads and all(torch.all(g == 0) for g in grads)
