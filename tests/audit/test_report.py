"""The audit's outputs from a fixed set of samples: JSON fields, report.md, readable PNGs."""

from __future__ import annotations

import json

import matplotlib.image
import pytest
from rich.console import Console

from detgate.audit.client import ClientStats
from detgate.audit.plots import write_plots
from detgate.audit.report import render_terminal, write_json, write_markdown
from detgate.audit.result import AuditResult, AuditSettings
from detgate.audit.runner import Collected
from detgate.audit.sample import Sample
from detgate.contract.analysis import analyse

CONTRACT_FIELDS = {"n", "unique_completions", "most_common_count", "first_divergence",
                   "logprob_mse_mean", "max_abs_logprob_diff"}
BORN = ["He", " was", " born", " in"]
QUEENS = BORN + [" Queens", ",", " New", " York"]
NYC = BORN + [" New", " York", " City", "."]
IDS = {t: i for i, t in enumerate(dict.fromkeys(QUEENS + NYC))}


def feynman(index: int, tokens: list[str], nudge: float = 0.0) -> Sample:
    return Sample(index, "".join(tokens), tuple(IDS[t] for t in tokens), tuple(tokens),
                  tuple(-0.5 - nudge for _ in tokens))


def result_of(samples: list[Sample]) -> AuditResult:
    settings = AuditSettings("http://127.0.0.1:1/v1", "tiny", "completions", "Tell me about",
                             len(samples), 4, 2, 8, 0.0, None)
    return AuditResult(settings, analyse(samples), Collected(samples=samples), ClientStats(),
                       None, None)


@pytest.fixture(params=["diverging", "identical"])
def result(request) -> AuditResult:
    if request.param == "identical":
        return result_of([feynman(i, QUEENS) for i in range(6)])
    return result_of([feynman(0, QUEENS), feynman(1, QUEENS, 2.0**-30), feynman(2, NYC),
                      feynman(3, QUEENS), feynman(4, NYC)])


def test_json_has_exactly_the_contract_fields_and_details(result, tmp_path):
    write_json(result, tmp_path / "out.json")
    doc = json.loads((tmp_path / "out.json").read_text())
    assert set(doc) == CONTRACT_FIELDS | {"details"}
    assert doc["n"] == result.analysis.n
    assert doc["first_divergence"] == result.analysis.first_divergence
    assert all(isinstance(p, int) for p in doc["first_divergence"])
    assert doc["details"]["compared_by"] == "token_id"


def test_report_dir_has_markdown_table_and_loadable_plots(result, tmp_path):
    names = write_plots(result.analysis, tmp_path)
    write_markdown(result, tmp_path / "report.md", names)
    md = (tmp_path / "report.md").read_text()
    assert "| unique completions |" in md and "| most common count |" in md
    for name in names:
        assert f"![{name}]({name})" in md
        image = matplotlib.image.imread(tmp_path / name)
        assert image.ndim == 3 and image.shape[0] > 100


def test_divergence_is_shown_side_by_side(tmp_path):
    result = result_of([feynman(0, QUEENS), feynman(1, NYC), feynman(2, QUEENS)])
    write_markdown(result, tmp_path / "report.md", [])
    md = (tmp_path / "report.md").read_text()
    assert "| 4 | `He was born in` | ` Queens, New York` | ` New York City.` | 1 |" in md
    console = Console(record=True, width=200)
    render_terminal(result, console)
    text = console.export_text()
    assert "' Queens, New York'" in text and "' New York City.'" in text
    assert "unique completions" in text
