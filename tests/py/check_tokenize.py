"""Check a `tokenize` artifact against Python: the reference side of tests/data.rs.

Usage: python check_tokenize.py TOKENIZER_JSON DATA_DIR CORPUS_JSONL EOS_TOKEN

Reads every shard of DATA_DIR's blend.json the way megatron-core's IndexedDataset does
(header, then sequence lengths, pointers and document indices as numpy arrays, tokens
memory-mapped from .bin), and checks that the documents, in order, are exactly what Python's
`tokenizers` produces for the corpus: encode(text, add_special_tokens=False).ids + [eos].
Prints one line `ok <documents> <tokens>` or raises.
"""

import json
import struct
import sys
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}


def read_indexed(prefix: Path):
    with open(f"{prefix}.idx", "rb") as f:
        assert f.read(9) == b"MMIDIDX\x00\x00", "bad magic"
        (version,) = struct.unpack("<Q", f.read(8))
        assert version == 1
        (code,) = struct.unpack("<B", f.read(1))
        (n_seq,) = struct.unpack("<Q", f.read(8))
        (n_doc,) = struct.unpack("<Q", f.read(8))
        offset = f.tell()
    buf = memoryview(np.memmap(f"{prefix}.idx", mode="r", order="C"))
    lengths = np.frombuffer(buf, dtype=np.int32, count=n_seq, offset=offset)
    pointers = np.frombuffer(buf, dtype=np.int64, count=n_seq, offset=offset + lengths.nbytes)
    doc_idx = np.frombuffer(buf, dtype=np.int64, count=n_doc, offset=offset + lengths.nbytes + pointers.nbytes)
    dtype = DTYPES[code]
    tokens = np.memmap(f"{prefix}.bin", mode="r", order="C", dtype=dtype)
    itemsize = np.dtype(dtype).itemsize
    assert doc_idx[0] == 0 and doc_idx[-1] == n_seq
    return [tokens[p // itemsize : p // itemsize + n].tolist() for p, n in zip(pointers, lengths)]


def main() -> None:
    tok_path, data_dir, corpus, eos = sys.argv[1:5]
    tok = Tokenizer.from_file(tok_path)
    eos_id = tok.token_to_id(eos)
    texts = [json.loads(line)["text"] for line in open(corpus, encoding="utf-8") if line.strip()]
    expected = [tok.encode(t, add_special_tokens=False).ids + [eos_id] for t in texts]
    blend = json.loads((Path(data_dir) / "blend.json").read_text())
    prefixes = sorted({p for split in blend.values() for p in split[1::2]})
    got = []
    for p in prefixes:
        got.extend(read_indexed(Path(data_dir) / p))
    if len(prefixes) == 1:
        assert got == expected, "token ids differ from Python tokenizers"
    else:
        # Shards hold disjoint sets of rows: compare the documents as multisets.
        assert sorted(got) == sorted(expected), "token ids differ from Python tokenizers"
    print("ok", len(got), sum(len(d) for d in got))


if __name__ == "__main__":
    main()
