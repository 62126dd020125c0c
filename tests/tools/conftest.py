"""Fixtures for the tools tests: which isolations work here, a free loopback port, a small made-up corpus."""
import json
import shutil
import socket

import pytest

from aepo_jax.tools import _isolation


def isolation_or_skip(mode: str) -> str:
    """bwrap must work (CI installs it); unshare is tested where the host allows it."""
    if _isolation._probe(mode):
        return mode
    if mode == "bwrap":
        pytest.fail("bubblewrap cannot start a sandbox on this host (is `bwrap` installed? are user namespaces "
                    f"allowed?); which bwrap -> {shutil.which('bwrap')}")
    pytest.skip(f"{mode} isolation does not work on this host")


@pytest.fixture(params=["bwrap", "unshare"])
def isolation(request):
    return isolation_or_skip(request.param)


@pytest.fixture
def free_port() -> int:
    """A loopback port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Made-up facts: nothing here exists outside this test, so only retrieval can answer.
FACTS = [
    ("Zorblat", "Zorblat is the capital city of the kingdom of Quenmar, founded in 1213 by Queen Ysolde."),
    ("Flin River", "The Flin River flows 840 kilometres through Dorra and ends in the Sea of Vask."),
    ("Mount Kessa", "Mount Kessa is the highest peak of the Tarrow range, at 6,112 metres."),
    ("Ysolde of Quenmar", "Queen Ysolde of Quenmar was born in Hallit and reigned for 41 years."),
    ("Brennic language", "Brennic is spoken by about 2 million people on the island of Ossary."),
    ("Ossary", "Ossary is an island nation whose currency is the ossary mark and whose anthem is Blue Tides."),
    ("Pell Observatory", "The Pell Observatory on Mount Kessa discovered the comet Varo-7 in 1988."),
    ("Varo-7", "Varo-7 is a periodic comet with an orbital period of 11.4 years, found at Pell Observatory."),
    ("Hallit", "Hallit is a fishing town in western Quenmar known for its glass lanterns."),
    ("Dorra", "Dorra is a landlocked republic; its largest city is Mirefold and its river is the Flin."),
]


@pytest.fixture(scope="session")
def facts() -> list[tuple[str, str]]:
    return FACTS


@pytest.fixture(scope="session")
def corpus_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    with open(path, "w") as f:
        for i, (title, text) in enumerate(FACTS):
            f.write(json.dumps({"id": str(i), "contents": f"{title}\n{text}"}) + "\n")
    return str(path)
