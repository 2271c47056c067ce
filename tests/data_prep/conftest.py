"""Session fixtures for the data_prep tests (helpers live in dp_helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dp_helpers import CORPUS_OPTIONS, build


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """The embedded corpus, cut to 60 documents in 3 shards (stdlib-00/01/02.jsonl.zst)."""
    from data_prep.corpus import CorpusConfig, build_corpus

    directory = tmp_path_factory.mktemp("corpus")
    build_corpus(directory, CorpusConfig(max_docs=60, shards=3))
    return directory


@pytest.fixture(scope="session")
def corpus_reference(tmp_path_factory, small_corpus) -> Path:
    """An uninterrupted 1-worker build of `small_corpus`: the reference outputs."""
    output = tmp_path_factory.mktemp("reference")
    assert build(output, [small_corpus], *CORPUS_OPTIONS) == 0
    return output
