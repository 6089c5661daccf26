"""prepare-data shards, the by-document validation split, packed documents (model and training parity), val_loss."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from meshrun_models import apply_layers, embed, init_params, logits
from meshrun_models.layers import arrays, segment_positions
from meshrun_models.llama.config import LlamaConfig

from meshrun.cli.main import main
from meshrun.config import DataConfig, load_config
from meshrun.data.datasets import make_dataset
from meshrun.data.prepared import Corpus
from meshrun.data.tokenize import prepare
from meshrun.errors import ConfigError

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _corpus(root, n_lines=120):
    """Two .txt documents and a .jsonl of n_lines short documents (lengths vary), made locally."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    docs = [" ".join(rng.choice(WORDS, 400)) for _ in range(2)]
    for i, d in enumerate(docs):
        (root / f"a{i}.txt").write_text(d)
    lines = [" ".join(rng.choice(WORDS, int(rng.integers(3, 30)))) for _ in range(n_lines)]
    (root / "b.jsonl").write_text("\n".join(json.dumps({"text": x, "id": i}) for i, x in enumerate(lines)) + "\n")
    return docs + lines


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    docs = _corpus(root / "in")
    out = root / "data"
    summary = prepare(str(root / "in" / "*"), str(out), train_bpe=300, shard_mb=0.001, workers=2, quiet=True)
    return docs, out, summary, root


def test_prepare_data_shards_index_manifest(prepared):
    docs, out, summary, _ = prepared
    from tokenizers import Tokenizer

    m = json.loads((out / "manifest.json").read_text())
    assert (m["vocab"], m["eos_id"], m["dtype"], m["n_docs"]) == (300, 0, "uint16", len(docs))
    assert summary["shards"] == len(m["shards"]) == 3 and summary["skipped"] == 0
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    corpus = Corpus(str(out))
    assert corpus.doc_len.sum() == m["n_tokens"] == sum(s["n_tokens"] for s in m["shards"])
    for d in (0, 1, 2, len(docs) - 1):  # every document decodes back and ends with EOS
        k, a, n = corpus.doc_shard[d], corpus.doc_start[d], corpus.doc_len[d]
        ids = np.asarray(corpus.shards[k][a : a + n])
        assert ids[-1] == 0 and 0 not in ids[:-1]
        assert tok.decode(ids[:-1].tolist()) == docs[d]


def test_prepare_data_resumes_and_redoes_a_broken_shard(prepared):
    _, out, _, root = prepared
    before = {p.name: p.read_bytes() for p in out.glob("shard_*.bin")}
    again = prepare(str(root / "in" / "*"), str(out), train_bpe=300, shard_mb=0.001, quiet=True)
    assert again["skipped"] == again["shards"] == 3
    (out / "shard_00001.json").unlink()  # as if killed before its marker was renamed into place
    (out / "shard_00001.bin").write_bytes(b"\0" * 10)
    third = prepare(str(root / "in" / "*"), str(out), train_bpe=300, shard_mb=0.001, quiet=True)
    assert third["skipped"] == 2
    assert {p.name: p.read_bytes() for p in out.glob("shard_*.bin")} == before


