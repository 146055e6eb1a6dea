"""prepare_dataset / resolve_dataset_dir: shards, manifest, determinism, errors, atomicity."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sysconfig
import zlib
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

import scaletrain.data.prepare as prep
from scaletrain.config import DataConfig
from scaletrain.data import default_corpus_files, ensure_prepared, prepare_dataset, resolve_dataset_dir
from scaletrain.errors import UserError

pytestmark = pytest.mark.unit

# Small, stable stdlib modules: real source text without shipping a fixture corpus.
_SOURCES = ("bisect.py", "colorsys.py", "heapq.py", "keyword.py", "fnmatch.py", "textwrap.py")
VOCAB = 400
SHARD = 4096


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _stream(d: Path) -> np.ndarray:
    """All shard tokens of a prepared directory, in manifest order."""
    m = json.loads((d / "manifest.json").read_text())
    return np.concatenate([np.fromfile(d / s["file"], dtype=m["dtype"]) for s in m["shards"]]).astype(np.int64)


def _expected_stream(tok: Tokenizer, docs: list[str], eos: int) -> np.ndarray:
    ids: list[int] = []
    for doc in docs:
        ids += tok.encode(doc, add_special_tokens=False).ids + [eos]
    return np.array(ids, dtype=np.int64)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in _SOURCES:
        shutil.copyfile(stdlib / name, d / (Path(name).stem + ".txt"))
    return d


@pytest.fixture(scope="session")
def prepared(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "ds"
    return prepare_dataset([str(corpus / "*.txt")], out, vocab_size=VOCAB, shard_tokens=SHARD, show_progress=False)


def _manifest(d: Path) -> dict:
    return json.loads((d / "manifest.json").read_text())


def test_manifest_matches_shards(prepared, corpus):
    m = _manifest(prepared)
    assert m["format"] == prep.FORMAT and m["version"] == prep.FORMAT_VERSION
    tok = Tokenizer.from_file(str(prepared / m["tokenizer"]))
    assert m["tokenizer_sha256"] == _sha(prepared / m["tokenizer"])
    assert m["vocab_size"] == tok.get_vocab_size() <= VOCAB
    assert m["eos_id"] == tok.token_to_id("<|endoftext|>")
    assert m["dtype"] == "uint16"
    assert m["documents"] == len(_SOURCES) and m["files"] == len(_SOURCES)
    assert m["inputs"] == [str(corpus / "*.txt")] and m["text_field"] == "text"
    assert len(m["shards"]) >= 3, "small shards must give several of them"
    for i, s in enumerate(m["shards"]):
        f = prepared / s["file"]
        assert s["file"] == f"shard_{i:05d}.bin"
        assert f.stat().st_size == s["tokens"] * 2
        assert _sha(f) == s["sha256"]
        # Documents are split across boundaries, so every shard but the last is full.
        assert s["tokens"] == SHARD or i == len(m["shards"]) - 1
        # Each block's CRC-32 beside it (the ranges a reader of object storage checks).
        raw, sums = f.read_bytes(), np.fromfile(prepared / s["blocks"], dtype="<u4")
        block = m["block_bytes"]
        assert s["blocks"] == f"shard_{i:05d}.crc32" and len(sums) == -(-len(raw) // block)
        assert [zlib.crc32(raw[k * block : (k + 1) * block]) for k in range(len(sums))] == sums.tolist()
    assert sum(s["tokens"] for s in m["shards"]) == m["total_tokens"]
    assert sorted(p.name for p in prepared.iterdir()) == sorted(
        ["manifest.json", "tokenizer.json", *(n for s in m["shards"] for n in (s["file"], s["blocks"]))]
    )


def test_tokens_equal_reencoding(prepared, corpus):
    m = _manifest(prepared)
    tok = Tokenizer.from_file(str(prepared / "tokenizer.json"))
    docs = [p.read_text() for p in sorted(corpus.glob("*.txt"))]
    stream = _stream(prepared)
    assert len(stream) == m["total_tokens"]
    np.testing.assert_array_equal(stream, _expected_stream(tok, docs, m["eos_id"]))
    assert int((stream == m["eos_id"]).sum()) == len(docs)
    # Byte-level BPE is lossless: the first document decodes back to its exact text.
    first = stream[: int(np.argmax(stream == m["eos_id"]))]
    assert tok.decode(first.tolist()) == docs[0]


def test_deterministic(corpus, prepared, tmp_path):
    again = prepare_dataset([str(corpus / "*.txt")], tmp_path / "again", vocab_size=VOCAB, shard_tokens=SHARD, show_progress=True)
    assert (again / "tokenizer.json").read_bytes() == (prepared / "tokenizer.json").read_bytes()
    a, b = _manifest(prepared), _manifest(again)
    assert [s["sha256"] for s in a["shards"]] == [s["sha256"] for s in b["shards"]]
    for s in a["shards"]:
        assert (prepared / s["file"]).read_bytes() == (again / s["file"]).read_bytes()


def test_jsonl_input_with_given_tokenizer(prepared, tmp_path):
    texts = ["hello world\n", "def f(x):\n    return x * 2\n", "", "ünïcödé ✓"]
    f = tmp_path / "docs.jsonl"
    with f.open("w") as fh:
        for i, t in enumerate(texts):
            fh.write(json.dumps({"id": i, "body": t}) + "\n")
        fh.write("\n")  # blank lines are skipped
    out = prepare_dataset(
        [str(f)], tmp_path / "out", tokenizer=str(prepared / "tokenizer.json"), text_field="body", show_progress=False
    )
    m = _manifest(out)
    assert m["tokenizer_sha256"] == _sha(prepared / "tokenizer.json")  # copied verbatim
    assert m["documents"] == 3 and m["text_field"] == "body"  # the empty text is no document
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    np.testing.assert_array_equal(_stream(out), _expected_stream(tok, [t for t in texts if t], m["eos_id"]))


def test_parquet_input(prepared, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"row {i}: " + "lorem ipsum " * (i % 7) for i in range(3000)]
    texts[5] = None  # nulls are not documents
    f = tmp_path / "sub" / "part.parquet"
    f.parent.mkdir()
    pq.write_table(pa.table({"content": texts, "n": list(range(3000))}), f, row_group_size=700)
    out = prepare_dataset(
        [str(tmp_path / "**" / "*.parquet")],
        tmp_path / "out",
        tokenizer=str(prepared / "tokenizer.json"),
        text_field="content",
        show_progress=False,
    )
    m = _manifest(out)
    kept = [t for t in texts if t]
    assert m["documents"] == len(kept)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    np.testing.assert_array_equal(_stream(out), _expected_stream(tok, kept, m["eos_id"]))


def test_input_errors(tmp_path, prepared):
    missing = str(tmp_path / "nothing" / "*.txt")
    with pytest.raises(UserError, match="matches no file") as e:
        prepare_dataset([missing], tmp_path / "o1", show_progress=False)
    assert missing in str(e.value) and ".jsonl" in str(e.value)

    (tmp_path / "table.csv").write_text("a,b\n")
    with pytest.raises(UserError, match=r"table\.csv.*unsupported.*accepted: .*\.parquet"):
        prepare_dataset([str(tmp_path / "*.csv")], tmp_path / "o2", show_progress=False)

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    with pytest.raises(UserError, match=r"bad\.jsonl:2: record has no field 'text' \(it has: body\).*text_field"):
        prepare_dataset([str(bad)], tmp_path / "o3", tokenizer=str(prepared / "tokenizer.json"), show_progress=False)

    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    with pytest.raises(UserError, match=r"broken\.jsonl:1: not valid JSON"):
        prepare_dataset([str(broken)], tmp_path / "o4", tokenizer=str(prepared / "tokenizer.json"), show_progress=False)

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "p.parquet")
    with pytest.raises(UserError, match=r"no column 'text' \(columns: body\)"):
        prepare_dataset(
            [str(tmp_path / "p.parquet")], tmp_path / "o5", tokenizer=str(prepared / "tokenizer.json"), show_progress=False
        )

    with pytest.raises(UserError, match="not found"):
        prepare_dataset([str(bad)], tmp_path / "o6", tokenizer=str(tmp_path / "nope.json"), show_progress=False)
    for i in range(1, 7):
        assert not (tmp_path / f"o{i}").exists()


def _leftovers(parent: Path, name: str) -> list[Path]:
    return [p for p in parent.iterdir() if p.name.startswith(f".{name}.tmp-")]


def test_atomic_when_a_late_file_is_invalid(corpus, prepared, tmp_path):
    late = tmp_path / "zz_late.jsonl"
    late.write_text("".join(json.dumps({"text": f"doc {i} " * 50}) + "\n" for i in range(200)) + '{"other": 1}\n')
    out = tmp_path / "out"
    with pytest.raises(UserError, match=r"zz_late\.jsonl:201"):
        # Small shards: several are complete in the temp directory when the bad record is hit.
        prepare_dataset(
            [str(corpus / "*.txt"), str(late)],
            out,
            tokenizer=str(prepared / "tokenizer.json"),
            shard_tokens=256,
            show_progress=False,
        )
    assert not out.exists()
    assert _leftovers(tmp_path, "out") == []


def test_atomic_when_interrupted(corpus, tmp_path, monkeypatch):
    finished = []
    original = prep._ShardWriter._finish

    def finish_then_die(self):
        original(self)
        finished.append(self.shards[-1]["file"])
        if len(finished) == 2:
            raise KeyboardInterrupt  # stands in for Ctrl-C in the middle of writing shards

    monkeypatch.setattr(prep._ShardWriter, "_finish", finish_then_die)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset([str(corpus / "*.txt")], out, vocab_size=300, shard_tokens=1000, show_progress=False)
    assert len(finished) == 2
    assert not out.exists() and _leftovers(tmp_path, "out") == []


def test_refuses_existing_dataset_accepts_empty_dir(corpus, prepared, tmp_path):
    with pytest.raises(UserError, match="already holds a prepared dataset"):
        prepare_dataset([str(corpus / "*.txt")], prepared, vocab_size=VOCAB, show_progress=False)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("keep me")
    with pytest.raises(UserError, match="not an empty directory"):
        prepare_dataset([str(corpus / "*.txt")], busy, vocab_size=VOCAB, show_progress=False)
    assert (busy / "x").read_text() == "keep me"
    empty = tmp_path / "empty"
    empty.mkdir()
    tok = str(prepared / "tokenizer.json")
    prepare_dataset([str(corpus / "keyword.txt")], empty, tokenizer=tok, show_progress=False)
    assert _manifest(empty)["documents"] == 1


def test_resolve_dataset_dir(corpus, prepared, tmp_path):
    assert resolve_dataset_dir(DataConfig(paths=str(prepared))) == (prepared, None)

    glob_ = str(corpus / "*.txt")
    cfg = DataConfig(paths=[glob_], dir=str(tmp_path / "cache"), vocab_size=300)
    d, inputs = resolve_dataset_dir(cfg)
    assert inputs == [glob_]
    assert d.parent == tmp_path / "cache" and d.name.startswith(corpus.name + "-")
    assert resolve_dataset_dir(cfg)[0] == d  # stable for an unchanged config and files
    assert resolve_dataset_dir(cfg.model_copy(update={"vocab_size": 301}))[0] != d
    assert resolve_dataset_dir(cfg.model_copy(update={"text_field": "body"}))[0] != d
    assert resolve_dataset_dir(cfg.model_copy(update={"seq_len": 64}))[0] == d  # windows are the loader's business

    scratch = tmp_path / "scratch"
    shutil.copytree(corpus, scratch)
    cfg2 = cfg.model_copy(update={"paths": [str(scratch / "*.txt")]})
    before = resolve_dataset_dir(cfg2)[0]
    f = scratch / "keyword.txt"
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # an edited file is new data
    assert resolve_dataset_dir(cfg2)[0] != before

    with pytest.raises(UserError, match=r"data\.paths: '.*\*\.md' matches no file; accepted: \.txt, \.jsonl, \.parquet"):
        resolve_dataset_dir(DataConfig(paths=[str(corpus / "*.md")]))
    with pytest.raises(UserError, match="directory without manifest.json"):
        resolve_dataset_dir(DataConfig(paths=[str(corpus)]))
    with pytest.raises(UserError, match="data.tokenizer"):
        resolve_dataset_dir(cfg.model_copy(update={"tokenizer": str(tmp_path / "none.json")}))


def test_ensure_prepared_prepares_once(corpus, tmp_path, monkeypatch):
    cfg = DataConfig(paths=[str(corpus / "*.txt")], dir=str(tmp_path / "cache"), vocab_size=300)
    d = ensure_prepared(cfg, show_progress=False)
    assert d == resolve_dataset_dir(cfg)[0] and (d / "manifest.json").is_file()
    assert _manifest(d)["vocab_size"] <= 300

    def must_not_run(*a, **k):
        raise AssertionError("prepared again although the manifest exists")

    monkeypatch.setattr(prep, "prepare_dataset", must_not_run)
    assert ensure_prepared(cfg, show_progress=False) == d
    assert ensure_prepared(DataConfig(paths=[str(d)])) == d


def test_default_corpus_files():
    files = default_corpus_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    assert len(files) > 100 and files == sorted(files)
    for f in files:
        assert f.suffix == ".py" and f.is_file()
        assert not {"site-packages", "test", "tests", "idlelib", "lib2to3", "tkinter", "turtledemo"} & set(
            f.relative_to(root).parts[:-1]
        )
    assert root / "textwrap.py" in files
    assert prep.default_corpus_globs() == [str(f) for f in files]
    # Resolving the default corpus is cheap (no tokenizing) and names the cache entry.
    d, inputs = resolve_dataset_dir(DataConfig(dir="cache"))
    assert d.name.startswith("stdlib-") and len(inputs) == len(files)
