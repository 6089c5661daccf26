"""`meshrun prepare-data --glob FILES --out DIR (--tokenizer T | --train-bpe V)`: a thin shell over
`meshrun.data.tokenize`."""

from __future__ import annotations

import json

from meshrun.data.tokenize import prepare
from meshrun.errors import ConfigError


def register(sub) -> None:
    p = sub.add_parser("prepare-data", help="tokenize a corpus into token shards (data.kind=prepared)")
    tok = p.add_mutually_exclusive_group(required=True)
    tok.add_argument("--tokenizer", help="tokenizer.json, or a local model directory that contains one")
    tok.add_argument("--train-bpe", type=int, metavar="VOCAB", help="train a byte-level BPE of this size on the corpus")
    p.add_argument("--glob", required=True, help="input files: *.txt (one document each) or *.jsonl")
    p.add_argument("--out", required=True, help="output directory (DATA_DIR)")
    p.add_argument("--text-field", default="text", help="jsonl: the field holding the text (default: text)")
    p.add_argument("--eos", default="", help="EOS token (default: from tokenizer_config.json or a common name)")
    p.add_argument("--shard-mb", type=float, default=8.0, help="input MiB per shard (default 8)")
    p.add_argument("--workers", type=int, default=None, help="parallel processes (default: CPU count)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=run_prepare)


def run_prepare(args) -> int:
    if args.workers is not None and args.workers < 1:  # 0 is not "the default"
        raise ConfigError("--workers", args.workers, "use a positive process count (or leave it out)")
    summary = prepare(
        args.glob,
        args.out,
        tokenizer=args.tokenizer,
        train_bpe=args.train_bpe,
        text_field=args.text_field,
        eos=args.eos,
        shard_mb=args.shard_mb,
        workers=args.workers or 0,
        quiet=args.quiet,
    )
    print(json.dumps(summary))
    return 0
