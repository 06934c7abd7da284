"""Input-file groups and the shard manifest without Slurm: byte balance, contiguity, verification,
the manifest refusing a missing group, data.prefixes taking a manifest, and --submit --dry-run."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from megafixed.data import preprocess_groups as pg
from megafixed.data.errors import DataError
from megafixed.data.prefixes import resolve_prefix
from megafixed.data.preprocess import PreprocessOptions, preprocess
from megafixed.data.tokenizers import train_tokenizer


def test_groups_are_contiguous_cover_every_file_and_balance_bytes(tmp_path):
    sizes = [5, 1, 1, 1, 4, 2, 2, 8, 1, 1]
    paths = []
    for i, s in enumerate(sizes):
        p = tmp_path / f"f{i}"
        p.write_bytes(b"x" * s * 1000)
        paths.append(str(p))
    for n in (1, 3, 4, 10, 20):
        groups = pg.plan_groups(paths, n)
        assert [p for g in groups for p in g] == paths  # contiguous, in order, nothing lost
        assert len(groups) == min(n, len(paths)) and all(groups)
    loads = [sum(os.path.getsize(p) for p in g) for g in pg.plan_groups(paths, 3)]
    assert max(loads) <= 12_000 and min(loads) >= 8_000, loads  # 26 kB in three: no group far off a third
    with pytest.raises(DataError, match="must be >= 1"):
        pg.plan_groups(paths, 0)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    import gzip
    import itertools

    from megafixed.data import BUNDLED_CORPUS

    root = tmp_path_factory.mktemp("groups")
    with gzip.open(BUNDLED_CORPUS, "rt") as fh:
        lines = list(itertools.islice(fh, 600))
    files = []
    for i in range(4):
        p = root / f"part{i}.jsonl"
        p.write_text("".join(lines[i * 150:(i + 1) * 150]))
        files.append(str(p))
    return root, files, train_tokenizer([files[0]], str(root / "tok.json"), 400)


def _run(tok):
    return lambda paths, out: preprocess(PreprocessOptions(paths, out, tok, shard_size_mb=0.02, progress=False))


def test_groups_then_manifest_equal_one_run_and_a_missing_group_is_named(corpus, tmp_path):
    root, files, tok = corpus
    prefix = str(tmp_path / "c")
    plan = pg.make_plan(prefix, files, 3, {"tokenizer": tok})
    for i in (0, 2):
        pg.run_group(plan, i, _run(tok))
    assert pg.verify_group(plan, 1) == "has no completed shard (its task did not finish)"
    with pytest.raises(DataError, match=r"no manifest written: group 1 \(part\d\.jsonl.*\) has no completed shard"):
        pg.write_manifest(plan)
    assert not os.path.exists(pg.manifest_path(prefix))
    pg.run_group(plan, 1, _run(tok))
    m = pg.write_manifest(plan)
    one = preprocess(PreprocessOptions(files, str(tmp_path / "one"), tok, shard_size_mb=0.02, progress=False))
    assert (m["documents"], m["tokens"]) == (one.documents, one.tokens)
    got = b"".join(open(p + ".bin", "rb").read() for p in resolve_prefix(pg.manifest_path(prefix)))
    assert got == b"".join(open(p + ".bin", "rb").read() for p in one.outputs["text"])
    # a changed input or a damaged shard is caught, and the group counts as not done
    os.utime(files[0], ns=(1, 1))
    assert "changed since it was tokenized" in pg.verify_group(plan, 0)
    first = resolve_prefix(pg.group_prefix(prefix, 2))[0]
    with open(first + ".bin", "ab") as fh:
        fh.write(b"\0\0")
    assert "broken shard" in pg.verify_group(plan, 2)
    os.remove(first + ".bin")
    with pytest.raises(DataError, match=r"shard .*listed in manifest .* is missing"):
        resolve_prefix(pg.manifest_path(prefix))
    (tmp_path / "not.manifest.json").write_text(json.dumps({"shards": []}))
    with pytest.raises(DataError, match="is not a megafixed shard manifest"):
        resolve_prefix(str(tmp_path / "not.manifest.json"))


def test_submit_dry_run_prints_both_scripts_and_writes_nothing(corpus, tmp_path, capsys):
    from megafixed import cli

    root, files, tok = corpus
    prefix = tmp_path / "out" / "c"
    argv = ["preprocess", "--input", *files, "--tokenizer", tok, "--output-prefix", str(prefix), "--submit",
            "--nodes", "2", "--groups", "3", "--partition", "cpu", "--time", "01:00:00", "--dry-run"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "4 files in 3 groups" in out and "to run: [0, 1, 2]" in out
    assert "#SBATCH --array=0,1,2%2" in out and "#SBATCH --partition=cpu" in out
    assert "preprocess_submit group" in out and "preprocess_submit manifest" in out
    assert not (tmp_path / "out").exists()
    assert cli.main(argv[:-3] + ["--time", "soon", "--dry-run"]) == 2
    assert capsys.readouterr().err.startswith("error: --time 'soon' is not a Slurm time limit")
    prefix.parent.mkdir()
    Path(pg.manifest_path(str(prefix))).write_text("{}")
    assert cli.main(argv) != 0
    assert "exists: this corpus is done; pass --overwrite" in capsys.readouterr().err
    assert sorted(os.listdir(prefix.parent)) == ["c.manifest.json"]  # nothing replaced, nothing added
