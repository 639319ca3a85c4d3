"""The GPU check files rendered into the report: every committed file renders, every number shown is a
recorded one, and the committed ``docs/PERFORMANCE.md`` is what the generator writes."""
import bisect
import re
import shutil
from pathlib import Path

import pytest

from regattn.bench import checks, report, results

REPO = Path(__file__).resolve().parents[2]
COMMITTED = checks.check_files(REPO)
# A number standing on its own in a table cell: not part of a name such as ``bf16`` or ``M128``.
SHOWN = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e[-+]?\d+)?(?![\d.])")
# Every number written anywhere in a JSON file, keys and strings included (``..._issue_7.93ms``).
WRITTEN = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def section(stem: str) -> str:
    path, data = next((p, d) for p, d in COMMITTED if p.stem == stem)
    return "\n".join(report.check_section(path, data))


def row(text: str, first_cell: str) -> str:
    """The table row of ``text`` whose first cell is ``first_cell``."""
    return next(line for line in text.splitlines() if line.startswith(f"| {first_cell} |"))


def half_unit(token: str) -> float:
    """Half a unit in the last printed digit of ``token``: how far its value may be from the recorded one."""
    mantissa, _, exponent = token.partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 0.5 * 10.0 ** (int(exponent or 0) - decimals)


def test_every_committed_check_file_renders():
    assert sorted(p.stem for p, _ in COMMITTED) == sorted(checks.CHECKS)
    for path, data in COMMITTED:
        text = "\n".join(report.check_section(path, data))
        assert text.startswith(f"## {checks.CHECKS[path.stem].title} on {path.parent.name}")
        assert "NVIDIA H100 80GB HBM3" in text and "torch 2.11.0+cu130" in text and "triton 3.6.0" in text
        assert text.count("|---") >= 1


@pytest.mark.parametrize("path,data", COMMITTED, ids=[p.stem for p, _ in COMMITTED])
def test_every_number_in_a_table_is_recorded_in_the_file(path, data):
    recorded = sorted(float(n) for n in WRITTEN.findall(path.read_text()))
    lines = "\n".join(report.check_section(path, data)).splitlines()
    shown = [token for line in lines if line.startswith("|") and "---|" not in line for token in SHOWN.findall(line)]
    assert len(shown) > 20
    for token in shown:
        value, tolerance = float(token), half_unit(token) * (1 + 1e-9)
        i = bisect.bisect_left(recorded, value - tolerance)
        assert i < len(recorded) and recorded[i] <= value + tolerance, f"{path.name}: {token} is not recorded"


def test_recorded_fields_land_in_their_rows():
    _, gated = next((p, d) for p, d in COMMITTED if p.stem == "gatedfwa_check")
    first = gated["attention"][0]
    assert f"{checks.cell(first['fwd_ms'])} / {checks.cell(first['fwd_bwd_ms'])}" in row(section("gatedfwa_check"),
                                                                                          first["impl"])
    _, plx = next((p, d) for p, d in COMMITTED if p.stem == "parallax_check")
    text = section("parallax_check")
    assert row(text, "ratio regattn / SDPA cuDNN") == (f"| ratio regattn / SDPA cuDNN | "
                                                       f"{checks.cell(plx['prefill']['ratio_fwd_vs_cudnn'])} | "
                                                       f"{checks.cell(plx['prefill']['ratio_fwdbwd_vs_cudnn'])} |")
    _, scan = next((p, d) for p, d in COMMITTED if p.stem == "scan_check")
    ieee = scan["sections"]["timing"]["targets"]["ieee"]
    cells = row(section("scan_check"), "ieee").split(" | ")
    assert cells[2:5] == [checks.cell(ieee["speedup_vs_sdpa_efficient_fp32"]), f"≥ {checks.cell(ieee['target'])}",
                          checks.cell(ieee["speed_ok"])]
    _, decay = next((p, d) for p, d in COMMITTED if p.stem == "decay_check")
    timed = next(r for r in decay["timing"] if r["method"] == "lightning2")
    assert checks.timed(timed["ms"], timed["vs_fla"]) in row(section("decay_check"), str(timed["B"]))


def test_failed_checks_and_notes_are_shown_as_recorded():
    text = section("gatedfwa_check")
    _, gated = next((p, d) for p, d in COMMITTED if p.stem == "gatedfwa_check")
    failed = [c["case"] for c in gated["correctness"] if not c["pass"]]
    assert failed and all(row(text, case).endswith("| **no** |") for case in failed)
    assert all(f"- {note}" in text for note in gated["notes"])


@pytest.mark.parametrize("stem", sorted(checks.CHECKS))
def test_a_run_cut_off_before_any_section_says_what_is_missing(stem):
    text = "\n".join(report.check_section(Path("benchmarks/results/h100") / f"{stem}.json", {}))
    assert "Not recorded in this run: " + ", ".join(checks.CHECKS[stem].sections) in text


def test_committed_performance_doc_is_the_generated_one(tmp_path):
    shutil.copytree(REPO / results.RESULTS_DIR, tmp_path / results.RESULTS_DIR)
    assert report.write_report(tmp_path).read_text() == (REPO / report.DOC).read_text()


def test_cell_formats():
    assert [checks.cell(v) for v in (None, True, False, 3, 0.1547039970755577, 0.002012204492305129, 0.0)] == \
        ["–", "yes", "**no**", "3", "0.1547", "2.01e-03", "0"]
    assert checks.dims([1, 4096, 16]) == "1×4096×16" and checks.timed("OOM") == "OOM"
    assert checks.cell(float("nan")) == "nan"
