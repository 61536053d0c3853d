"""README.md stays a true front door: short, with every callback argument and the two commands."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def _text() -> str:
    return README.read_text()


def test_readme_is_at_most_200_lines():
    assert len(_text().splitlines()) <= 200


def test_every_callback_argument_is_in_the_signature_and_the_table():
    from lightning_ckpt import ActivationCheckpointing

    params = [p for p in inspect.signature(ActivationCheckpointing.__init__).parameters.values() if p.name != "self"]
    text = _text()
    sig = re.search(r"`ActivationCheckpointing\((.*?)\)`", text, re.S)
    assert sig, "README has no ActivationCheckpointing(...) signature"
    listed = [a.split("=")[0].strip() for a in re.split(r",\s*(?![^()]*\))", sig.group(1).replace("\n", " "))]
    assert listed == [p.name for p in params]
    for p in params:
        if p.default is not inspect.Parameter.empty:
            assert f"{p.name}={p.default!r}".replace("'", '"') in sig.group(1).replace("\n", " "), p.name
        assert f"| `{p.name}` |" in text, f"{p.name} has no row in the README's argument table"


def test_the_two_commands_are_there():
    text = _text()
    assert '    python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 -e ".[test]" -c .ci/constraints.txt && OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -n 2 --dist loadfile\n' in text
    assert "examples/train_encoder.py fit --config configs/encoder48.yaml" in text


def test_every_linked_doc_exists():
    for target in re.findall(r"\]\((docs/[^)#]+)\)", _text()):
        assert (README.parent / target).is_file(), target
