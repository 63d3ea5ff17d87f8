"""README stays true: the two first commands, and every record column documented."""

import re
from pathlib import Path

from profiler.record import COLUMN_NAMES, WORKLOAD_COLUMNS

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
CI = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()


def _code_blocks() -> list[str]:
    return [b.strip() for b in re.findall(r"```\n(.*?)```", README, flags=re.S)]


def test_first_command_sets_up_and_profiles():
    assert _code_blocks()[0] == "bash scripts/setup.sh && .venv/bin/python scripts/profile.py"


def test_second_command_is_what_ci_runs():
    second = _code_blocks()[1]
    assert second in CI, "README's test command must be the one .ci/run executes"


def test_every_result_column_is_documented():
    section = README[README.index("### The columns of `results.csv`"):]
    missing = [c for c in COLUMN_NAMES if f"`{c}`" not in section]
    assert not missing, f"undocumented columns: {missing}"
    assert set(WORKLOAD_COLUMNS) < set(COLUMN_NAMES)


def _section(title: str) -> str:
    start = README.index(title)
    end = README.find("\n## ", start + len(title))
    return README[start:end if end > 0 else None]


def test_every_command_line_flag_is_documented():
    from tests.scripts_loader import load_script

    from estimator.flags import FLAGS

    workload = {flag.option for flag in FLAGS}
    for script, title, skip in (("estimate", "## The command line", set()),
                                ("profile", "## Profiling: `scripts/profile.py`", workload)):
        section = _section(title)
        options = {o for a in load_script(script)._parser()._actions for o in a.option_strings}
        missing = sorted(o for o in options - skip - {"-h", "--help"} if o not in section)
        assert not missing, f"{script}.py flags missing from README's {title!r}: {missing}"