def test_prepare_data_errors(tmp_path, capsys):
    _corpus(tmp_path / "in", n_lines=3)
    with pytest.raises(ConfigError, match="--tokenizer.*hub ids are not downloaded"):
        prepare(str(tmp_path / "in" / "*"), str(tmp_path / "o"), tokenizer="meta-llama/Llama-3-8B", quiet=True)
    with pytest.raises(ConfigError, match="--text-field"):
        prepare(str(tmp_path / "in" / "*.jsonl"), str(tmp_path / "o"), train_bpe=300, text_field="body", quiet=True)
    prepare(str(tmp_path / "in" / "*.txt"), str(tmp_path / "t"), train_bpe=300, quiet=True)
    with pytest.raises(ConfigError, match="--text-field"):  # raised in a worker process, arrives whole
        tok = str(tmp_path / "t" / "tokenizer.json")
        prepare(str(tmp_path / "in" / "*.jsonl"), str(tmp_path / "o2"), tokenizer=tok, text_field="body", quiet=True)
    code = main(["prepare-data", "--glob", str(tmp_path / "none*"), "--out", str(tmp_path / "o"), "--train-bpe", "300"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--glob" in err[0] and "matches no files" in err[0]


def test_split_by_document_and_packed_rows(prepared):
    _, out, _, _ = prepared
    corpus = Corpus(str(out))
    train_docs, val_docs = corpus.split(0.2)
    assert len(val_docs) and not set(train_docs) & set(val_docs)
    assert len(train_docs) + len(val_docs) == len(corpus.doc_len)
    dcfg = DataConfig(kind="prepared", path=str(out), val_fraction=0.2, pack_documents=True, seed=3)
    ds = make_dataset(dcfg, vocab=300, seq_len=32, global_batch=8)
    tok, lab, seg = ds.batch(5)
    assert seg.max() > 0  # rows cross document boundaries
    ends = seg[:, 1:] != seg[:, :-1]
    assert (tok[:, :-1][ends] == 0).all()  # a segment ends with EOS ...
    assert (lab[:, :-1][ends] == -1).all() and (lab[:, :-1][~ends] >= 0).all()  # ... whose label is ignored
    np.testing.assert_array_equal(ds.batch(5, slice(2, 5))[2], seg[2:5])  # rows are a function of (seed, step, row)
    vt, _, vs = ds.val.batch(0)
    val_ids = {
        tuple(corpus.shards[corpus.doc_shard[d]][corpus.doc_start[d] : corpus.doc_start[d] + 4]) for d in val_docs
    }
    starts = [tuple(r[s == s[-1]][:4]) for r, s in zip(vt, vs) if (s == s[-1]).sum() >= 4 and s[-1] > 0]
    assert starts and all(x in val_ids for x in starts)  # whole documents inside validation rows are validation docs
    with pytest.raises(ConfigError, match="data.kind"):
        DataConfig(kind="text", pack_documents=True)


def test_packed_row_equals_the_documents_run_separately():
    """Packed [A EOS | B EOS] gives, position by position, the logits and token losses of A and of B run
    alone (block-diagonal attention, positions restarting at B); without segment ids B sees A."""
    cfg = LlamaConfig(vocab=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, max_seq_len=16)
    params = arrays(init_params(cfg, 0)[1])
    rng = np.random.default_rng(0)
    a, b = np.append(rng.integers(1, 64, 6), 0), np.append(rng.integers(1, 64, 8), 0)
    row, seg = np.concatenate([a, b])[None], np.array([[0] * 7 + [1] * 9])
    assert segment_positions(jnp.asarray(seg)).tolist() == [list(range(7)) + list(range(9))]

    @jax.jit
    def token_losses(tok, lab, seg):
        x, _ = apply_layers(params["layers"], embed(params, tok, cfg), cfg, seg)
        lg = logits(params, x, cfg)
        ce = -jnp.take_along_axis(jax.nn.log_softmax(lg), jnp.maximum(lab, 0)[..., None], -1)[..., 0]
        return lg, jnp.where(lab >= 0, ce, 0.0)

    lab = np.concatenate([a[1:], [-1], b[1:], [5]])[None]
    lg, ce = token_losses(row, lab, seg)

    def alone(d, nxt):  # one document at the start of a row (padding after it: causal, so unseen); one compile
        pad = 16 - len(d)
        tok, lb = np.pad(d, (0, pad)), np.pad(np.append(d[1:], nxt), (0, pad), constant_values=-1)
        return token_losses(tok[None], lb[None], np.zeros((1, 16), int))

    (lg_a, ce_a), (lg_b, ce_b) = alone(a, 0), alone(b, 5)
    np.testing.assert_allclose(lg[0, :7], lg_a[0, :7], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lg[0, 7:], lg_b[0, :9], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ce[0, :6], ce_a[0, :6], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ce[0, 7:], ce_b[0, :9], rtol=1e-5, atol=1e-6)
    assert ce[0, 6] == 0  # the EOS -> next-document label is ignored
    plain, _ = token_losses(row, lab, np.zeros_like(seg))
    assert np.abs(plain[0, 7:] - lg_b[0, :9]).max() > 1e-3  # the test can fail: without packing B attends to A


SMALL = [
    "model.vocab=300",
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.head_dim=8",
    "model.d_ff=64",
    "model.max_seq_len=32",
    "train.seq_len=32",
    "train.global_batch=8",
    "pipeline.microbatches=2",
    "train.steps=3",
    "optimizer.lr=0.01",
    "optimizer.warmup_steps=1",
    "optimizer.eps=1e-4",
    "data.kind=prepared",
    "data.pack_documents=true",
    "data.val_fraction=0.2",
    "train.eval_every=2",
    "train.eval_batches=2",
    "checkpoint.async_save=false",
]


def _train(tmp_path, name, out, over, n_devices):
    from meshrun.train.loop import run

    cfg = load_config("configs/tiny_cpu.yaml", [*SMALL, f"data.path={out}", f"train.run_dir={tmp_path / name}", *over])
    res = run(cfg, devices=jax.devices()[:n_devices], quiet=True)
    rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return res, rows


@pytest.mark.slow
def test_packed_training_with_val_loss_pipeline_matches_one_device(prepared, tmp_path):
    """prepare-data -> train with packed documents and val_loss: pipe2 x data2 x tensor2 (the pipeline
    executor; 1F1B, and zb-h1 for the loss) equals one device (the microbatch scan) in loss per step
    and val_loss per evaluation."""
    _, out, _, _ = prepared
    one, rows1 = _train(tmp_path, "one", out, ["mesh.data=1", "mesh.pipe=1", "mesh.tensor=1"], 1)
    par, rows8 = _train(tmp_path, "par", out, [], 8)
    _, rows_zb = _train(tmp_path, "zb", out, ["pipeline.schedule=zb-h1"], 8)  # segment ids through B/W split
    assert [r["step"] for r in rows1 if "val_loss" in r] == [2, 3]
    for r1, rz in zip(rows1, rows_zb, strict=True):
        np.testing.assert_allclose(rz["loss"], r1["loss"], rtol=1e-5)
    for r1, r8 in zip(rows1, rows8, strict=True):
        np.testing.assert_allclose(r8["loss"], r1["loss"], rtol=1e-5)
        if "val_loss" in r1:
            np.testing.assert_allclose(r8["val_loss"], r1["val_loss"], rtol=1e-5)
            assert r1["val_perplexity"] == pytest.approx(np.exp(r1["val_loss"]))
            assert 0 < r1["val_tokens"] < 2 * 8 * 32  # the ignored label after each EOS is not scored
    assert one["val_loss"] == rows1[-1]["val_loss"] and par["step"] == 3
