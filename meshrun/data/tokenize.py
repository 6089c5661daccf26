"""`meshrun prepare-data`: tokenize a corpus into token shards that `data.kind=prepared` trains on.

    meshrun prepare-data --tokenizer MODEL_DIR_OR_tokenizer.json --glob 'corpus/**/*.txt' --out DATA_DIR
    meshrun prepare-data --train-bpe 8192 --glob 'corpus/**/*.jsonl' --out DATA_DIR   # offline BPE

A .txt file is one document; a .jsonl file one document per line (field `--text-field`). Each
document is tokenized with Hugging Face `tokenizers` and followed by the EOS id. The sorted file list
is cut into shards of about `--shard-mb` MiB, tokenized in parallel (`--workers` processes).

DATA_DIR holds `tokenizer.json`, per shard `shard_NNNNN.bin` (flat uint16 ids; uint32 for a vocabulary
over 65536), `.idx` (uint64 end offset of each document) and `.json` (its commit marker, written last),
and `manifest.json` (tokenizer sha256, vocab, eos id, dtype, totals, the shards in order). Files are
written to a temporary name and renamed, so a rerun skips the shards whose marker matches and redoes
an interrupted one. Reads local files only (never the network).
"""

from __future__ import annotations

import glob as globlib
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from meshrun.errors import ConfigError, DataError

FORMAT = "meshrun-tokens-1"
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>")
BPE_EOS = "<|endoftext|>"  # id 0 of a tokenizer trained by --train-bpe
BPE_SAMPLE_BYTES = 256 << 20  # --train-bpe learns merges from the first 256 MiB of documents
ENCODE_BATCH = 256  # documents per encode_batch call


# ---------------------------------------------------------------- inputs


def list_files(pattern: str) -> list[Path]:
    files = sorted(Path(p) for p in globlib.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
    if not files:
        raise ConfigError("--glob", pattern, "give a glob that matches .txt or .jsonl files", "matches no files")
    return files


def _decode(raw: bytes, stats: dict | None) -> str:
    """UTF-8 text; invalid bytes become U+FFFD and are counted in stats["invalid_utf8_bytes"]."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        if stats is not None:
            stats["invalid_utf8_bytes"] = (
                stats.get("invalid_utf8_bytes", 0) + len(raw) - len(raw.decode("utf-8", errors="ignore").encode())
            )
        return raw.decode("utf-8", errors="replace")


def documents(path: Path, text_field: str, stats: dict | None = None):
    """The documents of one file: the whole .txt file, or each line of a .jsonl file (`stats`: counts
    of what was repaired, see `_decode`)."""
    if path.suffix != ".jsonl":
        yield _decode(path.read_bytes(), stats)
        return
    with path.open("rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(_decode(line, stats))
            except json.JSONDecodeError as e:
                raise DataError(f"--glob: {path}:{n} is not JSON ({e.msg}); fix or remove that line") from e
            text = row.get(text_field) if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise ConfigError(
                    "--text-field",
                    text_field,
                    f"name the field that holds the text in {path}:{n}",
                    "no such string field",
                )
            yield text


def plan_shards(files: list[Path], shard_bytes: int) -> list[list[Path]]:
    """Consecutive files grouped into shards of about `shard_bytes` input bytes (deterministic)."""
    shards, cur, size = [], [], 0
    for f in files:
        cur.append(f)
        size += f.stat().st_size
        if size >= shard_bytes:
            shards.append(cur)
            cur, size = [], 0
    return shards + ([cur] if cur else [])


def files_hash(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


# ---------------------------------------------------------------- tokenizer


def load_tokenizer(spec: str):
    """A `tokenizers.Tokenizer` from a tokenizer.json file or a local directory holding one."""
    p = Path(os.path.expanduser(spec))
    path = p / "tokenizer.json" if p.is_dir() else p
    if not path.is_file():
        why = "no tokenizer.json in that directory" if p.is_dir() else "no such file or directory"
        raise ConfigError(
            "--tokenizer",
            spec,
            "give a local tokenizer.json or a model directory holding one (hub ids are not "
            "downloaded: fetch the model first), or use --train-bpe VOCAB",
            why,
        )
    try:
        return Tokenizer.from_file(str(path)), path
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own Exception for any bad file
        why = " ".join(str(e).split())[:160]
        raise ConfigError(
            "--tokenizer", spec, "give a Hugging Face tokenizer.json", f"not a tokenizer.json ({why})"
        ) from None


def find_eos(tok, tok_path: Path | None, eos: str) -> tuple[str, int]:
    """EOS token and id: --eos, else tokenizer_config.json's eos_token, else a common name."""
    names = [eos] if eos else []
    cfg = tok_path.parent / "tokenizer_config.json" if tok_path is not None else None
    if not eos and cfg is not None and cfg.is_file():
        val = json.loads(cfg.read_text()).get("eos_token")
        val = val.get("content") if isinstance(val, dict) else val
        names += [val] if isinstance(val, str) else []
    names += [] if eos else list(EOS_CANDIDATES)
    for name in names:
        i = tok.token_to_id(name)
        if i is not None:
            return name, int(i)
    raise ConfigError(
        "--eos",
        eos or None,
        "name the tokenizer's end-of-document token with --eos TOKEN",
        "the tokenizer has no such token" if eos else "no EOS token found",
    )


def train_bpe(files: list[Path], vocab: int, text_field: str):
    """Byte-level BPE (GPT-2 style) trained on the first BPE_SAMPLE_BYTES of the corpus; EOS is id 0."""
    if vocab < 257:
        raise ConfigError("--train-bpe", vocab, "use a vocabulary of at least 257 (256 bytes + EOS)")

    def sample():
        seen = 0
        for f in files:
            for doc in documents(f, text_field):
                yield doc
                seen += len(doc)
                if seen >= BPE_SAMPLE_BYTES:
                    return

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[BPE_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(sample(), trainer)
    return tok


# ---------------------------------------------------------------- shards


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def shard_done(out: Path, k: int, meta: dict) -> dict | None:
    """The shard's marker when it is complete and was made from the same files and tokenizer."""
    marker = out / f"shard_{k:05d}.json"
    if not marker.is_file():
        return None
    try:
        got = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    same = all(got.get(key) == meta[key] for key in ("files_sha256", "tokenizer_sha256"))
    size = (out / got.get("bin", "")).stat().st_size if (out / got.get("bin", "-")).is_file() else -1
    return got if same and size == got.get("n_tokens", -2) * np.dtype(got.get("dtype", "uint8")).itemsize else None


def tokenize_shard(
    out: str, k: int, files: list[str], tok_json: str, eos_id: int, dtype: str, meta: dict, text_field: str
) -> dict:
    """Worker: tokenize one shard's files, write .bin/.idx/.json (temp + rename, marker last)."""
    tok = Tokenizer.from_str(tok_json)
    out_p, parts, ends, total, stats = Path(out), [], [], 0, {"invalid_utf8_bytes": 0}
    eos = np.array([eos_id], dtype)

    def flush(batch):
        nonlocal total
        for enc in tok.encode_batch(batch, add_special_tokens=False):
            ids = np.asarray(enc.ids, dtype)
            parts.extend((ids, eos))
            total += len(ids) + 1
            ends.append(total)

    for f in files:
        batch = []
        for doc in documents(Path(f), text_field, stats):
            batch.append(doc)
            if len(batch) == ENCODE_BATCH:
                flush(batch)
                batch = []
        if batch:
            flush(batch)
    name = f"shard_{k:05d}"
    _atomic_write(out_p / f"{name}.bin", np.concatenate(parts).astype(dtype).tobytes() if parts else b"")
    _atomic_write(out_p / f"{name}.idx", np.asarray(ends, np.uint64).tobytes())
    marker = {
        **meta,
        "bin": f"{name}.bin",
        "idx": f"{name}.idx",
        "dtype": dtype,
        "n_tokens": total,
        "n_docs": len(ends),
        "files": len(files),
        "invalid_utf8_bytes": stats["invalid_utf8_bytes"],
    }
    _atomic_write(out_p / f"{name}.json", json.dumps(marker).encode())
    return marker


def prepare(
    pattern: str,
    out: str,
    *,
    tokenizer: str | None = None,
    train_bpe: int | None = None,
    text_field: str = "text",
    eos: str = "",
    shard_mb: float = 8.0,
    workers: int = 0,
    quiet: bool = False,
    files: list[Path] | None = None,
) -> dict:
    """Tokenize the files matching `pattern` into shards in `out` (see the module docstring);
    returns the summary that is also in manifest.json, plus this run's timing."""
    t0 = time.perf_counter()
    _check_sizes(shard_mb, workers, train_bpe)
    files = list_files(pattern) if files is None else files  # `files`: an explicit list instead of the glob
    if tokenizer:  # bad arguments are refused before --out is created
        find_eos(*load_tokenizer(tokenizer), eos)
    out_p = _out_dir(out)
    tok, tok_path = _tokenizer_for(out_p, tokenizer, train_bpe, files, text_field, quiet)
    eos_name, eos_id = find_eos(tok, tok_path, eos)
    tok_json, tok_sha, vocab, dtype = _tokenizer_facts(out_p, tok)
    shards = plan_shards(files, int(shard_mb * (1 << 20)))
    done, shard_args = _pending_shards(out_p, shards, tok_json, tok_sha, eos_id, dtype, text_field)
    _say(
        quiet,
        f"{len(files)} files in {len(shards)} shards, {len(done)} already done; vocab {vocab}, "
        f"eos {eos_name!r}={eos_id}, {dtype}",
    )
    new_tokens = _tokenize_shards(out_p, shard_args, done, len(shards), workers, quiet, t0)
    order = [done[k] for k in range(len(shards))]
    manifest = _manifest(order, tok_sha, train_bpe, vocab, eos_name, eos_id, dtype, len(files))
    _atomic_write(out_p / "manifest.json", json.dumps(manifest, indent=1).encode())
    return _summary(manifest, out_p, len(shards), len(shard_args), new_tokens, time.perf_counter() - t0)


def _tokenizer_facts(out_p: Path, tok) -> tuple[str, str, int, str]:
    """(out's tokenizer.json text, its sha256, the vocabulary size with added tokens, the shards' token
    dtype: uint16 where the vocabulary fits, else uint32)."""
    tok_json = (out_p / "tokenizer.json").read_text()
    tok_sha = hashlib.sha256(tok_json.encode()).hexdigest()
    vocab = tok.get_vocab_size(with_added_tokens=True)
    return tok_json, tok_sha, vocab, "uint16" if vocab <= 1 << 16 else "uint32"


def _pending_shards(
    out_p: Path, shards: list[list[Path]], tok_json: str, tok_sha: str, eos_id: int, dtype: str, text_field: str
) -> tuple[dict[int, dict], dict[int, tuple]]:
    """({shard index: its marker} of the shards an earlier run finished with these files and this
    tokenizer, {shard index: `_tokenize_shards`' arguments} of the rest)."""
    metas = [{"files_sha256": files_hash(s), "tokenizer_sha256": tok_sha} for s in shards]
    done = {k: m for k in range(len(shards)) if (m := shard_done(out_p, k, metas[k])) is not None}
    todo = [k for k in range(len(shards)) if k not in done]
    return done, {k: ([str(f) for f in shards[k]], tok_json, eos_id, dtype, metas[k], text_field) for k in todo}


def _summary(manifest: dict, out_p: Path, n_shards: int, n_todo: int, new_tokens: int, dt: float) -> dict:
    """`prepare`'s answer: the manifest's totals, plus this run's shards skipped and timing (`dt`
    seconds for `new_tokens` tokenized in the `n_todo` shards it wrote)."""
    return {k: manifest[k] for k in ("vocab", "eos_id", "dtype", "n_docs", "n_tokens", "invalid_utf8_bytes")} | {
        "out": str(out_p),
        "shards": n_shards,
        "skipped": n_shards - n_todo,
        "seconds": round(dt, 3),
        "tokens_per_s": round(new_tokens / dt, 1),
    }


def _out_dir(out: str) -> Path:
    """--out, created if new (a file there is a ConfigError)."""
    out_p = Path(out)
    if out_p.exists() and not out_p.is_dir():
        raise ConfigError("--out", out, "give a directory (new, or one prepare-data wrote)", "not a directory")
    out_p.mkdir(parents=True, exist_ok=True)
    return out_p


def _check_sizes(shard_mb: float, workers: int | None, train_bpe: int | None) -> None:
    """--shard-mb, --workers and --train-bpe in their ranges."""
    if not 0 < shard_mb <= 1 << 20:
        raise ConfigError("--shard-mb", shard_mb, "use a positive size in MiB (at most 1 TiB)")
    if workers is not None and not 0 <= workers <= 1024:
        raise ConfigError("--workers", workers, "use 1..1024 processes (or leave it out: the CPU count)")
    if train_bpe is not None and not 257 <= train_bpe <= 1 << 24:
        raise ConfigError(
            "--train-bpe", train_bpe, "use a vocabulary size in 257..16777216 (256 bytes + EOS), e.g. 32000"
        )


def _manifest(
    order: list[dict], tok_sha: str, train_bpe, vocab: int, eos_name: str, eos_id: int, dtype: str, n_files: int
) -> dict:
    """manifest.json of the shards' markers `order` (warns about invalid UTF-8 on stderr)."""
    manifest = {
        "format": FORMAT,
        "tokenizer": "tokenizer.json",
        "tokenizer_sha256": tok_sha,
        "train_bpe": train_bpe,
        "vocab": vocab,
        "eos": eos_name,
        "eos_id": eos_id,
        "dtype": dtype,
        "n_docs": sum(m["n_docs"] for m in order),
        "n_tokens": sum(m["n_tokens"] for m in order),
        "n_files": n_files,
        "shards": [{k: m[k] for k in ("bin", "idx", "n_tokens", "n_docs")} for m in order],
        "invalid_utf8_bytes": sum(m.get("invalid_utf8_bytes", 0) for m in order),
    }
    if manifest["invalid_utf8_bytes"]:
        print(
            f"meshrun: warning: {manifest['invalid_utf8_bytes']} bytes of the corpus are not valid UTF-8; "
            "they were replaced by U+FFFD (manifest.json: invalid_utf8_bytes)",
            file=sys.stderr,
        )
    return manifest


def _tokenizer_for(out_p: Path, tokenizer, train_bpe, files, text_field, quiet):
    """(tokenizer, its source file or None) for `prepare`, saved as OUT/tokenizer.json: copied from
    `tokenizer`, else the BPE an earlier run trained with the same `train_bpe`, else trained now."""
    tok_dst = out_p / "tokenizer.json"
    source = out_p / "tokenizer_source.json"  # what made tokenizer.json (a rerun reuses a trained one)
    if tokenizer:
        tok, tok_path = load_tokenizer(tokenizer)
        if tok_path.resolve() != tok_dst.resolve():
            shutil.copyfile(tok_path, tok_dst)
        _atomic_write(source, json.dumps({"tokenizer": str(tokenizer)}).encode())
        return tok, tok_path
    if tok_dst.is_file() and source.is_file() and json.loads(source.read_text()).get("train_bpe") == train_bpe:
        _say(quiet, f"reusing the BPE tokenizer trained by an earlier run ({tok_dst})")
        return load_tokenizer(str(tok_dst))[0], None
    tok = train_bpe_logged(files, train_bpe, text_field, quiet)
    _atomic_write(tok_dst, tok.to_str().encode())
    _atomic_write(source, json.dumps({"train_bpe": train_bpe}).encode())
    return tok, None


def _tokenize_shards(out_p: Path, shard_args: dict, done: dict, n_shards: int, workers, quiet, t0) -> int:
    """Run `tokenize_shard(out, k, *shard_args[k])` for every k in parallel processes, adding each
    shard's marker to `done` as it finishes; returns the number of tokens written."""
    if not shard_args:
        return 0
    new_tokens = 0
    n = min(workers or os.cpu_count() or 1, len(shard_args))
    # spawn, not fork: the parent may hold JAX's and the tokenizer's threads, and a forked child
    # of a multithreaded process can deadlock
    with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as pool:
        futs = {pool.submit(tokenize_shard, str(out_p), k, *args): k for k, args in shard_args.items()}
        for fut in as_completed(futs):
            done[futs[fut]] = m = fut.result()
            new_tokens += m["n_tokens"]
            rate = new_tokens / (time.perf_counter() - t0)
            _say(
                quiet,
                f"[{len(done)}/{n_shards}] shard {futs[fut]:05d}: {m['n_docs']} docs, "
                f"{m['n_tokens']} tokens ({rate:,.0f} tok/s)",
            )
    return new_tokens


def train_bpe_logged(files, vocab, text_field, quiet):
    t = time.perf_counter()
    tok = train_bpe(files, vocab, text_field)
    _say(quiet, f"trained a byte-level BPE of {tok.get_vocab_size()} tokens in {time.perf_counter() - t:.1f} s")
    return tok


def _say(quiet: bool, msg: str) -> None:
    if not quiet:
        print(f"prepare-data: {msg}", file=sys.stderr, flush=True)
